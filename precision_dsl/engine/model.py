"""Qwen3-MoE in plain PyTorch, with HuggingFace tensor names, loadable from any HF safetensors checkpoint.

Parameter names are exactly the checkpoint's (`model.layers.3.mlp.experts.5.gate_proj.weight`, ...), so the plan's
`TensorPlan.hf_name` is also the module path here and one loader serves the bundled tiny-moe and a real Qwen3-MoE.

Every GEMM weight lives in a `PlanLinear`. Its forward does not multiply by itself: it calls the model's
*linear executor* (`executor(hf_name, x, weight) -> y`). The trainer installs a plan-driven quantized executor
(qlinear.TrainerExecutor); the rollout engine installs one that uses the weights it received over the weight-update
path (rollout.RolloutExecutor). The default executor is a plain FP32 matmul.

Non-GEMM parameters (embedding, norms, router) go through `model.hp_param(p)`, which the trainer sets to a
straight-through BF16 rounding so that trainer and rollout (which receives BF16 bytes) see the same values.

Numerics: compute is FP32 (CPU and GPU alike); operand rounding to BF16 / quantized grids is done by the executor.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn
from ..errors import PolicycError
from . import grouped_experts

LinearExecutor = Callable[[str, torch.Tensor, torch.Tensor], torch.Tensor]


class ModelLoadError(PolicycError, ValueError):
    """A checkpoint or config does not match the Qwen3-MoE architecture; message names the tensor/file + a fix."""


def _fp32_linear(hf_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ARG001
    return x @ w.t()


def _identity(p: torch.Tensor) -> torch.Tensor:
    return p


# ---------------------------------------------------------------------------------------------------------------
# config
# ---------------------------------------------------------------------------------------------------------------
def _public_names(d: dict, source: str) -> dict:
    """config.json with the attribute names transformers 5 writes (Qwen3-MoE `num_local_experts`) mapped onto the
    public names, by the same family table `policyc plan/check` read configs with (one reading, not two)."""
    from precision_dsl.arch.families import apply_aliases, dispatch

    family, _arch_class = dispatch(d, source)
    return apply_aliases(d, family.adapter, source)


@dataclass(frozen=True)
class Qwen3MoeConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    num_experts: int
    num_experts_per_tok: int
    norm_topk_prob: bool = True
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    bos_token_id: Optional[int] = None
    eos_token_id: Optional[int] = None
    pad_token_id: Optional[int] = None
    raw: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def from_dict(cls, d: dict, source: str = "config.json") -> "Qwen3MoeConfig":
        if d.get("model_type") not in ("qwen3_moe", "qwen3", None):
            raise ModelLoadError(f"{source}: model_type is {d.get('model_type')!r}; the embedded engine implements "
                                 "qwen3_moe and qwen3 only (hint: use --engine miles for other architectures)")
        if d.get("model_type") is not None:
            d = _public_names(d, source)
        if d.get("model_type") == "qwen3":  # dense Qwen3: every layer is a DenseMLP
            d = {**d, "num_experts": 0, "num_experts_per_tok": 0, "moe_intermediate_size": 0}
        required = ["vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
                    "num_attention_heads", "num_key_value_heads", "num_experts", "num_experts_per_tok"]
        missing = [k for k in required if k not in d]
        if missing:
            raise ModelLoadError(f"{source}: missing field(s) {', '.join(missing)} (hint: is this a Qwen3-MoE "
                                 "config.json?)")
        head_dim = d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"]
        eos = d.get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0]
        return cls(
            vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
            moe_intermediate_size=d["moe_intermediate_size"], num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=d["num_attention_heads"], num_key_value_heads=d["num_key_value_heads"],
            head_dim=head_dim, num_experts=d["num_experts"], num_experts_per_tok=d["num_experts_per_tok"],
            norm_topk_prob=bool(d.get("norm_topk_prob", True)), rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=float(d.get("rope_theta") or (d.get("rope_parameters") or {}).get("rope_theta", 10000.0)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            decoder_sparse_step=int(d.get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"), eos_token_id=eos, pad_token_id=d.get("pad_token_id"), raw=d,
        )

    @classmethod
    def from_file(cls, path: Path) -> "Qwen3MoeConfig":
        try:
            d = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ModelLoadError(f"{path}: no config.json (hint: pass a HF model directory)") from None
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{path}:{e.lineno}:{e.colno}: invalid JSON: {e.msg}") from None
        return cls.from_dict(d, str(path))

    def is_sparse(self, layer: int) -> bool:
        return (layer not in self.mlp_only_layers and self.num_experts > 0
                and (layer + 1) % self.decoder_sparse_step == 0)


# ---------------------------------------------------------------------------------------------------------------
# modules (attribute names = HF names)
# ---------------------------------------------------------------------------------------------------------------
class PlanLinear(nn.Module):
    """A bias-free linear whose GEMM is delegated to the owning model's executor (looked up by HF name)."""

    def __init__(self, in_features: int, out_features: int, hf_name: str, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.hf_name = hf_name  # full tensor name, e.g. model.layers.0.self_attn.q_proj.weight
        object.__setattr__(self, "_owner", owner)  # not a submodule: avoids a reference cycle in named_modules

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._owner.linear_executor(self.hf_name, x, self.weight)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        object.__setattr__(self, "_owner", owner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) * w. For fp32 x, F.rms_norm on CPU runs exactly those ops (bitwise the same
        # values and gradients, tests/test_engine_model.py); on CUDA it is one fused kernel each way (torch >= 2.8):
        # 1.8 ms vs 5.6 ms forward + backward at 49k tokens x 3072 on the H200 (benchmarks/fused_ops_probe.py). A bf16
        # x (the rollout's model) is normalised in fp32 and rounded once, as SGLang's RMSNorm kernel does.
        return F.rms_norm(x, (x.shape[-1],), self._owner.hp_param(self.weight), self.eps)


def rope_tables(pos: torch.Tensor, d: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [B, T, 1, D] (fp32) of rotate-half RoPE (HF Qwen3) at integer positions pos [B, T]: made once per
    forward and shared by every layer's q and k."""
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, device=pos.device, dtype=torch.float32) / d))
    ang = pos.to(torch.float32)[..., None] * inv  # [B, T, D/2]
    emb = torch.cat([ang, ang], dim=-1)[:, :, None]  # [B, T, 1, D]
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)  # bf16 model (rollout): stays bf16


class _Rope(torch.autograd.Function):
    """y = x * cos + rotate_half(x) * sin on x [B, T, H, D]. The backward is the rotation by -angle, written out:
    autograd of the forward's slices and cat spends a zero-filled buffer and an add per slice on it."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        ctx.dtype = x.dtype
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, g):
        cos, sin = ctx.saved_tensors
        u1, u2 = (g * sin).to(ctx.dtype).chunk(2, dim=-1)
        return (g * cos).to(ctx.dtype) + torch.cat([u2, -u1], dim=-1), None, None


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on x [B, T, H, D] with rope_tables' cos, sin [B, T, 1, D]."""
    return _Rope.apply(x, cos, sin) if torch.is_grad_enabled() and x.requires_grad else _rotate(x, cos, sin)


class Attention(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, prefix: str, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        h, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = PlanLinear(h, nh * hd, f"{prefix}.q_proj.weight", owner)
        self.k_proj = PlanLinear(h, nkv * hd, f"{prefix}.k_proj.weight", owner)
        self.v_proj = PlanLinear(h, nkv * hd, f"{prefix}.v_proj.weight", owner)
        self.o_proj = PlanLinear(nh * hd, h, f"{prefix}.o_proj.weight", owner)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, owner)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, owner)
        self.nh, self.nkv, self.hd = nh, nkv, hd

    def forward(self, x, rope, key_mask, cache: Optional[dict]):
        b, t, _ = x.shape
        cos, sin = rope
        # norm and RoPE in the projections' own [B, T, H, D] layout (contiguous), then heads first for attention
        q = _rope(self.q_norm(self.q_proj(x).view(b, t, self.nh, self.hd)), cos, sin).transpose(1, 2)
        k = _rope(self.k_norm(self.k_proj(x).view(b, t, self.nkv, self.hd)), cos, sin).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.nkv, self.hd).transpose(1, 2)
        if cache is not None:  # KV cache: append this call's keys/values
            if "k" in cache:
                k = torch.cat([cache["k"], k], dim=2)
                v = torch.cat([cache["v"], v], dim=2)
            cache["k"], cache["v"] = k, v
        rep = self.nh // self.nkv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        s = k.shape[2]
        # causal over absolute cache slots (queries are the last t slots) + key padding mask
        qi = torch.arange(s - t, s, device=x.device)[:, None]
        ki = torch.arange(s, device=x.device)[None, :]
        allowed = (ki <= qi)[None, None] & key_mask[:, None, None, :s].bool()
        # scores and softmax in fp32, P cast to V's dtype for PV (FlashAttention's regime; no-op for an fp32 model)
        att = (q.float() @ k.float().transpose(-1, -2)) / math.sqrt(self.hd)
        att = att.masked_fill(~allowed, float("-inf"))
        # fully-masked rows (query at a left-pad slot) would be NaN: give them a uniform distribution instead
        att = torch.where(allowed.any(-1, keepdim=True), att, torch.zeros_like(att))
        y = torch.softmax(att, dim=-1).to(v.dtype) @ v
        return self.o_proj(y.transpose(1, 2).reshape(b, t, self.nh * self.hd))


class Expert(nn.Module):
    def __init__(self, h: int, inter: int, prefix: str, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        self.gate_proj = PlanLinear(h, inter, f"{prefix}.gate_proj.weight", owner)
        self.up_proj = PlanLinear(h, inter, f"{prefix}.up_proj.weight", owner)
        self.down_proj = PlanLinear(inter, h, f"{prefix}.down_proj.weight", owner)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, prefix: str, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)  # router: never quantized
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, f"{prefix}.experts.{e}", owner)
            for e in range(cfg.num_experts))
        self.top_k, self.norm_topk = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.prefix = prefix
        # per expert its (gate, up, down) weight names: what an executor's grouped op is asked for
        self.trios = [(x.gate_proj.hf_name, x.up_proj.hf_name, x.down_proj.hf_name) for x in self.experts]
        object.__setattr__(self, "_owner", owner)

    def forward(self, x):
        b, t, h = x.shape
        flat = x.reshape(-1, h)
        logits = flat @ self._owner.hp_param(self.gate.weight).t()
        probs = torch.softmax(logits, dim=-1)
        topw, topi = probs.topk(self.top_k, dim=-1)
        if self._owner.routing is not None:  # record (rollout) or replay (trainer) the expert choice: routing.py
            topi = self._owner.routing(self.prefix, topi.view(b, t, -1)).reshape(b * t, -1)
            topw = probs.gather(-1, topi)
        if self.norm_topk:
            topw = topw / topw.sum(-1, keepdim=True)
        # an executor that runs all experts as one grouped op on this device (grouped_experts.py) gets them whole
        grouped = getattr(self._owner.linear_executor, "grouped_experts", None)
        run = grouped(self.trios, flat) if grouped is not None and flat.shape[0] else None
        if run is not None:
            d = grouped_experts.dispatch(topi, len(self.experts), run.align)
            if getattr(run, "takes_tokens", False):  # it gathers its per-token operand itself (rollout_gemm)
                y = run(flat, d, self.top_k)
            else:
                y = run(grouped_experts.gather(flat, self.top_k, d), d)
            return grouped_experts.combine(y, topw, d).to(x.dtype).view(b, t, h)
        out = torch.zeros_like(flat, dtype=torch.float32)  # combine in fp32 (a bf16 rollout casts back below)
        # token-dropless dispatch, one GEMM group per expert. The (token, slot) pairs are sorted by expert once and
        # the per-expert counts read back in ONE host sync per layer (a nonzero() per expert was one sync each).
        # The stable sort keeps each expert's pairs in ascending (token, slot) order: the same rows in the same
        # order as (topi == e).nonzero(), so every expert GEMM and the fp32 combine are unchanged bit for bit.
        pairs = topi.reshape(-1)
        order = pairs.argsort(stable=True)
        counts = torch.bincount(pairs, minlength=len(self.experts)).tolist()
        start = 0
        for expert, n in zip(self.experts, counts):
            if n == 0:
                continue
            sel = order[start:start + n]
            start += n
            rows, slot = sel // self.top_k, sel % self.top_k
            y = expert(flat[rows]) * topw[rows, slot, None]
            out.index_add_(0, rows, y.float())  # in place: one copy of the [tokens, hidden] sum, not one per expert
        return out.to(x.dtype).view(b, t, h)


class DenseMLP(Expert):
    pass


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, i: int, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        p = f"model.layers.{i}"
        self.self_attn = Attention(cfg, f"{p}.self_attn", owner)
        self.mlp = (SparseMoeBlock(cfg, f"{p}.mlp", owner) if cfg.is_sparse(i)
                    else DenseMLP(cfg.hidden_size, cfg.intermediate_size, f"{p}.mlp", owner))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, owner)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, owner)

    def forward(self, x, rope, key_mask, cache):
        x = x + self.self_attn(self.input_layernorm(x), rope, key_mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3MoeModel(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, owner: "Qwen3MoeForCausalLM"):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, owner) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, owner)


class Qwen3MoeForCausalLM(nn.Module):
    def __init__(self, cfg: Qwen3MoeConfig, init: bool = True):
        """init=False leaves the parameters uninitialised (torch.empty): for callers that overwrite every one of
        them (a checkpoint load, the rollout's NaN fill) - the seeded CPU randn costs seconds per 100M params."""
        super().__init__()
        self.config = cfg
        self.linear_executor: LinearExecutor = _fp32_linear
        self.hp_param: Callable[[torch.Tensor], torch.Tensor] = _identity
        # MoE routing hook (prefix, top-k indices [B, T, k]) -> indices to use; None = the model's own top-k
        self.routing: Optional[Callable[[str, torch.Tensor], torch.Tensor]] = None
        self.model = Qwen3MoeModel(cfg, self)
        # tied embeddings (small Qwen3s): no lm_head tensor in the checkpoint, the plan or the weight update
        self.lm_head = None if cfg.tie_word_embeddings else PlanLinear(cfg.hidden_size, cfg.vocab_size,
                                                                          "lm_head.weight", self)
        if init:
            self.reset_parameters(seed=0)

    # -- init ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self, seed: int, std: Optional[float] = None) -> None:
        std = std if std is not None else float(self.config.raw.get("initializer_range", 0.02))
        g = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".q_norm." in name or ".k_norm." in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)

    # -- names -----------------------------------------------------------------------------------------------
    def hf_state_names(self) -> list[str]:
        names = [n for n, _ in self.named_parameters()]
        if self.config.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        return names

    def linear_names(self) -> list[str]:
        return [m.hf_name for m in self.modules() if isinstance(m, PlanLinear)]

    # -- forward ---------------------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, attention_mask: Optional[torch.Tensor] = None,
                cache: Optional[list[dict]] = None, positions: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Logits [B, T, V]. `attention_mask` [B, S] covers cache + new tokens (1 = real, 0 = pad); positions
        default to (number of real tokens before each slot). With `cache` (a list of per-layer dicts, possibly
        empty dicts) keys/values are appended, so decoding one token at a time matches the full forward."""
        b, t = input_ids.shape
        if attention_mask is None:
            past = cache[0]["k"].shape[2] if cache and "k" in cache[0] else 0
            attention_mask = torch.ones(b, past + t, dtype=torch.long, device=input_ids.device)
        if positions is None:
            positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]
        x = F.embedding(input_ids, self.hp_param(self.model.embed_tokens.weight))
        rope = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, attention_mask, cache[i] if cache is not None else None)
        x = self.model.norm(x)
        if self.config.tie_word_embeddings:
            return x @ self.hp_param(self.model.embed_tokens.weight).t()
        return self.lm_head(x)

    def new_cache(self) -> list[dict]:
        return [{} for _ in range(self.config.num_hidden_layers)]


# ---------------------------------------------------------------------------------------------------------------
# loading / saving (safetensors only)
# ---------------------------------------------------------------------------------------------------------------
def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            wm = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"{index}: not a valid safetensors index ({e})") from None
        return [model_dir / f for f in sorted(set(wm.values()))]
    single = model_dir / "model.safetensors"
    if single.exists():
        return [single]
    if list(model_dir.glob("*.bin")) or list(model_dir.glob("*.pt")):
        raise ModelLoadError(f"{model_dir}: only pickle checkpoints (*.bin/*.pt) found; policyc reads safetensors "
                             "only (hint: convert with `transformers` save_pretrained(safe_serialization=True))")
    raise ModelLoadError(f"{model_dir}: no model.safetensors (hint: for tiny-moe run "
                         "`python examples/warmstart_tiny_moe.py` to create it)")


def load_model(model_dir: Path, *, allow_missing: bool = False) -> Qwen3MoeForCausalLM:
    """Build the model from `model_dir/config.json` and load its safetensors weights (names and shapes validated
    against the config; extra tensors such as MTP layers are reported, not silently used)."""
    from safetensors import safe_open

    model_dir = Path(model_dir)
    cfg = Qwen3MoeConfig.from_file(model_dir / "config.json")
    model = Qwen3MoeForCausalLM(cfg, init=allow_missing)  # every parameter is loaded below (else: an error)
    params = dict(model.named_parameters())
    expected = set(model.hf_state_names())
    seen: set[str] = set()
    extra: list[str] = []
    for f in _checkpoint_files(model_dir):
        if not f.exists():
            raise ModelLoadError(f"{f}: listed in the safetensors index but missing")
        try:
            handle = safe_open(str(f), framework="pt")
        except Exception as e:  # safetensors raises its own error types for corrupt headers
            raise ModelLoadError(f"{f}: not a readable safetensors file ({e})") from None
        with handle:
            for name in handle.keys():
                if name not in expected:
                    extra.append(name)
                    continue
                shape = tuple(handle.get_slice(name).get_shape())  # header shape, checked before reading data
                want = tuple(params[name].shape)
                if shape != want:
                    raise ModelLoadError(f"{f}: tensor {name} has shape {list(shape)}, config.json implies "
                                         f"{list(want)} (hint: does config.json belong to this checkpoint?)")
                with torch.no_grad():
                    params[name].copy_(handle.get_tensor(name).to(torch.float32))
                seen.add(name)
    missing = sorted(expected - seen)
    if missing and not allow_missing:
        more = f" (+{len(missing) - 3} more)" if len(missing) > 3 else ""
        raise ModelLoadError(f"{model_dir}: checkpoint lacks {', '.join(missing[:3])}{more} "
                             "(hint: is this a Qwen3-MoE checkpoint with HF tensor names?)")
    if extra:
        unknown = [n for n in extra if not n.startswith("model.layers.") or "mtp" not in n]
        if unknown:
            more = f" (+{len(unknown) - 3} more)" if len(unknown) > 3 else ""
            raise ModelLoadError(f"{model_dir}: unexpected tensor(s) {', '.join(unknown[:3])}{more} not in a "
                                 f"Qwen3-MoE with this config.json")
    return model


def save_model(model: Qwen3MoeForCausalLM, path: Path, dtype: torch.dtype = torch.bfloat16) -> None:
    """Atomic safetensors write (temp + rename) in the checkpoint dtype."""
    import os
    import tempfile

    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in model.named_parameters()
               if n in set(model.hf_state_names())}
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=".safetensors")
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata={"format": "pt"})
        os.chmod(tmp, 0o644)  # mkstemp creates 0600; a checkpoint is meant to be shared
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def bundled_model_dir(name: str) -> Path:
    from ..resources import models_dir

    return models_dir() / name


def resolve_model_dir(model: str) -> Path:
    """A bundled model name (tiny-moe) or a path to a HF model directory."""
    p = Path(model)
    if p.is_dir():
        return p
    b = bundled_model_dir(model)
    if b.is_dir():
        return b
    raise ModelLoadError(f"model {model!r}: neither a directory nor a bundled model (hint: --model tiny-moe or a "
                         "path to a HF Qwen3-MoE directory with config.json + *.safetensors)")
