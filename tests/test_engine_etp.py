"""Expert-TP and per-token activation scales in the embedded engine: a row-parallel expert down_proj computes its
per-token scale inside each partition, so trainer and rollout must use the same ETP. Unequal ETP is refused before
launch (the same `policyc check` rule); forced, it raises the train-rollout mismatch although every weight byte is
identical."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from precision_dsl.engine import numerics
from precision_dsl.engine.loop import ContractViolation, RunConfig, run
from precision_dsl.precision import TensorFormat

ROOT = Path(__file__).resolve().parent.parent
NVFP4 = str(ROOT / "policies" / "nvfp4-pertoken-dequant-backward.policy")
MISMATCH_BOUND = 2e-3  # the documented consistent-contract bound (tests/test_engine_rollout.py)
PER_TOKEN = TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row")
PER_TENSOR = TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="tensor")


def test_partitioned_fake_quant_is_per_shard():
    x = torch.randn(8, 128) * torch.linspace(0.1, 4, 128)
    whole = numerics.fake_quantize(x, PER_TOKEN)
    assert torch.equal(numerics.fake_quantize_partitioned(x, PER_TOKEN, 1), whole)
    two = numerics.fake_quantize_partitioned(x, PER_TOKEN, 2)
    halves = torch.cat([numerics.fake_quantize(x[:, :64].contiguous(), PER_TOKEN),
                        numerics.fake_quantize(x[:, 64:].contiguous(), PER_TOKEN)], 1)
    assert torch.equal(two, halves) and not torch.equal(two, whole)
    with pytest.raises(numerics.EngineFormatError):
        numerics.fake_quantize_partitioned(x[:, :96], PER_TOKEN, 5)


def _cfg(**kw) -> RunConfig:
    # mirror rollout numerics: the only difference left between trainer and rollout is the ETP scale scope
    base = dict(policy=NVFP4, steps=2, seed=5, prompts_per_step=4, samples_per_prompt=4, rollout_numerics="mirror")
    base.update(kw)
    return RunConfig(**base)


def test_unequal_etp_is_refused_before_launch():
    with pytest.raises(ContractViolation, match="etp-mismatch"):
        run(_cfg(trainer_etp=2, rollout_etp=1))


@pytest.mark.slow
def test_forced_unequal_etp_raises_mismatch_equal_etp_does_not():
    equal = run(_cfg(trainer_etp=2, rollout_etp=2))
    forced = run(_cfg(trainer_etp=2, rollout_etp=1, force_layout=True))
    assert all(s.quantized_weights_identical for s in equal.steps + forced.steps)  # weights are not the issue
    assert max(s.mismatch_abs_logp for s in equal.steps) < MISMATCH_BOUND
    assert min(s.mismatch_abs_logp for s in forced.steps) > MISMATCH_BOUND
