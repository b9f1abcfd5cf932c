"""FP8-block source checkpoints (DeepSeek-V3 / Kimi-K2 releases): source precision in the plan, byte accounting,
exact dequantization, re-quantization to NVFP4 / MXFP8 with `verify`, byte-for-byte pass-through, ignored layers.

The test checkpoints are written by backends.synthetic.write_fp8_block_checkpoint in the release layout
(E4M3 `X.weight` + float32 `X.weight_scale_inv` [ceil(N/128), ceil(K/128)]); dims are chosen so that blocks at the
edges are partial in both directions. The dequantization is checked against an independent computation: E4M3 bytes
decoded from their bit fields in pure Python, scaled in numpy float32, rounded to BF16 by integer bit arithmetic.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from precision_dsl.backends import converter, fp8_source
from precision_dsl.backends.quantize import checkpoint_tensors
from precision_dsl.backends.safetensors_io import CheckpointError
from precision_dsl.backends.synthetic import write_fp8_block_checkpoint
from precision_dsl.arch import architecture_from_config, load_architecture
from precision_dsl.precision import FormatKind
from precision_dsl.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
POLICIES = REPO / "policies"
QCFG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}

# Kimi-K2 layout (model_type kimi_k2, DeepseekV3ForCausalLM) at tiny sizes; 192 / 160 / 96 give partial 128-blocks
# along K, 80 / 96 / 160 along N. One module is listed in modules_to_not_convert (bare, without `model.`).
TINY_KIMI = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 192, "intermediate_size": 320,
    "moe_intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 2, "num_key_value_heads": 2,
    "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "q_lora_rank": 96, "kv_lora_rank": 64, "qk_nope_head_dim": 32, "qk_rope_head_dim": 16, "v_head_dim": 32,
    "vocab_size": 64, "num_nextn_predict_layers": 1, "n_group": 1, "topk_group": 1, "torch_dtype": "bfloat16",
    "quantization_config": {**QCFG, "modules_to_not_convert": ["layers.1.mlp.shared_experts"]},
}
# DeepSeek-V3 layout whose K dims are multiples of 128 (SGLang's FP8-block rule), partial blocks along N (160, 192).
TINY_DSV3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 256,
    "intermediate_size": 384, "moe_intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 2,
    "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
    "first_k_dense_replace": 1, "q_lora_rank": 128, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 32, "v_head_dim": 64, "vocab_size": 64, "num_nextn_predict_layers": 1, "n_group": 1,
    "topk_group": 1, "torch_dtype": "bfloat16", "quantization_config": QCFG,
}


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    arch = architecture_from_config(TINY_KIMI, "tiny-kimi")
    # with the per-layer rotary_emb.inv_freq buffers the Kimi-K2 release carries (not weights: accepted, not written)
    return arch, write_fp8_block_checkpoint(arch, tmp_path_factory.mktemp("kimi-src"), shards=3, seed=3,
                                            inv_freq=True)


# ---- independent dequantization ---------------------------------------------------------------------------------
def _e4m3_lut() -> np.ndarray:
    """Value of every E4M3 (fn) byte from its bit fields: bias 7, subnormals below exponent field 1, S.1111.111 NaN."""
    out = np.empty(256, dtype=np.float64)
    for b in range(256):
        s, e, m = b >> 7, (b >> 3) & 0xF, b & 0x7
        if e == 0xF and m == 0x7:
            out[b] = np.nan
        elif e == 0:
            out[b] = (-1) ** s * (m / 8.0) * 2.0 ** -6
        else:
            out[b] = (-1) ** s * (1.0 + m / 8.0) * 2.0 ** (e - 7)
    return out


def _independent_dequant(q_bytes: np.ndarray, scale_inv: np.ndarray, block=(128, 128)) -> np.ndarray:
    vals = _e4m3_lut()[q_bytes].astype(np.float32)  # exact: every E4M3 value is an fp32
    n, k = q_bytes.shape
    rows = np.arange(n) // block[0]
    cols = np.arange(k) // block[1]
    return vals * scale_inv.astype(np.float32)[rows[:, None], cols[None, :]]  # one IEEE fp32 multiply


def _bf16_bits_rne(x: np.ndarray) -> np.ndarray:
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def test_dequantize_matches_independent_decode():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(0, 256, (200, 300), generator=g, dtype=torch.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3C  # no NaN bytes (outside every checkpoint)
    q[0, :8] = torch.tensor([0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE], dtype=torch.uint8)  # +-0, subnormals
    scale = torch.exp2(torch.randn(2, 3, generator=g) * 8).to(torch.float32) * 1.37  # non-pow2 fp32 scales
    got = fp8_source.dequantize_fp8_block(q.view(torch.float8_e4m3fn), scale)
    ref = _independent_dequant(q.numpy(), scale.numpy())
    assert got.dtype == torch.float32 and got.shape == (200, 300)
    assert np.array_equal(got.numpy().view(np.uint32), ref.view(np.uint32))  # bit for bit, edge blocks included
    bf = got.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(bf, _bf16_bits_rne(ref))  # the documented cast rule (RN-even to BF16)
    with pytest.raises(CheckpointError, match="does not match"):
        fp8_source.dequantize_fp8_block(q.view(torch.float8_e4m3fn), scale[:, :2])


# ---- the plan knows the source precision --------------------------------------------------------------------------
def test_plan_source_precision_and_bytes(kimi):
    arch, _ = kimi
    plan = resolve(POLICIES / "nvfp4-pertoken-hp-backward.policy", arch)
    by = plan.by_name()
    fp8 = by["model.layers.2.mlp.experts.1.up_proj.weight"].source_precision
    assert (fp8.kind, fp8.element, fp8.block, fp8.scale_dtype) == (FormatKind.FP8_BLOCK, "e4m3", (128, 128), "fp32")
    # ignored by modules_to_not_convert, and never quantized by DeepSeek-style releases: stored BF16
    for n in ("model.layers.1.mlp.shared_experts.up_proj.weight", "lm_head.weight", "model.layers.4.eh_proj.weight",
              "model.layers.4.shared_head.head.weight", "model.layers.1.mlp.gate.weight", "model.embed_tokens.weight"):
        assert by[n].source_precision.kind == FormatKind.BF16, n
    assert by["model.layers.1.mlp.gate.e_score_correction_bias"].source_precision.kind == FormatKind.FP32
    t = by["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]  # [80, 192]: one 80x128 and one 80x64 block
    assert t.bytes_before == 80 * 192 + 2 * 4
    assert by["lm_head.weight"].bytes_before == 64 * 192 * 2


def test_deepseek_v3_and_kimi_k2_bytes_before_are_the_fp8_release():
    dsv3 = resolve(POLICIES / "bf16.policy", load_architecture("deepseek-v3"))
    before = sum(t.bytes_before for t in dsv3.tensors)
    assert 0.68e12 < before < 0.70e12  # the FP8 release (~0.69 TB), not 1.37 TB of BF16
    assert sum(t.bytes_after for t in dsv3.tensors) > 1.3e12  # a bf16 plan doubles it
    # Kimi-K2-Instruct: the published safetensors hold 139,644 tensors, 1,026,470,731,056 elements and 958.49 GiB
    # (headers listed in a public model-inspection report; the 61 `rotary_emb.inv_freq` buffers [56] are in there).
    arch = load_architecture("kimi-k2")
    plan = resolve(POLICIES / "bf16.policy", arch)
    fp8 = [t for t in plan.tensors if t.source_precision.is_quantized]
    scales = sum(math.ceil(t.shape[0] / 128) * math.ceil(t.shape[1] / 128) for t in fp8)
    assert len(plan.tensors) + len(fp8) + 61 == 139_644
    assert sum(t.numel for t in plan.tensors) + scales + 61 * 56 == 1_026_470_731_056
    assert round((sum(t.bytes_before for t in plan.tensors) + 61 * 56 * 2) / 2**30, 2) == 958.49


def test_unknown_source_quantization_is_noted():
    raw = dict(load_architecture("kimi-k2").config)
    raw["quantization_config"] = {"quant_method": "compressed-tensors", "format": "pack-quantized"}  # K2-Thinking
    plan = resolve(POLICIES / "bf16.policy", architecture_from_config(raw, "k2-thinking"))
    assert any("compressed-tensors" in n for n in plan.notes)


# ---- convert: dequantize + re-quantize, verify ----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["nvfp4-pertoken-hp-backward", "mxfp8-e2e"])
def test_fp8_source_converts_to_plan_and_verifies(kimi, tmp_path, policy):
    arch, src = kimi
    plan = resolve(POLICIES / f"{policy}.policy", arch)
    kinds = {t.weight.kind for t in plan.quantized()}
    assert kinds == {FormatKind.NVFP4 if policy.startswith("nvfp4") else FormatKind.MXFP8}
    dst = tmp_path / "out"
    rep = converter.convert(src, plan, dst)
    assert rep.bytes_in == sum(t.bytes_before for t in plan.tensors)
    assert converter.verify(dst, src) == []
    assert any("inv_freq" in n for n in converter.open_source(src).where)
    assert not any("inv_freq" in n for n in converter.open_source(dst).where)
    cfg = json.loads((dst / "config.json").read_text())["quantization_config"]
    assert cfg["quant_method"] == ("modelopt" if policy.startswith("nvfp4") else "mxfp8")  # the source's fp8 is gone

    from safetensors import safe_open

    def source(name):
        path = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][name]
        with safe_open(str(path), "pt") as f:
            return f.get_tensor(name)

    def independent_bf16(name):
        mod = name.rsplit(".", 1)[0]
        q = source(name).view(torch.uint8).numpy()
        ref = _independent_dequant(q, source(f"{mod}.weight_scale_inv").numpy())
        return torch.from_numpy(_bf16_bits_rne(ref).view(np.int16)).view(torch.bfloat16)

    plan_back, got = converter.load_converted(dst)
    by = plan_back.by_name()
    kept = "model.layers.2.self_attn.kv_b_proj.weight"  # FP8 in the source, BF16 in both plans (keep-bf16)
    assert by[kept].source_precision.is_quantized and not by[kept].weight.is_quantized
    assert torch.equal(got[kept].view(torch.int16), independent_bf16(kept).view(torch.int16))
    ignored = "model.layers.1.mlp.shared_experts.down_proj.weight"  # BF16 in the source (modules_to_not_convert)
    assert torch.equal(got[ignored].view(torch.int16), source(ignored).view(torch.int16))
    # a re-quantized expert: exactly the plan's quantizer applied to the independently dequantized BF16 weights
    name = "model.layers.2.mlp.experts.3.down_proj.weight"  # [192, 160]: K has a partial 32-wide block
    t = by[name]
    assert t.weight.is_quantized and t.source_precision.is_quantized
    grp = plan_back.group_of(name) if t.weight.global_scale == "group" else None
    members = [by[m] for m in grp.members] if grp else [t]
    want = checkpoint_tensors([(m, independent_bf16(m.hf_name)) for m in members])
    reader = converter._Reader(converter.open_source(dst))
    for out_name, ref in want.items():
        assert torch.equal(reader.get(out_name).reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8))


def test_same_format_passes_through_byte_for_byte(tmp_path):
    arch = architecture_from_config(TINY_DSV3, "tiny-dsv3")
    src = write_fp8_block_checkpoint(arch, tmp_path / "src", shards=2, seed=5)
    plan = resolve(POLICIES / "fp8-blockwise-hopper.policy", arch)
    through = [t for t in plan.tensors if fp8_source.passes_through(t)]
    assert len(through) > 20 and all(t.weight.kind == FormatKind.FP8_BLOCK for t in through)
    dst = tmp_path / "out"
    converter.convert(src, plan, dst)
    assert converter.verify(dst, src) == []
    sr, dr = converter._Reader(converter.open_source(src)), converter._Reader(converter.open_source(dst))
    for t in through:
        for n in (t.hf_name, fp8_source.scale_name(t)):
            a, b = sr.get(n), dr.get(n)
            assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8)), n
    kv_b = plan.by_name()["model.layers.1.self_attn.kv_b_proj.weight"]  # FP8 source, kept BF16 by keep-bf16
    assert not fp8_source.passes_through(kv_b) and dr.get(kv_b.hf_name).dtype == torch.bfloat16


# ---- the checkpoint must be what its config says ----------------------------------------------------------------------
def test_source_checkpoint_must_match_the_source_precision(kimi, tmp_path):
    arch, src = kimi
    no_q = {k: v for k, v in TINY_KIMI.items() if k != "quantization_config"}
    plan = resolve(POLICIES / "bf16.policy", architecture_from_config(no_q, "tiny-kimi"))
    with pytest.raises(CheckpointError, match="stored FP8 .* in the source checkpoint, but the plan says"):
        converter.convert(src, plan, tmp_path / "a")
    bf16_src = tmp_path / "bf16src"
    from precision_dsl.backends.synthetic import write_synthetic_checkpoint

    write_synthetic_checkpoint(architecture_from_config(no_q, "x"), bf16_src, shards=1)
    plan = resolve(POLICIES / "bf16.policy", arch)
    with pytest.raises(CheckpointError, match="is BF16 in the source checkpoint, but config.json quantization_config"):
        converter.convert(bf16_src, plan, tmp_path / "b")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("policy", ["nvfp4-pertoken-hp-backward", "mxfp8-e2e", "fp8-blockwise-hopper"])
def test_cuda_conversion_of_an_fp8_source_is_byte_identical_to_cpu(kimi, tmp_path, policy):
    """FP8-block sources on the device path: dequantized (non-blocking copies from the pinned arena) and
    re-quantized, or passed through (fp8-blockwise-hopper on the DeepSeek-V3 layout), byte for byte the CPU's."""
    import hashlib

    if policy == "fp8-blockwise-hopper":
        arch = architecture_from_config(TINY_DSV3, "tiny-dsv3")
        src = write_fp8_block_checkpoint(arch, tmp_path / "src", shards=2, seed=5)
    else:
        arch, src = kimi
    plan = resolve(POLICIES / f"{policy}.policy", arch)
    for device in ("cpu", "cuda"):
        converter.convert(src, plan, tmp_path / device, device=device)
    digest = [{p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted((tmp_path / d).iterdir())}
              for d in ("cpu", "cuda")]
    assert digest[0] == digest[1]
