"""engine/model.py: HF names + shapes, safetensors loading with clear errors, HF transformers parity, KV cache."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from precision_dsl.engine.model import (ModelLoadError, Qwen3MoeConfig, Qwen3MoeForCausalLM, bundled_model_dir,
                                        load_model, save_model)
from precision_dsl.engine.sampling import sample, sequence_logprobs

TINY = bundled_model_dir("tiny-moe")


@pytest.fixture(scope="module")
def tiny():
    return load_model(TINY)


def test_names_and_shapes_match_the_architecture_catalog(tiny):
    from precision_dsl.arch import load_architecture

    arch = load_architecture("tiny-moe")
    params = dict(tiny.named_parameters())
    assert set(params) == {t.hf_name for t in arch.tensors}
    for t in arch.tensors:
        assert tuple(params[t.hf_name].shape) == tuple(t.shape), t.hf_name
    assert "model.layers.3.mlp.experts.7.gate_proj.weight" in params
    assert "model.layers.0.self_attn.q_norm.weight" in params
    assert sorted(tiny.linear_names()) == sorted(t.hf_name for t in arch.tensors if t.is_linear)


def test_forward_shapes(tiny):
    ids = torch.randint(3, 32, (3, 9))
    with torch.no_grad():
        logits = tiny(ids)
    assert logits.shape == (3, 9, 32)
    assert torch.isfinite(logits).all()


@pytest.mark.slow  # importing transformers dominates (~10-30 s on 2 cores)
def test_matches_hf_transformers_qwen3_moe(tiny):
    import transformers  # the oracle (test extra): missing must fail, not skip
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 6, 14, 7, 8, 18], [1, 9, 9, 14, 4, 4, 18]])
    with torch.no_grad():
        ours, theirs = tiny(ids), hf(ids).logits
    assert (ours - theirs).abs().max() < 1e-4


def test_kv_cache_sampling_equals_full_forward(tiny):
    prompts = [[1, 5, 6, 14, 7, 18], [1, 7, 18], [1, 8, 9, 14, 11, 12, 18], [1, 4, 14, 4, 18]]
    batch = sample(tiny, prompts, max_new_tokens=6, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        full = sequence_logprobs(tiny, batch)
    assert batch.num_response_tokens > len(prompts)
    assert (full - batch.logprobs).abs().max() < 1e-4
    # every response stops at its first EOS and nothing after it is counted
    for row in batch.responses():
        assert 2 not in row[:-1]


def test_sampling_is_seeded(tiny):
    prompts = [[1, 5, 14, 6, 18]] * 8
    a = sample(tiny, prompts, max_new_tokens=5, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(1))
    b = sample(tiny, prompts, max_new_tokens=5, eos_id=2, pad_id=0, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a.tokens, b.tokens)


def _copy_model_dir(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    shutil.copy(TINY / "config.json", d / "config.json")
    return d


def test_save_load_roundtrip_bf16(tmp_path, tiny):
    d = _copy_model_dir(tmp_path)
    save_model(tiny, d / "model.safetensors")
    back = load_model(d)
    for (n, p), (_, q) in zip(tiny.named_parameters(), back.named_parameters()):
        assert torch.equal(p.detach().to(torch.bfloat16).float(), q.detach()), n


def test_shape_mismatch_names_the_tensor(tmp_path):
    from safetensors.torch import save_file

    d = _copy_model_dir(tmp_path)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_file(d / "config.json"))
    sd = {n: p.detach().clone() for n, p in m.named_parameters()}
    sd["model.layers.1.self_attn.k_proj.weight"] = torch.zeros(32, 128)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight has shape \[32, 128\]"):
        load_model(d)


def test_missing_and_unknown_tensors(tmp_path):
    from safetensors.torch import save_file

    d = _copy_model_dir(tmp_path)
    m = Qwen3MoeForCausalLM(Qwen3MoeConfig.from_file(d / "config.json"))
    sd = {n: p.detach().clone() for n, p in m.named_parameters()}
    del sd["lm_head.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="lacks lm_head.weight"):
        load_model(d)
    sd["lm_head.weight"] = torch.zeros(32, 128)
    sd["model.layers.0.mlp.experts.9.up_proj.weight"] = torch.zeros(128, 128)
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="unexpected tensor"):
        load_model(d)


def test_pickle_only_and_bad_config_are_refused(tmp_path):
    d = _copy_model_dir(tmp_path)
    (d / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(ModelLoadError, match="safetensors only"):
        load_model(d)
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="qwen3_moe and qwen3 only"):
        load_model(d)
    (d / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=r"config.json:1:3: invalid JSON"):
        load_model(d)


def test_corrupt_safetensors(tmp_path):
    d = _copy_model_dir(tmp_path)
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match="not a readable safetensors"):
        load_model(d)


def test_moe_dispatch_is_bitwise_the_per_expert_nonzero_dispatch():
    """SparseMoeBlock sorts (token, slot) pairs by expert once per layer (one host sync); each expert must still get
    the rows (topi == e).nonzero() gives, in that order, so outputs and gradients are bit for bit the same as the
    per-expert loop's."""
    import torch
    import torch.nn.functional as F

    from precision_dsl.engine.model import load_model, resolve_model_dir

    model = load_model(resolve_model_dir("tiny-moe"))
    block = next(m for m in model.modules() if type(m).__name__ == "SparseMoeBlock")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 37, model.config.hidden_size, generator=g, requires_grad=True)

    def per_expert(x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        probs = torch.softmax(flat @ block.gate.weight.t(), dim=-1)
        topw, topi = probs.topk(block.top_k, dim=-1)
        topw = topw / topw.sum(-1, keepdim=True)
        out = torch.zeros_like(flat)
        for e, ex in enumerate(block.experts):
            rows, slot = (topi == e).nonzero(as_tuple=True)
            if rows.numel():
                xe = flat[rows]
                y = ex.down_proj(F.silu(ex.gate_proj(xe)) * ex.up_proj(xe)) * topw[rows, slot, None]
                out.index_add_(0, rows, y)
        return out.view(b, t, h)

    got, want = block(x), per_expert(x)
    assert torch.equal(got, want)
    gg = torch.randn(got.shape, generator=g)
    dx_got, = torch.autograd.grad(got, x, gg)
    dx_want, = torch.autograd.grad(want, x, gg)
    assert torch.equal(dx_got, dx_want)


def test_sample_batch_responses_are_the_masked_tokens_of_each_row():
    tokens = torch.tensor([[0, 5, 6, 7, 9], [4, 5, 8, 2, 0]])
    resp = torch.tensor([[0, 0, 1, 1, 0], [0, 0, 1, 1, 1]])
    from precision_dsl.engine.sampling import SampleBatch

    b = SampleBatch(tokens=tokens, attention_mask=torch.ones_like(tokens), response_mask=resp,
                    logprobs=torch.zeros(tokens.shape), prompt_len=2)
    assert b.responses() == [[6, 7], [8, 2, 0]]
    assert b.rows(slice(1, 2)).responses() == [[8, 2, 0]] and b.rows(slice(0, 9)) is b


def _eager_norm(x, w, eps):  # the eager RMSNorm formula F.rms_norm must equal bit for bit
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _eager_rope(x, pos, theta):  # RoPE with per-call tables, the oracle of the shared ones: x [B, H, T, D]
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv
    emb = torch.cat([ang, ang], dim=-1)[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()).to(x.dtype)


@pytest.mark.parametrize("shape", [(4, 7, 64), (3, 5, 2, 32), (2, 3072)], ids=str)
def test_rms_norm_is_bitwise_the_eager_formula_in_fp32(shape):
    """F.rms_norm (one fused kernel each way on CUDA) replaced x * rsqrt(mean(x^2) + eps) * w: on CPU in fp32, the
    trainer's and the oracle's case, values and both gradients are the same bits."""
    from precision_dsl.engine.model import RMSNorm

    g = torch.Generator().manual_seed(1)
    owner = Qwen3MoeForCausalLM.__new__(Qwen3MoeForCausalLM)
    object.__setattr__(owner, "hp_param", lambda p: p)
    norm = RMSNorm(shape[-1], 1e-6, owner)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[-1], generator=g) + 0.5)
    x = torch.randn(shape, generator=g, requires_grad=True)
    gy = torch.randn(shape, generator=g)
    got, want = norm(x), _eager_norm(x, norm.weight, 1e-6)
    assert torch.equal(got, want)
    for a, b in zip(torch.autograd.grad(got, (x, norm.weight), gy), torch.autograd.grad(want, (x, norm.weight), gy)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rope_with_shared_tables_and_written_out_backward_equals_the_eager_rope(dtype):
    """RoPE now runs in the projections' [B, T, H, D] layout on tables made once per forward, with its backward (the
    rotation by -angle) written out: the same values bit for bit, and the same gradients as autograd of the eager
    formula (bitwise up to the sign of a zero sum, which the compare below treats as equal)."""
    from precision_dsl.engine.model import _rope, rope_tables

    g = torch.Generator().manual_seed(2)
    b, t, h, d = 3, 6, 4, 32
    pos = torch.randint(0, 50, (b, t), generator=g)
    x = torch.randn(b, t, h, d, generator=g).to(dtype).requires_grad_()
    cos, sin = rope_tables(pos, d, 1e6)
    got = _rope(x, cos, sin).transpose(1, 2)
    want = _eager_rope(x.transpose(1, 2), pos, 1e6)
    assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    gy = torch.randn(got.shape, generator=g).to(dtype)
    (dx_got,), (dx_want,) = torch.autograd.grad(got, x, gy), torch.autograd.grad(want, x, gy)
    assert torch.equal(dx_got, dx_want)
    with torch.no_grad():  # no autograd graph: the plain rotation, same values
        assert torch.equal(_rope(x, cos, sin), got.transpose(1, 2))


def test_left_pad_right_aligns_every_prompt_after_pad_slots():
    from precision_dsl.engine.sampling import left_pad

    prompts = [[5, 6, 7], [9], [1, 2, 3, 4, 5], [8, 8]]
    ids, mask = left_pad(prompts, 0, "cpu")
    assert ids.tolist() == [[0, 0, 5, 6, 7], [0, 0, 0, 0, 9], [1, 2, 3, 4, 5], [0, 0, 0, 8, 8]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    assert ids.dtype == mask.dtype == torch.long


def test_transformers5_config_names_are_read_like_plan_and_check_read_them(tmp_path):
    """transformers 5 saves a Qwen3-MoE config with `num_local_experts`; `policyc plan/check` accept it (arch's
    aliases), so the embedded engine reads it through the same aliases."""
    from precision_dsl.arch import load_architecture
    from precision_dsl.errors import PolicycError

    src = bundled_model_dir("tiny-moe")
    raw = json.loads((src / "config.json").read_text())
    d = tmp_path / "t5"
    shutil.copytree(src, d)
    t5 = {("num_local_experts" if k == "num_experts" else k): v for k, v in raw.items()}
    (d / "config.json").write_text(json.dumps(t5))
    load_architecture(str(d))  # plan/check accept it
    assert Qwen3MoeConfig.from_file(d / "config.json") == Qwen3MoeConfig.from_dict(raw)
    load_model(d)
    (d / "config.json").write_text(json.dumps({**t5, "num_experts": t5["num_local_experts"] + 1}))
    with pytest.raises(PolicycError, match="disagree"):
        Qwen3MoeConfig.from_file(d / "config.json")
