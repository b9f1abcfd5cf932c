"""THE quantize-a-tensor function shared by the checkpoint converter and the live weight-update path.

Both paths call `checkpoint_tensors(...)` (one share-scale group at a time), so for the same source weights they
produce byte-identical tensors by construction. The numerics come from `precision_dsl.formats` (bit-exact to
TransformerEngine); this module only decides names, dtypes and layouts of what a serving engine loads:

  format        tensors written for a quantized Linear `X` (HF module path)            engine / source
  ------------  -----------------------------------------------------------------      -------------------------------
  mxfp8         X.weight float8_e4m3fn [N,K], X.weight_scale_inv uint8 (E8M0) [N,K/32]  SGLang 0.5.23 `Fp8Config`
                                                                                (use_mxfp8), Miles convert_hf_to_mxfp8
  nvfp4         X.weight uint8 [N,K/2] (element 2j low nibble), X.weight_scale            ModelOpt 0.47 export /
                float8_e4m3fn [N,K/16], X.weight_scale_2 fp32 scalar (= S_dec =          SGLang `ModelOptFp4Config`
                G/2688), X.input_scale fp32 scalar 1.0 (unused with per-token activations)
  fp8_block     X.weight float8_e4m3fn [N,K], X.weight_scale_inv fp32 [ceil(N/128),       DeepSeek-V3 README_WEIGHTS /
                ceil(K/128)] (dequant multiplier)                                        SGLang `Fp8Config` block
  high precision  X.weight in the plan's storage dtype (bf16 / fp16 / fp32)

That table is SGLang's naming (the default rollout engine). Another rollout engine's loader may name a tensor
differently: ROLLOUT_SUFFIXES holds those names as data (vLLM's ModelOpt MXFP8 loads the E8M0 scales as
`X.weight_scale`), and `output_specs` / `checkpoint_tensors` / `read_quantized` / `rollout_tensor_names` take the
`rollout` engine; the bytes are the same for every engine.

Share-scale groups (e.g. gate+up of one expert under NVFP4): every member is quantized with the group amax
G = max(amax of all members), so all members get the same `weight_scale_2` (SGLang requires gate == up for w13,
modelopt_quant.py ~l.2740). A caller must therefore hand over all members of a group together.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from precision_dsl.format_specs import NVFP4_SPEC
from precision_dsl.plan import Plan, TensorPlan
from precision_dsl.precision import HP_DTYPE_NAMES, FormatKind, Scope, TensorFormat
from precision_dsl.backends.common import UnsupportedByBackend, module_of
from precision_dsl.errors import PolicycError

if TYPE_CHECKING:
    import torch

# torch (and precision_dsl.formats, which imports it) are imported inside the functions that move data: `policyc
# emit` uses only the metadata helpers (check_supported, output_specs) and must not pay torch's ~2 s import.

SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale", "weight_scale_2", "input_scale")
# The rollout engine a checkpoint is written for unless told otherwise (registry.EmitOptions.rollout's default).
DEFAULT_ROLLOUT = "sglang"


class NonFiniteWeight(PolicycError, ValueError):
    """A weight holds NaN/Inf; nothing is written or sent."""

    code = 1

    def __init__(self, name: str, n_bad: int, after: str = ""):
        if after:  # finite input, non-finite output: the target format cannot represent the values
            self.hint = ("a value exceeds the range of the target format; choose a wider format for this tensor "
                         "(e.g. bf16) or rescale the weights")
            super().__init__(f"tensor '{name}' has {n_bad} value(s) that become NaN/Inf {after}")
        else:
            self.hint = "the trainer diverged or the checkpoint is corrupt; fix the weights before converting/sending"
            super().__init__(f"tensor '{name}' contains {n_bad} NaN/Inf value(s)")


def check_supported(t: TensorPlan, backend: str) -> None:
    """Raise UnsupportedByBackend if a checkpoint (and therefore SGLang/vLLM) cannot store `t` exactly."""
    w = t.precision.weight
    if not (t.is_linear and w.is_quantized):
        if w.is_quantized:
            raise UnsupportedByBackend(backend, t.hf_name, f"quantized non-linear tensor ({w.short()})")
        return
    dialect = DIALECT.get(w.kind)
    if dialect is None:
        raise UnsupportedByBackend(backend, t.hf_name, f"no checkpoint format for {w.short()} weights "
                                                       "(supported: mxfp8, nvfp4, fp8_block 128x128)")
    problem = dialect.problem(w)
    if problem:
        raise UnsupportedByBackend(backend, t.hf_name, problem)
    if len(t.shape) != 2:
        raise UnsupportedByBackend(backend, t.hf_name, f"quantized weight must be 2-D, has shape {t.shape}")


def check_all_supported(plan: Plan, backend: str) -> None:
    """`check_supported` for every plan tensor, evaluated once per distinct (weight format object, linear?, rank): the
    check reads nothing else, and the first failing tensor in plan order is the one reported, as before."""
    for t in plan.memo("check_supported.representatives", lambda: _first_of_each_weight_layout(plan)):
        check_supported(t, backend)


def _first_of_each_weight_layout(plan: Plan) -> list[TensorPlan]:
    """The first tensor (plan order) of each distinct (weight format object, linear?, rank)."""
    first: dict[tuple, TensorPlan] = {}
    for t in plan.tensors:
        key = (id(t.precision.weight), t.is_linear, len(t.shape))  # the plan keeps the formats alive
        if key not in first:
            first[key] = t
    return list(first.values())


def plan_output_specs(plan: Plan, rollout: str = DEFAULT_ROLLOUT) -> list[list[tuple[str, str, tuple[int, ...]]]]:
    """`output_specs` of every plan tensor, in plan order, computed once per plan object and rollout engine (the
    converter and the weight-update manifests both list them). Shared between callers: read, never modify."""
    key = "output_specs" if rollout == DEFAULT_ROLLOUT else f"output_specs.{rollout}"
    return plan.memo(key, lambda: [output_specs(t, rollout) for t in plan.tensors])


def output_specs(t: TensorPlan, rollout: str = DEFAULT_ROLLOUT) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, safetensors dtype, shape) of every tensor written for `t` in the checkpoint `rollout` loads, without
    touching data. Lets the converter write a safetensors header before quantizing (streaming) and lets manifests
    be derived."""
    mod = module_of(t.hf_name)
    w = t.precision.weight
    if not (t.is_linear and w.is_quantized):
        return [(t.hf_name, HP_DTYPE_NAMES[w.kind][1], tuple(t.shape))]
    n, k = t.shape
    rename = _renamer(w.kind, rollout)
    return [(rename(name), dt, shape) for name, dt, shape in DIALECT[w.kind].specs(mod, n, k)]


def rollout_tensor_names(t: TensorPlan, rollout: str = DEFAULT_ROLLOUT) -> list[str]:
    """The checkpoint tensor names of plan tensor `t` as rollout engine `rollout` loads them, in write order (the
    converter writes and a live weight update sends exactly these): `X.weight` plus the format's scale tensors."""
    return [name for name, _dt, _shape in output_specs(t, rollout)]


def _renamer(kind: FormatKind, rollout: str) -> Callable[[str], str]:
    """Full tensor name in DIALECT's naming -> the name `rollout` loads (identity where its naming is DIALECT's)."""
    table = ROLLOUT_SUFFIXES.get(rollout, {}).get(kind)
    if not table:
        return lambda name: name

    def rename(name: str) -> str:
        mod, _, suffix = name.rpartition(".")
        return f"{mod}.{table.get(suffix, suffix)}"

    return rename


def _assert_finite(name: str, x: torch.Tensor, after: str = "") -> None:
    import torch

    # aminmax is one vectorised pass without a temporary and propagates NaN (and +-inf shows up as min/max), so a
    # finite (min, max) proves the tensor finite; only then-suspect tensors pay for the exact count. (~40x faster
    # than isfinite(x).all() on CPU bf16.)
    if x.numel() == 0:
        return
    if x.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        _assert_finite_fp8(name, x, after)
        return
    if not x.is_floating_point():
        return
    lo, hi = torch.aminmax(x)
    if bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)):
        return
    bad = int((~torch.isfinite(x)).sum().item())
    raise NonFiniteWeight(name, bad, after)


def _assert_finite_fp8(name: str, x: torch.Tensor, after: str) -> None:
    """FP8 has no aminmax kernel: test the encodings. E4M3FN's only non-finite codes are S.1111.111 (NaN); E5M2's
    are S.11111.xx (Inf/NaN)."""
    import torch

    b = x.contiguous().view(torch.uint8)
    if x.dtype == torch.float8_e4m3fn:
        bad = int(((b & 0x7F) == 0x7F).sum().item())
    else:
        bad = int(((b & 0x7C) == 0x7C).sum().item())
    if bad:
        raise NonFiniteWeight(name, bad, after)


def _assert_outputs_finite(t: TensorPlan, produced: dict[str, torch.Tensor]) -> None:
    """Every float tensor a cast/quantization produced (data and scales) must be finite: a finite BF16 weight under
    an `fp16` rule can overflow to Inf, a degenerate block can give an Inf scale. Packed NVFP4 (uint8) and UE8M0
    (uint8) carry no NaN encoding that the quantizers emit; their FP8/FP32 scales are checked."""
    for name, y in produced.items():
        _assert_finite(name, y, f"after the cast to {t.precision.weight.short()}")


def checkpoint_tensors(members: Sequence[tuple[TensorPlan, torch.Tensor]], backend: str = "converter",
                       check_finite: bool = True, kernel: str = "auto",
                       rollout: str = DEFAULT_ROLLOUT) -> dict[str, torch.Tensor]:
    """Checkpoint tensors (full names -> tensors, exact dtypes) for one unit of work: a single tensor, or ALL the
    members of one share-scale group, named as rollout engine `rollout` loads them (the bytes are the same for
    every engine). The only place bytes are produced for the converter and the weight update."""
    import torch

    from precision_dsl import kernels
    from precision_dsl.formats import torch_dtype

    if check_finite:
        for t, x in members:
            _assert_finite(t.hf_name, x)
    out: dict[str, torch.Tensor] = {}
    group_amax: Optional[torch.Tensor] = None
    needs_group = [t for t, _ in members if needs_shared_amax(t)]
    if needs_group:
        from precision_dsl.formats.nvfp4 import group_amax as _group_amax

        group_amax = _group_amax([x for t, x in members if t in needs_group])
    for t, x in members:
        w = t.precision.weight
        if tuple(x.shape) != tuple(t.shape):
            raise ValueError(f"tensor '{t.hf_name}' has shape {tuple(x.shape)}, the plan says {t.shape}")
        if not (t.is_linear and w.is_quantized):
            check_supported(t, backend)
            y = x.to(torch_dtype(w)).contiguous()
            if check_finite and y.dtype != x.dtype:  # e.g. a finite BF16 1e5 is Inf in FP16
                _assert_finite(t.hf_name, y, f"after the cast to {w.short()}")
            out[t.hf_name] = y
            continue
        check_supported(t, backend)
        mod = module_of(t.hf_name)
        ga = group_amax if needs_shared_amax(t) else None
        if ga is not None and t.share_scale_group is None:
            raise UnsupportedByBackend(backend, t.hf_name, "NVFP4 'group' weight scale without a share-scale group")
        # Rowwise (blocks along K, the forward copy). kernels.quantize: the fused Triton kernel for CUDA tensors
        # (byte for byte the reference, tests/test_kernels.py), the readable reference otherwise, or as `kernel` says.
        q = kernels.quantize(x, w, axis="row", global_amax=ga, kernel=kernel)
        n, k = t.shape
        rename = _renamer(w.kind, rollout)
        out.update((rename(name), y) for name, y in DIALECT[w.kind].write(q, mod, n, k).items())
        if check_finite:
            _assert_outputs_finite(t, {n: y for n, y in out.items() if n.startswith(mod + ".")})
    return out


def work_units(plan: Plan, names: Sequence[str]) -> list[list[str]]:
    """Split `names` (HF tensor names, in order) into units for `checkpoint_tensors`: share-scale groups whose
    scale is shared (NVFP4 'group') become one unit, placed at the position of their LAST member; everything
    else is a unit of one. Raises if a group member is missing from `names`."""
    by = plan.by_name()
    groups = {m: g for g in plan.share_scale_groups for m in g.members}
    present = set(names)
    pos = {n: i for i, n in enumerate(names)}
    units: list[list[str]] = []
    done: set[str] = set()
    for n in names:
        if n in done:
            continue
        t = by[n]
        g = groups.get(n) if needs_shared_amax(t) else None
        if g is None:
            units.append([n])
            done.add(n)
            continue
        missing = [m for m in g.members if m not in present]
        if missing:
            raise ValueError(f"share-scale group '{g.id}' is incomplete: {', '.join(missing)} missing")
        if n == max(g.members, key=pos.__getitem__):
            units.append(sorted(g.members, key=pos.__getitem__))
            done.update(g.members)
    return units


def needs_shared_amax(t: TensorPlan) -> bool:
    """A share-scale group member whose second-level scale is the group's (NVFP4 `Scope.GROUP`)."""
    return t.is_linear and t.weight.spec.takes_global_amax and t.weight.global_scale == Scope.GROUP


def read_quantized(t: TensorPlan, tensors: dict[str, torch.Tensor], rollout: str = DEFAULT_ROLLOUT):
    """Rebuild a QuantizedTensor for plan tensor `t` from its checkpoint tensors named as `rollout` loads them
    (inverse of checkpoint_tensors), or return the plain tensor for a high-precision one. Used by `verify`, the
    tests and WeightReceiver."""
    w = t.precision.weight
    if not (t.is_linear and w.is_quantized):
        return tensors[t.hf_name]
    mod = module_of(t.hf_name)
    n, k = t.shape
    rename = _renamer(w.kind, rollout)
    canonical = {name: tensors[rename(name)] for name, _dt, _shape in DIALECT[w.kind].specs(mod, n, k)}
    return DIALECT[w.kind].read(w, mod, n, k, canonical)


# ---- the checkpoint dialect: one entry per quantized kind a checkpoint stores --------------------------------------
@dataclass(frozen=True)
class Dialect:
    """How a checkpoint stores one quantized kind's Linear weight `X` (HF module path `mod`, weight [N, K])."""

    suffixes: tuple[str, ...]  # after the module path, in write order (readers, manifests and verify use them)
    problem: Callable[[TensorFormat], str]  # why the checkpoint cannot store this weight format exactly ("" = it can)
    specs: Callable[[str, int, int], list]  # (mod, N, K) -> [(name, safetensors dtype, shape)], write order
    write: Callable  # (QuantizedTensor rowwise, mod, N, K) -> {name: tensor}
    read: Callable  # (fmt, mod, N, K, tensors) -> QuantizedTensor


def _mxfp8_problem(w: TensorFormat) -> str:
    if w.element != "e4m3" or w.block != (1, 32):
        return f"MXFP8 checkpoint weights are e4m3 1x32; plan says {w.short()} ({w.element}, block {w.block})"
    return ""


def _nvfp4_problem(w: TensorFormat) -> str:
    if w.block != (1, 16):
        return f"ModelOpt NVFP4 stores 1x16 weight blocks; plan says block {w.block}"
    if not NVFP4_SPEC.one_weight_scale_per_tensor(w.global_scale):
        return (f"ModelOpt NVFP4 has one weight_scale_2 per tensor; plan asks for a '{w.global_scale}' weight global "
                "scale")
    return ""


def _fp8_block_problem(w: TensorFormat) -> str:
    if w.block != (128, 128) or w.element != "e4m3":
        return f"FP8-block checkpoints are e4m3 128x128; plan says {w.short()} block {w.block}"
    if w.scale_dtype not in (None, "fp32", "pow2"):
        return f"DeepSeek FP8 checkpoints store fp32 weight_scale_inv; plan asks for '{w.scale_dtype}' scales"
    # pow2 scales are stored exactly as fp32 weight_scale_inv values (powers of two are fp32-representable).
    return ""


def _mxfp8_write(q, mod: str, n: int, k: int) -> dict:
    import torch

    return {f"{mod}.weight": q.data.reshape(n, k).view(torch.float8_e4m3fn),
            f"{mod}.weight_scale_inv": q.scale.reshape(n, k // 32).contiguous()}


def _nvfp4_write(q, mod: str, n: int, k: int) -> dict:
    import torch

    return {f"{mod}.weight": q.data.reshape(n, k // 2).contiguous(),
            f"{mod}.weight_scale": q.scale[:n, : k // 16].contiguous().view(torch.float8_e4m3fn),
            f"{mod}.weight_scale_2": q.global_scale.reshape(()).to(torch.float32).clone(),
            # ModelOpt's static activation scale. With per-token activations (the only NVFP4 activation mode the
            # SGLang backend accepts) the kernel computes scales per token and this value is unused; Miles writes
            # 1.0 too (tools/convert_hf_to_nvfp4.py).
            f"{mod}.input_scale": torch.ones((), dtype=torch.float32)}


def _fp8_block_write(q, mod: str, n: int, k: int) -> dict:
    import torch

    nb, kb = -(-n // 128), -(-k // 128)
    return {f"{mod}.weight": q.data.reshape(n, k).view(torch.float8_e4m3fn),
            f"{mod}.weight_scale_inv": q.scale[:nb, :kb].to(torch.float32).contiguous()}


def _fp8_bytes_read(w: TensorFormat, mod: str, n: int, k: int, tensors: dict):
    """MXFP8 and FP8-block: FP8 bytes + the block-scale tensor as stored."""
    import torch

    from precision_dsl.formats.base import QuantizedTensor

    return QuantizedTensor(fmt=w, shape=(n, k), data=tensors[f"{mod}.weight"].view(torch.uint8),
                           scale=tensors[f"{mod}.weight_scale_inv"], axis="row")


def _nvfp4_read(w: TensorFormat, mod: str, n: int, k: int, tensors: dict):
    import torch

    from precision_dsl.formats.base import QuantizedTensor

    s2 = tensors[f"{mod}.weight_scale_2"].reshape(1).to(torch.float32)
    return QuantizedTensor(fmt=w, shape=(n, k), data=tensors[f"{mod}.weight"],
                           scale=tensors[f"{mod}.weight_scale"].view(torch.uint8), global_scale=s2, axis="row")


#   mxfp8: SGLang 0.5.23 `Fp8Config` (use_mxfp8), Miles convert_hf_to_mxfp8; nvfp4: ModelOpt 0.47 export / SGLang
#   `ModelOptFp4Config`; fp8_block: DeepSeek-V3 README_WEIGHTS / SGLang `Fp8Config` block (the module docstring).
DIALECT: dict[FormatKind, Dialect] = {
    FormatKind.MXFP8: Dialect(
        ("weight", "weight_scale_inv"), _mxfp8_problem,
        lambda mod, n, k: [(f"{mod}.weight", "F8_E4M3", (n, k)), (f"{mod}.weight_scale_inv", "U8", (n, k // 32))],
        _mxfp8_write, _fp8_bytes_read),
    FormatKind.NVFP4: Dialect(
        ("weight", "weight_scale", "weight_scale_2", "input_scale"), _nvfp4_problem,
        lambda mod, n, k: [(f"{mod}.weight", "U8", (n, k // 2)), (f"{mod}.weight_scale", "F8_E4M3", (n, k // 16)),
                           (f"{mod}.weight_scale_2", "F32", ()), (f"{mod}.input_scale", "F32", ())],
        _nvfp4_write, _nvfp4_read),
    FormatKind.FP8_BLOCK: Dialect(
        ("weight", "weight_scale_inv"), _fp8_block_problem,
        lambda mod, n, k: [(f"{mod}.weight", "F8_E4M3", (n, k)),
                           (f"{mod}.weight_scale_inv", "F32", (-(-n // 128), -(-k // 128)))],
        _fp8_block_write, _fp8_bytes_read),
}
# Suffixes (after the module path) each format writes, in write order. Used by readers, manifests and verify.
SUFFIXES = {kind: d.suffixes for kind, d in DIALECT.items()}

# Each rollout engine's checkpoint naming where its loader names a tensor differently from DIALECT (SGLang's
# naming): rollout -> kind -> {DIALECT suffix: the engine's suffix}. Bytes, dtypes and shapes are the same.
ROLLOUT_SUFFIXES: dict[str, dict[FormatKind, dict[str, str]]] = {
    "sglang": {},
    # vllm 0.33.0 vllm/model_executor/layers/quantization/modelopt.py: the ModelOpt MXFP8 linear registers
    # `weight_scale` (KMxfp8Static.create_weights) and the MoE `w13_weight_scale` / `w2_weight_scale`
    # (ModelOptMxFp8FusedMoE.create_weights, loaded from experts.E.{gate,up,down}_proj.weight_scale).
    "vllm": {FormatKind.MXFP8: {"weight_scale_inv": "weight_scale"}},
}
