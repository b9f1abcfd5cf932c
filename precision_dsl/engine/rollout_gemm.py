"""The rollout engine's own GEMM path over the RECEIVED quantized weights (independent of the trainer's numerics).

The trainer (qlinear.py) dequantizes both operands to fp32 (element x block scale x global scale, folded) and runs an
fp32 GEMM with an fp32 output; the rest of its model runs in fp32. This engine computes the way an inference server
does (SGLang + cuBLAS / CUTLASS / FlashInfer):

* operands are decoded from the received BYTES into their *block-scaled elements* only: E4M3 x 2^(E-127) (MXFP8) and
  E2M1 x E4M3 (NVFP4) have at most 6 significant bits, so they are exact in bf16; the NVFP4 second-level scales
  (S_dec of each token row, S_dec of the weight) stay out of the operands and are applied in the epilogue (the
  `alpha` of a block-scaled tensor-core GEMM);
* the GEMM takes bf16 operands, accumulates in fp32 (bf16 x bf16 products are exact in fp32, so on CPU an fp32 GEMM
  over bf16-valued operands IS a bf16-input / fp32-accumulate GEMM; on CUDA cuBLAS with an fp32 output), applies
  the epilogue scales in fp32 and rounds the output to bf16;
* FP8 (per-tensor, or 1x128 activations x 128x128 weights as DeepSeek-V3 / TE Float8BlockScaling): on CUDA native
  FP8 tensor cores through torch._scaled_mm (cuBLASLt; 1x128 x 128x128 block scaling is SM90-only); on CPU the
  same math spelled out: per-128-wide K-block partial products over the raw fp8 elements, each multiplied by its
  activation-block x weight-tile scale, accumulated block by block in fp32;
* activations are quantized with this engine's own quantizers (rollout_quant.py, golden-tested; on a GPU the fused
  Triton kernels, byte-identical to them by test, because ~25-40 eager ops per activation made every decode step
  launch-bound), and everything between GEMMs (residual stream, attention, router, softmax) runs in bf16
  (RolloutEngine casts the model); RMSNorm takes bf16 in and out and normalises in fp32 (F.rms_norm, as SGLang's
  RMSNorm kernel does).

Byte identity of the received weights stays the contract (checked by the loop); trainer-rollout log-prob agreement
is therefore a measured property, as between Megatron/TE and SGLang.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import fp8_block_pow2
from ..precision import FormatKind, TensorFormat, is_per_token
from . import grouped_experts
from . import rollout_quant as rq
from .fastgemm import F8_ELEMENT as _ELEMENT
from .fastgemm import write_into
from .numerics import EngineFormatError


@dataclass
class Operand:
    """One GEMM operand as the rollout's kernels consume it."""

    kind: str  # "bf16" (bf16 values, maybe block-scaled) | "fp8" (raw fp8 elements + fp32 scale_inv)
    values: torch.Tensor  # [R, K] bf16, or float8 data
    gscale: Optional[torch.Tensor] = None  # fp32 epilogue scale: [R] per row, [1] per tensor, None
    scale_inv: Optional[torch.Tensor] = None  # fp8: [1] per tensor, [R, K/128] (1x128) or [R/128, K/128] (tiles)
    block: tuple[int, int] = (1, 1)  # fp8 scale granularity along (rows, K)
    # fp8 1x128 activations on a GPU: (data, scale_inv) of the same rows in buffers padded to a multiple of 16 rows
    # (zero bytes, scale 1: what NativeFp8Gemm would otherwise append with a copy per GEMM)
    padded: Optional[tuple] = None


def _pow2(e: torch.Tensor) -> torch.Tensor:
    return rq.pow2_from_e8m0(e.to(torch.int32), negate=False)


# ---------------------------------------------------------------------------------------------------------------
# weights: received bytes -> operand (once per weight update)
# ---------------------------------------------------------------------------------------------------------------
def weight_operand(q, device) -> Operand:
    """A received formats.QuantizedTensor (or BF16 tensor) -> Operand. Reads only the stored bytes + fmt."""
    if isinstance(q, torch.Tensor):
        return Operand("bf16", q.to(device=device, dtype=torch.bfloat16))
    fmt: TensorFormat = q.fmt
    data = q.data.to(device)
    n, k = q.shape[0], q.shape[-1]
    fused = _fused_weight_operand(q, data, device)
    if fused is not None:
        return fused
    decode = _WEIGHT_DECODERS.get(fmt.kind)
    if decode is None:
        raise EngineFormatError(f"{fmt.short()} weights: unsupported by the independent rollout GEMM")
    return decode(q, fmt, data, device, n, k)


def _mxfp8_weight(q, fmt: TensorFormat, data: torch.Tensor, device, n: int, k: int) -> Operand:
    if tuple(fmt.block or (1, 32)) != (1, 32) or q.axis != "row":
        raise EngineFormatError(f"MXFP8 weight {fmt.block} {q.axis}: unsupported by the independent rollout GEMM")
    vals = data.view(rq.F8[fmt.element]).float().view(n, k // 32, 32) * _pow2(q.scale.to(device))[..., None]
    return Operand("bf16", vals.view(n, k).to(torch.bfloat16))


def _nvfp4_weight(q, fmt: TensorFormat, data: torch.Tensor, device, n: int, k: int) -> Operand:
    sf = q.scale.to(device).view(torch.float8_e4m3fn).float()
    if sf.shape[0] != n:  # 16x16 tiles: one byte per tile
        sf = sf.repeat_interleave(16, 0)[:n]
    vals = rq.e2m1_values(data).view(n, k // 16, 16) * sf[..., None]
    return Operand("bf16", vals.view(n, k).to(torch.bfloat16), gscale=q.global_scale.to(device).float())


def _fp8_block_weight(q, fmt: TensorFormat, data: torch.Tensor, device, n: int, k: int) -> Operand:
    return Operand("fp8", data.view(rq.F8[fmt.element]), scale_inv=q.scale.to(device).float(),
                   block=tuple(fmt.block or (128, 128)))


def _fp8_tensor_weight(q, fmt: TensorFormat, data: torch.Tensor, device, n: int, k: int) -> Operand:
    return Operand("fp8", data.view(rq.F8[fmt.element]), scale_inv=q.scale.to(device).float(), block=(n, k))


# Received weight bytes -> operand, by kind (the rollout's weight loaders).
_WEIGHT_DECODERS = {
    FormatKind.MXFP8: _mxfp8_weight,
    FormatKind.NVFP4: _nvfp4_weight,
    FormatKind.FP8_BLOCK: _fp8_block_weight,
    FormatKind.FP8: _fp8_tensor_weight,
}
# The rowwise 1-D block layouts the one-pass GPU decode kernels take, by kind (a format without a block reads as it).
_FUSED_DECODE_BLOCKS = {FormatKind.MXFP8: (1, 32), FormatKind.NVFP4: (1, 16)}


def _fused_weight_operand(q, data: torch.Tensor, device) -> Optional[Operand]:
    """The same weight operand from fastgemm.decode_op, i.e. the trainer's one-pass decode kernels on a GPU (bitwise
    the eager decode below: both are the exact element x block scale rounded once to bf16, tests/test_rollout_gpu.py):
    one launch per weight instead of ~5 eager passes, ~100 weights per update. None: not a CUDA tensor / not a layout
    the kernels take (16x16 NVFP4 tiles, columnwise copies)."""
    from .. import kernels
    from .fastgemm import decode_op

    fmt = q.fmt
    block = _FUSED_DECODE_BLOCKS.get(fmt.kind)
    rowwise_1d = block is not None and tuple(fmt.block or block) == block
    if not rowwise_1d or q.axis != "row" or not data.is_cuda or not kernels.available():
        return None
    on_device = dataclasses.replace(q, data=data, scale=q.scale.to(device), global_scale=None
                                    if q.global_scale is None else q.global_scale.to(device))
    op = decode_op(on_device)
    return Operand("bf16", op.v, gscale=op.s)


# ---------------------------------------------------------------------------------------------------------------
# activations: this engine's own quantizers (rollout_quant)
# ---------------------------------------------------------------------------------------------------------------
def _fused_operand(x16: torch.Tensor, fmt: TensorFormat) -> Optional[Operand]:
    """The same operand from the fused Triton kernels (CUDA): one or two launches per activation instead of the ~25-40
    eager ops of rollout_quant, which make a decode step launch-bound. Same bytes: both implementations are checked
    byte for byte against the golden vectors (tests/test_rollout_numerics.py, tests/test_kernels.py) and against
    each other here (tests/test_rollout_gpu.py). None: a format/shape the kernels do not take (rollout_quant runs)."""
    fused = _FUSED_ACTIVATIONS.get(fmt.kind)
    return None if fused is None else fused(x16, fmt, tuple(fmt.block or ()))


def _mxfp8_fused(x16: torch.Tensor, fmt: TensorFormat, block: tuple) -> Optional[Operand]:
    from .. import kernels

    if block not in ((), (1, 32)) or x16.shape[1] % 32:
        return None
    from ..kernels.triton_decode import mxfp8_decode_bf16

    q = kernels.quantize(x16, fmt)
    return Operand("bf16", mxfp8_decode_bf16(q.data, q.scale, fmt.element, "row"))


def _nvfp4_fused(x16: torch.Tensor, fmt: TensorFormat, block: tuple) -> Optional[Operand]:
    from .. import kernels

    if block not in ((), (1, 16)) or x16.shape[1] % 16:
        return None
    from ..kernels.triton_decode import nvfp4_decode_bf16

    q = kernels.quantize(x16, fmt)
    return Operand("bf16", nvfp4_decode_bf16(q.data, q.scale), gscale=q.global_scale.float())


def _fp8_block_fused(x16: torch.Tensor, fmt: TensorFormat, block: tuple) -> Optional[Operand]:
    if block not in ((), (1, 128)):
        return None
    from .fastgemm import fp8_rows16

    q, data16, scale16 = fp8_rows16(x16, fmt)
    return Operand("fp8", q.data.view(rq.F8[fmt.element]), scale_inv=q.scale.float(), block=(1, 128),
                   padded=(data16, scale16))


# Activation -> operand on the fused kernels, by kind (None from a handler: a block / shape it does not take).
_FUSED_ACTIVATIONS = {FormatKind.MXFP8: _mxfp8_fused, FormatKind.NVFP4: _nvfp4_fused,
                      FormatKind.FP8_BLOCK: _fp8_block_fused}


def _mxfp8_act(x16: torch.Tensor, fmt: TensorFormat) -> Optional[Operand]:
    if tuple(fmt.block or (1, 32)) != (1, 32):
        return None
    m, k = x16.shape
    data, e = rq.mxfp8(x16, fmt.element)
    vals = data.view(rq.F8[fmt.element]).float().view(m, k // 32, 32) * _pow2(e)[..., None]
    return Operand("bf16", vals.view(m, k).to(torch.bfloat16))


def _nvfp4_act(x16: torch.Tensor, fmt: TensorFormat) -> Optional[Operand]:
    if tuple(fmt.block or (1, 16)) != (1, 16):
        return None
    m, k = x16.shape
    data, sf, _, s_dec = rq.nvfp4(x16, per_token=is_per_token(fmt))
    vals = rq.e2m1_values(data).view(m, k // 16, 16) * sf.view(torch.float8_e4m3fn).float()[..., None]
    return Operand("bf16", vals.view(m, k).to(torch.bfloat16), gscale=s_dec)


def _fp8_block_act(x16: torch.Tensor, fmt: TensorFormat) -> Optional[Operand]:
    if tuple(fmt.block or (1, 128))[0] != 1:
        return None
    bc = tuple(fmt.block or (1, 128))[1]
    data, s_inv = rq.fp8_block(x16, fmt.element, (1, bc), fp8_block_pow2(fmt))
    return Operand("fp8", data.view(rq.F8[fmt.element]), scale_inv=s_inv, block=(1, bc))


def _fp8_tensor_act(x16: torch.Tensor, fmt: TensorFormat) -> Optional[Operand]:
    m, k = x16.shape
    data, s_inv = rq.fp8_block(x16, fmt.element, (m, k), False)  # one block = the tensor (current scaling)
    return Operand("fp8", data.view(rq.F8[fmt.element]), scale_inv=s_inv.reshape(1), block=(m, k))


# Activation formats whose quantization treats each row of [M, K] on its own (blocks along K only, no scale shared
# across rows), by kind: quantizing many experts' rows at once gives each row the bytes it gets alone.
_ROW_LOCAL = {FormatKind.MXFP8: lambda fmt: tuple(fmt.block or (1, 32))[0] == 1,
              FormatKind.NVFP4: lambda fmt: is_per_token(fmt) and tuple(fmt.block or (1, 16))[0] == 1,
              FormatKind.FP8_BLOCK: lambda fmt: tuple(fmt.block or (1, 128))[0] == 1}


def row_local(fmt: TensorFormat) -> bool:
    """Whether `activation_operand` quantizes each row of its input independently of the other rows (unquantized
    formats trivially do): then the operand of a row subset is the same rows of the whole input's operand."""
    if not fmt.is_quantized:
        return True
    rule = _ROW_LOCAL.get(fmt.kind)
    return rule is not None and rule(fmt)


def operand_rows(op: Operand, rows) -> Operand:
    """The rows `rows` (a slice or an index tensor) of a row-local activation operand: its values, per-row
    epilogue scales and 1xN fp8 scales (a one-row operand's per-tensor scale is its row's: taken as a row too)."""
    m = op.values.shape[0]
    per_row = (lambda t: t[rows] if t is not None and t.dim() >= 1 and t.shape[0] == m else t)
    return Operand(op.kind, op.values[rows], per_row(op.gscale), per_row(op.scale_inv), op.block)


# The grouped expert runner's activation layout: 1x128 FP8 blocks (DeepSeek-V3 / TE Float8BlockScaling).
_FP8_ROW = (FormatKind.FP8_BLOCK, (1, 128))
# Activation -> operand with this engine's own quantizers (rollout_quant), by kind (None: a layout it does not take).
_ROLLOUT_ACTIVATIONS = {FormatKind.MXFP8: _mxfp8_act, FormatKind.NVFP4: _nvfp4_act,
                        FormatKind.FP8_BLOCK: _fp8_block_act, FormatKind.FP8: _fp8_tensor_act}


def activation_operand(x2: torch.Tensor, fmt: TensorFormat, what: str = "", fused: Optional[bool] = None) -> Operand:
    """Quantize a [M, K] activation as the plan says: with rollout_quant, or (fused=None: on a GPU the kernels can
    run on) the fused Triton kernels, same bytes. Unquantized -> bf16."""
    x16 = x2.to(torch.bfloat16)
    if not fmt.is_quantized:
        return Operand("bf16", x16)
    if fused is None:
        from .. import kernels

        fused = x16.is_cuda and kernels.available()
    if fused:
        try:
            op = _fused_operand(x16, fmt)
        except ValueError as e:  # FormatInputError: shape not divisible into blocks
            raise EngineFormatError(f"{what or 'activation'}: {e}") from None
        if op is not None:
            return op
    quantize = _ROLLOUT_ACTIVATIONS.get(fmt.kind)
    try:
        op = None if quantize is None else quantize(x16, fmt)
    except ValueError as e:
        raise EngineFormatError(f"{what or 'activation'}: {e}") from None
    if op is not None:
        return op
    raise EngineFormatError(f"{what or 'activation'}: {fmt.short()} activations are unsupported by the independent "
                            "rollout (hint: --rollout-numerics mirror)")


# ---------------------------------------------------------------------------------------------------------------
# GEMMs: fp32 result (epilogue applied); the caller rounds to bf16
# ---------------------------------------------------------------------------------------------------------------
def _mm_bf16(a: torch.Tensor, b: torch.Tensor, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """a [M, K] x b [N, K]^T with bf16 operands, fp32 accumulation and fp32 result (into `out` if given)."""
    if a.is_cuda:
        try:
            return torch.mm(a, b.t(), out_dtype=torch.float32, out=out)
        except (TypeError, RuntimeError):
            return write_into(out, torch.mm(a, b.t()).float())  # older torch: bf16 output (rounded once more)
    return torch.mm(a.float(), b.float().t(), out=out)  # exact bf16 products, fp32 accumulation


def _as_bf16(op: Operand) -> Operand:
    """An fp8 operand met by a bf16 one (mixed policies): dequantize its fp8 blocks in fp32, round to bf16."""
    if op.kind == "bf16":
        return op
    r, k = op.values.shape
    br, bc = op.block
    s = op.scale_inv
    if s.numel() > 1:
        s = s.repeat_interleave(br, 0)[:r].repeat_interleave(bc, 1)[:, :k]
    return Operand("bf16", (op.values.float() * s).to(torch.bfloat16))


def _fp8_blocked_cpu(a: Operand, b: Operand) -> torch.Tensor:
    """Per-K-block partial products of raw fp8 elements, scaled per (activation block, weight tile), accumulated in
    fp32 block by block (the DeepSeek-V3 / cuBLASLt block-scaled GEMM, spelled out)."""
    m, k = a.values.shape
    n = b.values.shape[0]
    bk = b.block[1] if b.scale_inv.numel() > 1 else (a.block[1] if a.scale_inv.numel() > 1 else k)
    av, bv = a.values.float(), b.values.float()
    sa = a.scale_inv if a.scale_inv.numel() > 1 else a.scale_inv.reshape(1, 1).expand(m, -(-k // bk))
    if b.scale_inv.numel() > 1:
        sb = b.scale_inv.repeat_interleave(b.block[0], 0)[:n]  # [N, K/bk]
    else:
        sb = b.scale_inv.reshape(1, 1).expand(n, -(-k // bk))
    out = torch.zeros(m, n, dtype=torch.float32, device=av.device)
    for j, k0 in enumerate(range(0, k, bk)):
        part = av[:, k0:k0 + bk] @ bv[:, k0:k0 + bk].t()
        out += part * sa[:, j:j + 1] * sb[:, j][None, :]
    return out




def _fp8_native(a: Operand, b: Operand, fp8, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
    """torch._scaled_mm (cuBLASLt FP8 tensor cores): per-tensor scales directly; 1x128 x 128x128 blocks (SM90 only)
    through the executor's `fastgemm.NativeFp8Gemm` - the trainer's implementation, with its first-use check of the
    scale layout against the spelled-out math and its zero-row padding of token counts cuBLASLt refuses. None:
    cuBLASLt cannot run this call (the caller spells the math out). `out`: written in place when the GEMM runs on
    the operand's own rows (no padded buffers), else the result is copied there."""
    if a.scale_inv.numel() == 1 and b.scale_inv.numel() == 1:
        return torch._scaled_mm(a.values, b.values.t(), scale_a=a.scale_inv.reshape(()),
                                scale_b=b.scale_inv.reshape(()), out_dtype=torch.float32, out=out)
    if fp8 is None or a.block != (1, 128) or b.block not in ((128, 128), (1, 128)):
        return None
    a_data, a_scale = a.padded or (a.values.view(torch.uint8), a.scale_inv)
    direct = out is not None and a.padded is None
    y = fp8(a_data, a_scale, a.block, b.values.view(torch.uint8), b.scale_inv, b.block, _ELEMENT[a.values.dtype],
            _ELEMENT[b.values.dtype], out=out if direct else None)
    if y is None or direct:
        return y
    return write_into(out, y[:a.values.shape[0]])


def gemm(a: Operand, b: Operand, paths: Optional[dict] = None, fp8=None, out: Optional[torch.Tensor] = None
         ) -> torch.Tensor:
    """fp32 [M, N] = a @ b^T with the epilogue (second-level scales) applied, into `out` if given (a slice of a
    grouped buffer). `fp8`: a fastgemm.NativeFp8Gemm for block-scaled FP8 on CUDA (None: per-tensor FP8 only,
    blocks spelled out)."""
    if a.kind == "fp8" and b.kind == "fp8":
        y, path = None, "fp8-blocked-emulated"
        if a.values.is_cuda:
            try:
                y = _fp8_native(a, b, fp8, out)
            except RuntimeError:  # shapes/arch cuBLASLt refuses: same math, spelled out
                y = None
            if y is not None:
                path = "fp8-scaled_mm"
        if y is None:
            y = write_into(out, _fp8_blocked_cpu(a, b))
    else:
        a16, b16 = _as_bf16(a), _as_bf16(b)
        y, path = _mm_bf16(a16.values, b16.values, out), "bf16-blockscaled"
        if a16.gscale is not None:  # y is this call's own result: the epilogue scales it in place
            y.mul_(a16.gscale[:, None] if a16.gscale.numel() > 1 else a16.gscale)
        if b16.gscale is not None:
            y.mul_(b16.gscale[None, :] if b16.gscale.numel() > 1 else b16.gscale)
    if paths is not None:
        paths[path] = paths.get(path, 0) + 1
    return y


class IndependentRolloutExecutor:
    """The rollout model's linear executor: received-weight operands (prepared once per update), activations
    quantized by rollout_quant, GEMM by `gemm`, output rounded to bf16. Expert-TP (`parts`) splits a row-parallel
    expert down_proj along K: each rank quantizes its slice with its own per-token scales, computes a partial
    GEMM, and the partials are summed in fp32 (the all-reduce)."""

    def __init__(self, plan, linear_names, etp: int = 1):
        by = plan.by_name()
        self.act = {n: by[n].precision.activation for n in linear_names}
        self.parts = {n: etp if by[n].role == "routed_experts.down" else 1 for n in linear_names}
        self.weights: dict[str, Operand] = {}
        self.paths: dict[str, int] = {}
        from .fastgemm import LastInput, NativeFp8Gemm

        self.fp8 = NativeFp8Gemm()  # this engine's native FP8 GEMMs (own layout state, the trainer's code)
        # the last GEMM input's {format: operand}: q/k/v and an expert's gate/up read one tensor, whose activation is
        # quantized once for all of them (as an inference server's fused qkv / gate_up GEMMs)
        self._inputs = LastInput(dict)
        self.grouped_mode = grouped_experts.mode_from_env()  # routed experts as one grouped op (grouped_experts.py)
        self._grouped: dict = {}  # first expert's gate name -> its layer's runner (or None), per weight update

    def grouped_experts(self, trios: list, x: torch.Tensor) -> Optional["RolloutExperts"]:
        """One MoE layer's routed experts as one grouped op when all run 1x128 x 128x128 FP8 or all run BF16 GEMMs
        (unquantized activations x bf16 weight operands: BF16 weights, or MXFP8 ones decoded to bf16 without an
        epilogue scale), one activation format per role (grouped_experts.py); on the CPU (or with mode "on") also
        when every activation format quantizes each row on its own ("rows": one quantization of all experts' rows
        per operand instead of one per expert, each expert's GEMM over exactly its rows, so the loop's results bit
        for bit); None: the loop (expert-TP, others)."""
        if self.grouped_mode == "off":
            return None
        fused = grouped_experts.wanted(self.grouped_mode, x)
        key = (trios[0][0], fused)
        if key not in self._grouped:
            runner = self._grouped_runner(trios) if fused else None
            if runner is None and (not x.is_cuda or self.grouped_mode == "on"):
                runner = self._rows_runner(trios)
            self._grouped[key] = runner
        return self._grouped[key]

    def _rows_runner(self, trios: list) -> Optional["RolloutExperts"]:
        acts = [{self.act[t[i]] for t in trios} for i in (0, 1, 2)]
        if any(len(a) != 1 for a in acts) or acts[0] != acts[1] or any(self.parts[n] != 1 for t in trios for n in t):
            return None
        a_up, a_down = next(iter(acts[0])), next(iter(acts[2]))
        if not (row_local(a_up) and row_local(a_down)):
            return None
        ops = [tuple(self.weights[n] for n in t) for t in trios]
        return RolloutExperts(self, "rows", ops, (a_up, a_down))

    def _grouped_runner(self, trios: list) -> Optional["RolloutExperts"]:
        acts = [{self.act[t[i]] for t in trios} for i in (0, 1, 2)]
        if any(len(a) != 1 for a in acts) or acts[0] != acts[1] or any(self.parts[n] != 1 for t in trios for n in t):
            return None
        ops = [tuple(self.weights[n] for n in t) for t in trios]
        a_up, a_down = next(iter(acts[0])), next(iter(acts[2]))
        if all(op.kind == "fp8" and op.block == (128, 128) for t in ops for op in t) and all(
                (a.kind, tuple(a.block or (1, 128))) == _FP8_ROW for a in (a_up, a_down)):
            return RolloutExperts(self, "fp8", ops, (a_up, a_down))
        if all(op.kind == "bf16" and op.gscale is None for t in ops for op in t) \
                and not a_up.is_quantized and not a_down.is_quantized:
            return RolloutExperts(self, "bf16", ops, (a_up, a_down))
        return None

    def _activation(self, x: torch.Tensor, x2: torch.Tensor, fmt: TensorFormat, what: str) -> Operand:
        ops = self._inputs.get(x)
        op = ops.get(fmt)
        if op is None:
            op = ops[fmt] = activation_operand(x2, fmt, what)
        return op

    def load(self, name: str, received, device) -> None:
        self.weights[name] = weight_operand(received, device)
        self._inputs.clear()
        self._grouped.clear()

    def __call__(self, hf_name: str, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # noqa: ARG002
        wop = self.weights[hf_name]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        parts = self.parts[hf_name]
        if parts == 1:
            y = gemm(self._activation(x, x2, self.act[hf_name], hf_name), wop, self.paths, self.fp8)
        else:
            k = x2.shape[1]
            if k % parts:
                raise EngineFormatError(f"{hf_name}: K={k} does not split into {parts} expert-TP partitions")
            step = k // parts
            y = None
            for i in range(parts):
                sl = slice(i * step, (i + 1) * step)
                part_w = Operand(wop.kind, wop.values[:, sl], wop.gscale)
                if wop.kind != "bf16":
                    raise EngineFormatError(f"{hf_name}: expert-TP emulation needs a bf16/MXFP8/NVFP4 weight")
                yi = gemm(activation_operand(x2[:, sl], self.act[hf_name], hf_name), part_w, self.paths, self.fp8)
                y = yi if y is None else y + yi
        return y.to(torch.bfloat16).reshape(*shape[:-1], y.shape[-1])


class RolloutExperts:
    """One MoE layer's routed experts in the independent rollout as one grouped op (grouped_experts.py: dispatch and
    combine): the loop's operands and `gemm` (activation quantized by the fused kernels, received weight operand,
    fp32 output rounded to bf16; silu and the product in bf16), with ONE activation quantization per operand for
    all experts and each expert's GEMM written into its segment of the grouped output. `ops`: per expert the (gate,
    up, down) weight Operands; `acts`: the (gate/up, down) activation formats. No autograd."""

    def __init__(self, ex: IndependentRolloutExecutor, kind: str, ops: list, acts: tuple):
        self.ex, self.kind, self.ops, self.acts = ex, kind, ops, acts
        self.align = 16 if kind == "fp8" else 1  # cuBLASLt's FP8 row count; bf16 and rows need none

    def _quantized(self, x16: torch.Tensor, fmt: TensorFormat):
        """The grouped buffer's 1x128 rows (data, scale) from one launch (fp8), its whole operand (rows: the
        activation quantized once for every expert's rows), or None (bf16)."""
        if self.kind == "rows":
            return activation_operand(x16, fmt, "routed experts")
        if self.kind != "fp8":
            return None
        from .fastgemm import fp8_rows16

        _, data, scale = fp8_rows16(x16, fmt)
        return data, scale

    def _segment(self, q, x16: torch.Tensor, fmt: TensorFormat, s: int, r: int) -> Operand:
        if q is None:
            return Operand("bf16", x16[s:s + r])
        if isinstance(q, Operand):
            return operand_rows(q, slice(s, s + r))
        data, scale = q
        return Operand("fp8", data[s:s + r].view(rq.F8[fmt.element]), scale_inv=grouped_experts.seg_scale(scale, s, r),
                       block=(1, 128))

    @property
    def takes_tokens(self) -> bool:
        """Whether the MoE block hands this runner its tokens [T, H] and the top-k (rows: the gate/up input is
        quantized once per TOKEN and its operand rows gathered per (token, slot) pair) instead of the gathered
        buffer [P, H] (each token top-k times)."""
        return self.kind == "rows"

    def __call__(self, x_pad: torch.Tensor, d: "grouped_experts.Dispatch", top_k: Optional[int] = None
                 ) -> torch.Tensor:
        ex = self.ex
        x16 = x_pad.to(torch.bfloat16)
        if top_k is not None:  # x_pad: the tokens; their row-local operand, gathered into the dispatch's rows
            qx = operand_rows(self._quantized(x16, self.acts[0]), d.order // top_k)
        else:
            qx = self._quantized(x16, self.acts[0])
        segs = d.segments()
        used = d.used_rows
        g = x16.new_empty(used, self.ops[0][0].values.shape[0], dtype=torch.float32)  # rows < used are written
        u = torch.empty_like(g)
        for e, (s, n, r) in enumerate(segs):
            if n:
                a = self._segment(qx, x16, self.acts[0], s, r)
                gemm(a, self.ops[e][0], ex.paths, ex.fp8, out=g[s:s + r])
                gemm(a, self.ops[e][1], ex.paths, ex.fp8, out=u[s:s + r])
        h16 = F.silu(g.to(torch.bfloat16)) * u.to(torch.bfloat16)
        qh = self._quantized(h16, self.acts[1])
        y = h16.new_empty(used, x16.shape[1], dtype=torch.float32)
        for e, (s, n, r) in enumerate(segs):
            if n:
                gemm(self._segment(qh, h16, self.acts[1], s, r), self.ops[e][2], ex.paths, ex.fp8, out=y[s:s + r])
        return y.to(torch.bfloat16)
