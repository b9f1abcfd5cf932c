"""The layout rules (precision_dsl/parallel.py layout_violations) against the engines that enforce them.

Each trainer rule is judged by megatron-core 0.16.1's own code, constructed here on the same sizes: TransformerConfig
(heads, query groups, pipeline stages with the emitter's own uneven split), BaseMoELayer (experts % ep) and the
RowParallelLinear a linear_fc2 is (FFN widths % tp / etp), given a process group of the layout's size. For every
degree tried, the rule fires exactly when megatron-core refuses. The rollout rules are read in SGLang 0.5.23's own
model / layer source (asserts), and the gate refuses the brief's layout before anything is written.
"""

from __future__ import annotations

import json
import re
import warnings
import zipfile
from types import SimpleNamespace
from unittest import mock

import pytest
import torch

from conftest import StrictCliRunner
from oracles.sglang_oracle import sglang_wheel
from precision_dsl.arch import architecture_from_config
from precision_dsl.parallel import layout_violations, parse_parallel
from precision_dsl.resources import models_dir, policies_dir

warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex are not installed.*")


def arch_of(model: str, **overrides):
    cfg = json.loads((models_dir() / model / "config.json").read_text())
    cfg.update(overrides)
    return architecture_from_config(cfg, f"{model}+{overrides}")


def rules(arch, spec: str, side: str = "trainer") -> set[str]:
    return {v.rule for v in layout_violations(arch, parse_parallel(spec)) if v.side == side}


def transformer_config(**kw):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                pipeline_dtype=torch.bfloat16)
    return TransformerConfig(**{**base, **kw})


def megatron_refuses(build) -> bool:
    try:
        build()
    except (ValueError, AssertionError):
        return True
    return False


class _Group:
    """A process group of a given size (rank 0): what megatron-core's layers ask of one."""

    def __init__(self, n: int):
        self.n = n

    def size(self) -> int:
        return self.n

    def rank(self) -> int:
        return 0


def _distributed():
    return mock.patch("torch.distributed.is_initialized", return_value=True)


def test_heads_rule_is_megatrons():
    arch = arch_of("qwen3-30b-a3b")  # 32 heads, 4 KV heads
    for tp in (2, 3, 4, 6, 8, 12, 16, 32, 64):
        refused = megatron_refuses(lambda: transformer_config(num_attention_heads=32, num_query_groups=4,
                                                              tensor_model_parallel_size=tp))
        assert ("heads % tp" in rules(arch, f"trainer:tp={tp}") or
                "query groups % tp" in rules(arch, f"trainer:tp={tp}")) == refused, tp


def test_query_groups_rule_is_megatrons():
    arch = arch_of("qwen3-8b", num_attention_heads=48, num_key_value_heads=12)
    for tp in (4, 6, 8, 12, 16, 24, 48):
        refused = megatron_refuses(lambda: transformer_config(num_attention_heads=48, num_query_groups=12,
                                                              tensor_model_parallel_size=tp))
        found = rules(arch, f"trainer:tp={tp}")
        assert "heads % tp" not in found  # 48 heads: every tp here divides them
        assert ("query groups % tp" in found) == refused, tp
    assert {"query groups % tp"} <= rules(arch, "trainer:tp=16") and rules(arch, "trainer:tp=24") == set()


def test_experts_rule_is_megatrons():
    from megatron.core.transformer.moe.moe_layer import BaseMoELayer

    class Layer(BaseMoELayer):
        def forward(self, hidden_states):
            return hidden_states

    arch = arch_of("qwen3-30b-a3b", num_experts=64)
    config = transformer_config(num_moe_experts=64)
    for ep in (2, 3, 4, 6, 8, 64, 96):
        with _distributed():
            refused = megatron_refuses(lambda: Layer(config, pg_collection=SimpleNamespace(ep=_Group(ep),
                                                                                            tp=_Group(1))))
        assert ("experts % ep" in rules(arch, f"trainer:ep={ep}")) == refused, ep
    assert "experts % ep" in rules(arch, "trainer:ep=3")


def _fc2_refuses(ffn: int, tp: int) -> bool:
    """megatron-core's RowParallelLinear (linear_fc2 of an MLP, of each expert with the expert-TP group) on `tp`."""
    from megatron.core.tensor_parallel.layers import RowParallelLinear

    config = transformer_config()
    with _distributed():
        return megatron_refuses(lambda: RowParallelLinear(ffn, 8, config=config, init_method=torch.nn.init.zeros_,
                                                          bias=False, input_is_parallel=True, skip_bias_add=True,
                                                          tp_group=_Group(tp)))


def test_ffn_rule_is_megatrons():
    arch = arch_of("qwen3-8b", intermediate_size=12300)  # 12300 = 4 * 3 * 5^2 * 41
    for tp in (2, 3, 4, 8, 16):
        assert ("ffn % tp" in rules(arch, f"trainer:tp={tp}")) == _fc2_refuses(12300, tp), tp
    assert "ffn % tp" in rules(arch, "trainer:tp=8")


def test_expert_ffn_rule_is_megatrons():
    arch = arch_of("qwen3-30b-a3b")  # moe_intermediate_size 768 = 2^8 * 3
    for etp in (2, 3, 5, 7, 8, 512):
        spec = f"trainer:etp={etp},ep=2"
        assert ("moe ffn % etp" in rules(arch, spec)) == _fc2_refuses(768, etp), etp
    assert "moe ffn % etp" in rules(arch, "trainer:etp=5")


def test_pipeline_rule_is_megatrons_with_the_emitters_split():
    from precision_dsl.backends.megatron import pipeline_split

    arch = arch_of("tiny-moe")  # 4 decoder layers
    seen = set()
    for pp in (2, 3, 4, 5, 6, 8):
        split = pipeline_split(arch.num_layers, pp)
        kw = {} if split is None else dict(num_layers_in_first_pipeline_stage=split[0] or None,
                                           num_layers_in_last_pipeline_stage=split[1] or None)
        refused = megatron_refuses(lambda: transformer_config(num_layers=arch.num_layers,
                                                              pipeline_model_parallel_size=pp, **kw))
        assert ("layers >= pp" in rules(arch, f"trainer:pp={pp}")) == refused, pp
        seen.add(refused)
    assert seen == {True, False}  # an uneven split Megatron accepts (pp=3) is no violation


def test_vocab_is_no_rule_and_a_good_layout_is_clean():
    arch = arch_of("qwen3-30b-a3b", vocab_size=151937)  # padded by both engines
    assert layout_violations(arch, parse_parallel("trainer:tp=4,ep=8,pp=4 rollout:tp=8,ep=8")) == []
    assert layout_violations(arch_of("deepseek-v3"), parse_parallel("trainer:tp=8,ep=64,pp=8 rollout:tp=8,ep=8")) == []


def test_rollout_rules_and_sglangs_asserts(sglang_wheel_sources):
    arch = arch_of("qwen3-30b-a3b", num_experts=64)
    assert rules(arch, "rollout:tp=3", "rollout") == {"heads % tp", "kv heads % tp"}
    assert rules(arch, "rollout:tp=8", "rollout") == set()  # 4 KV heads replicated over 8
    assert rules(arch, "rollout:tp=6,ep=3", "rollout") >= {"heads % tp", "experts % ep"}
    assert rules(arch_of("qwen3-30b-a3b", moe_intermediate_size=100), "rollout:tp=8,ep=1", "rollout") == \
        {"moe ffn % moe_tp"}
    assert rules(arch_of("qwen3-8b", intermediate_size=12300), "rollout:tp=8", "rollout") == {"ffn % tp"}
    # SGLang's own code holds each assert the rollout rules name
    qwen3_moe, fused_moe, linear = (sglang_wheel_sources[k] for k in ("qwen3_moe", "fused_moe", "linear"))
    assert "assert self.total_num_heads % attn_tp_size == 0" in qwen3_moe
    assert "assert self.total_num_kv_heads % attn_tp_size == 0" in qwen3_moe
    assert "assert attn_tp_size % self.total_num_kv_heads == 0" in qwen3_moe
    assert "assert self._num_global_routed % storage_ep_size == 0" in fused_moe
    assert "assert intermediate_size % self.moe_tp_size == 0" in fused_moe
    assert re.search(r"self\.input_size_per_partition = divide\(input_size, tp_size\)", linear)
    assert re.search(r"self\.num_heads = divide\(self\.total_num_heads, tp_size\)", linear)


@pytest.fixture(scope="module")
def sglang_wheel_sources() -> dict[str, str]:
    with zipfile.ZipFile(sglang_wheel()) as z:
        return {k: z.read(f"sglang/srt/{p}").decode() for k, p in (
            ("qwen3_moe", "models/qwen3_moe.py"), ("fused_moe", "layers/moe/fused_moe_triton/layer.py"),
            ("linear", "layers/linear.py"))}


def test_the_gate_refuses_the_layout_before_writing(tmp_path):
    from precision_dsl.cli import app

    model = tmp_path / "m"
    model.mkdir()
    cfg = json.loads((models_dir() / "qwen3-30b-a3b" / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "num_experts": 64}))
    out = tmp_path / "out"
    policy = policies_dir() / "bf16.policy"
    r = StrictCliRunner().invoke(app, ["emit", str(policy), "--model", str(model), "--parallel",
                                       "trainer:tp=3,ep=3 rollout:tp=3", "-o", str(out)])
    assert r.exit_code != 0 and not out.exists()
    for rule in ("heads % tp", "query groups % tp", "experts % ep", "kv heads % tp"):
        assert rule in r.output, rule
    assert "megatron-core 0.16.1" in r.output and "SGLang 0.5.23" in r.output
    assert "Traceback" not in r.output
