"""The rollout engine in a separate process (trainer rank 0, rollout rank 1, gloo on CPU; NCCL on 2 GPUs):
the same seeded run gives the same samples, rewards and quantized weights as the in-process engine, and every
update's received bytes equal what the trainer sent (plan-hash handshake + per-tensor sha256)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from precision_dsl.engine.loop import RunConfig, run

ROOT = Path(__file__).resolve().parent.parent
NVFP4 = str(ROOT / "policies" / "nvfp4-pertoken-dequant-backward.policy")


def _cfg(**kw) -> RunConfig:
    base = dict(policy=NVFP4, steps=2, seed=3, prompts_per_step=4, samples_per_prompt=4)
    base.update(kw)
    return RunConfig(**base)


@pytest.mark.slow
def test_out_of_process_rollout_matches_in_process():
    local = run(_cfg())
    remote = run(_cfg(rollout_device="cpu"))
    assert len(remote.steps) == len(local.steps) == 2
    for a, b in zip(local.steps, remote.steps):
        assert b.quantized_weights_identical is True and b.quantized_weights_differing == 0
        assert a.reward_mean == b.reward_mean and a.response_tokens == b.response_tokens
        assert a.weight_update_bytes == b.weight_update_bytes
        assert abs(a.mismatch_abs_logp - b.mismatch_abs_logp) < 1e-6


def test_remote_rollout_refuses_mixed_devices():
    from precision_dsl.engine.remote import RemoteRollout, RemoteRolloutError

    with pytest.raises(RemoteRolloutError):
        RemoteRollout(ROOT, None, trainer_device="cpu", rollout_device="cuda:1")


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (nvidia-h200-x2)")
def test_two_gpu_run_nccl():
    res = run(_cfg(device="cuda", rollout_device="cuda:1", steps=3))
    assert all(s.quantized_weights_identical for s in res.steps)
