"""The trainer's fast GEMM path (CUDA): the same numbers as the emulation, computed on tensor cores.

The reference emulation (qlinear.QLinearFunction) dequantizes every operand to fp32 and runs an fp32 GEMM. On a GPU
that is an FP32 (SIMT) GEMM, ~10x slower than the BF16 tensor cores. This module computes the SAME contract
(dequantized operand values bit for bit, fp32 accumulation of exact products, fp32 result) with tensor cores:

* `Op` = an operand as `v` (values that are EXACT in bf16, stored bf16) times an optional fp32 scale `s` per row
  ([R]) or per tensor ([1]) that the GEMM applies in its epilogue. `Op.dense()` rebuilds the reference's fp32
  dequantized operand bit for bit (tests/test_engine_fastgemm.py checks that against formats.dequantize).
  Which dequantized values are exact in bf16 (8 significant bits, fp32's exponent range):
    - BF16 operands (activations, gradients, weights of high-precision GEMMs): trivially.
    - MXFP8: E4M3/E5M2 element (<= 4 significant bits) x 2^(E-127): exact, except in blocks whose E8M0 scale is
      below 2^-124 (block amax < ~2^-116 ~ 1e-35), where E4M3 subnormals land below bf16's smallest subnormal
      (2^-133); such blocks are rounded by bf16 (an absolute error < 2^-133). `decode_op` keeps the rule.
    - NVFP4: E2M1 (<= 2 bits) x E4M3 block scale (<= 4 bits) is exact; the second-level fp32 S_dec (per token
      or per tensor) is NOT (24 bits), so it stays in `s` and is applied to the fp32 GEMM output: the reference
      computes (e2m1 * sf) * S_dec per element, one rounding, and `dense()` reproduces exactly that.
    - FP8 block with fp32 scale_inv (fp8-blockwise-hopper) and FP8 per-tensor: element x arbitrary fp32 scale is
      NOT exact in bf16 -> kept as fp32 (`v` fp32, `exact=False`); pow2 block scales are exact like MXFP8.
* `mm(a, b)` = a @ b^T in fp32. bf16 x bf16: one tensor-core GEMM with an fp32 output (`torch.mm(...,
  out_dtype=torch.float32)`: bf16 products are exact in fp32, accumulation fp32). An fp32 (inexact) operand is
  split into three bf16 terms hi + mid + lo == v EXACTLY (8 + 8 + 8 significant bits cover fp32's 24), so three
  exact-product GEMMs summed in fp32 equal the fp32 GEMM up to accumulation order ("bf16x3"). A per-row scale
  along the CONTRACTION dim (a transposed per-token operand) cannot go to the epilogue: `Op.t()` materialises it.
  On CPU the same operands run as fp32 GEMMs (a bf16-valued fp32 GEMM IS a bf16-input / fp32-accumulate GEMM).
* `NativeFp8Gemm`: NATIVE FP8 GEMMs on Hopper (torch._scaled_mm, cuBLASLt block scaling, sm_90 only) for
  fp8_block operands: 1x128 activations/gradients x 128x128 weights (forward, dgrad) and 1x128 x 1x128 (wgrad),
  operands = our own quantizers' bytes, scales in the layouts cuBLASLt wants (benchmarks/fp8_gemm_probe.py: 1x128
  scales outer-dim-major [rows, K/128]; 128x128 grids [N/128, L] padded to L4 = roundup(L, 4) and given as the
  [L4, N/128] transpose; torch's test_scaled_mm_vs_emulated_block_wise uses the same layouts). The first call of
  each recipe is checked against the fp32 GEMM of the dequantized operands (rel. error < 1e-2, i.e. the fp32
  block accumulation, not a layout mix-up) before it is trusted; a refused or failing shape falls back to the
  emulation and is counted as such.

Results are not bitwise equal to the CPU reference (accumulation order differs, as between any two GEMM libraries);
operands are. Every call is counted in a `GemmStats` so runs report which GEMMs ran natively.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F

from ..formats import fp8_block_pow2
from ..precision import FormatKind

NATIVE_FP8 = "native-fp8"  # torch._scaled_mm blockwise FP8 tensor cores
BF16_TC = "bf16-tc"  # bf16 tensor cores over bf16-exact dequantized operands, fp32 accumulate/output
BF16X3 = "bf16x3"  # an fp32 operand split exactly into 3 bf16 terms (fp32-GEMM equivalent)
FP32 = "fp32"  # fp32 GEMM (CPU, or both operands inexact)
FP8_FALLBACK = "fp8-fallback-emulated"  # native FP8 asked for, refused for this shape: emulated instead
PATH_NOTES = {
    NATIVE_FP8: "native FP8 tensor-core GEMM (torch._scaled_mm, 1x128/128x128 block scales, our quantizers' bytes)",
    BF16_TC: "BF16 tensor-core GEMM over the dequantized operands (exact in bf16), fp32 accumulate + output",
    BF16X3: "fp32 operand split exactly into 3 bf16 terms (== fp32 GEMM up to accumulation order)",
    FP32: "FP32 GEMM over the dequantized operands (emulation reference)",
    FP8_FALLBACK: "FP8 GEMM emulated (shape/recipe refused by cuBLASLt) - fp32 over the dequantized operands",
}


@dataclass
class GemmStats:
    """How many GEMM calls ran on each path (forward + backward), for the run report."""

    counts: dict = field(default_factory=dict)
    flops: int = 0  # GEMM FLOPs issued by the model's linears (2*M*K*N per GEMM, forward + backward)

    def add(self, path: str, n: int = 1) -> None:
        self.counts[path] = self.counts.get(path, 0) + n


@dataclass
class Op:
    """One GEMM operand: value = v * s (s per row [R] or per tensor [1]; None = 1). `exact`: v is bf16-exact."""

    v: torch.Tensor
    s: Optional[torch.Tensor] = None
    exact: bool = True

    def dense(self) -> torch.Tensor:
        """The fp32 operand the reference computes (bitwise: one rounding of v * s, as formats' dequantize)."""
        v = self.v.float()
        if self.s is None:
            return v
        return v * (self.s.view(-1, 1) if self.s.numel() > 1 else self.s.reshape(()))

    def t(self) -> "Op":
        """The transposed operand. A per-row scale would run along the contraction dim after the transpose: it is
        folded into an fp32 operand instead (exact = False -> bf16x3 on CUDA)."""
        if self.s is None or self.s.numel() == 1:
            return Op(self.v.t(), self.s, self.exact)
        return Op(self.dense().t(), None, False)


class LastInput:
    """The last GEMM input an executor saw and what it derived from it (`make(*args)`): consecutive linears reading one
    tensor (q/k/v, an expert's gate/up) find it here, as a fused qkv / gate_up GEMM reads its input once. The tensor
    is held weakly and matched by identity and version counter (an in-place change makes it a new input); inference
    tensors carry no version counter and are never matched. `release(value)` runs when a value is replaced."""

    def __init__(self, make, release=None):
        self._make, self._release = make, release
        self._last: Optional[tuple] = None

    @property
    def current(self):
        return None if self._last is None else self._last[2]

    def get(self, x: torch.Tensor, *args):
        last = self._last
        inference = x.is_inference()
        if last is not None and not inference and last[0]() is x and last[1] == x._version:
            return last[2]
        self.clear()
        value = self._make(*args)
        if not inference:
            self._last = (weakref.ref(x), x._version, value)
        return value

    def clear(self) -> None:
        if self._last is not None and self._release is not None:
            self._release(self._last[2])
        self._last = None


def bf16_dequantized(op: Op) -> Op:
    """The operand's BF16 dequantization, bitwise `dense().to(bfloat16)` (one RNE rounding of the fp32 dequantized
    value): what a dequantized backward multiplies (TE `dequantize(dtype=bf16)`). A bf16-exact operand without a
    second-level scale is returned as it is (MXFP8, BF16: the rounding is a no-op)."""
    if op.s is None and op.exact:
        return op
    return Op(op.dense().to(torch.bfloat16))


def _split3(v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 -> three bf16 terms hi + mid + lo == v exactly, in v's memory layout (RN splitting: each remainder is
    exact in fp32 and has <= 16 resp. <= 8 significant bits)."""
    hi = v.to(torch.bfloat16)
    r = v - hi.float()
    mid = r.to(torch.bfloat16)
    lo = (r - mid.float()).to(torch.bfloat16)
    return hi, mid, lo


def _cat_k(parts) -> torch.Tensor:
    """[R, C] operands -> [R, n*C] concatenated along the contraction dim C, in the parts' memory layout: a
    column-major operand (stride (1, R), e.g. a transposed per-token tensor in wgrad) stays column-major, so its
    leading dimension stays R's allocation and cuBLAS keeps its aligned sm_90 kernels (a row-major copy of a
    [K, tokens] operand has ld = tokens, odd for most expert batches, and cuBLAS then falls back to align-1
    CUTLASS kernels: seen on the H200, ~3x slower)."""
    if parts[0].stride(-1) == 1:
        return torch.cat(parts, dim=1)
    return torch.cat([p.t() for p in parts], dim=0).t()


def _bf16x3(exact16: torch.Tensor, inexact: torch.Tensor, exact_first: bool, gemm) -> Optional[torch.Tensor]:
    """fp32 GEMM of a bf16-exact operand and an fp32 one as ONE bf16 GEMM over a 3x longer contraction:
    [e, e, e] @ [hi, mid, lo]^T = e @ (hi + mid + lo)^T = e @ inexact^T, every product exact, all accumulated in
    fp32 by the GEMM (no [M, 3N] partial outputs to sum afterwards)."""
    terms = _cat_k(_split3(inexact.float()))
    rep = _cat_k([exact16] * 3)
    return gemm(rep, terms) if exact_first else gemm(terms, rep)


@functools.lru_cache(maxsize=None)
def has_out_dtype_mm(device_type: str = "cuda") -> bool:
    """This torch build has an fp32-output bf16 GEMM (`torch.mm(bf16, bf16, out_dtype=torch.float32)`): a fact about
    the build, probed once on a tiny GEMM."""
    try:
        a = torch.ones(16, 16, dtype=torch.bfloat16, device=device_type)
        return torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
    except (TypeError, RuntimeError, NotImplementedError):
        return False


def _mm_bf16_f32(a16: torch.Tensor, b16: torch.Tensor, out: Optional[torch.Tensor] = None
                 ) -> Optional[torch.Tensor]:
    """a16 [M, C] @ b16 [N, C]^T, bf16 operands, fp32 accumulation AND fp32 output (no bf16 rounding of y), into
    `out` if given; None when this torch has no fp32-output bf16 GEMM (the caller then runs the fp32 GEMM: same
    contract, slower)."""
    if not has_out_dtype_mm(a16.device.type):
        return None
    try:
        return torch.mm(a16, b16.t(), out_dtype=torch.float32, out=out)
    except (TypeError, RuntimeError, NotImplementedError):
        # a layout this build refuses (transposed views): the same GEMM on contiguous copies
        return torch.mm(a16.contiguous(), b16.t().contiguous(), out_dtype=torch.float32, out=out)


def _mm_tc(a: Op, b: Op) -> tuple[Optional[torch.Tensor], str]:
    """Tensor-core GEMM of two ops of which at least one is bf16-exact (an fp32 one is split into 3 bf16 terms
    along the contraction dim: `_bf16x3`)."""
    if a.exact and b.exact:
        return _mm_bf16_f32(a.v.to(torch.bfloat16), b.v.to(torch.bfloat16)), BF16_TC
    if b.exact:
        return _bf16x3(b.v.to(torch.bfloat16), a.v, False, _mm_bf16_f32), BF16X3
    return _bf16x3(a.v.to(torch.bfloat16), b.v, True, _mm_bf16_f32), BF16X3


def mm(a: Op, b: Op, stats: Optional[GemmStats] = None) -> torch.Tensor:
    """fp32 [M, N] = dense(a) @ dense(b)^T, tensor cores on CUDA (see module docstring)."""
    if not a.v.is_cuda:  # CPU: fp32 GEMM over the same fp32 values (bit-reproducible, the reference's GEMM)
        y = a.v.float() @ b.v.float().t()
        path = FP32
    elif (a.exact or b.exact) and has_out_dtype_mm(a.v.device.type):
        y, path = _mm_tc(a, b)
    else:
        y, path = None, FP32
    if y is None:  # both operands inexact, or no fp32-output bf16 GEMM in this torch
        y = a.v.float() @ b.v.float().t()
        path = FP32
    sa = None if a.s is None else (a.s.view(-1, 1) if a.s.numel() > 1 else a.s.reshape(()))
    sb = None if b.s is None else (b.s.view(1, -1) if b.s.numel() > 1 else b.s.reshape(()))
    if sa is not None and sb is not None and (sa.dim() == 0 or sb.dim() == 0):
        sa, sb = sa * sb, None  # per-token x per-tensor S_dec: one pass over y (y is ours: scaled in place)
    for s in (sa, sb):
        if s is not None:
            y.mul_(s)
    if stats is not None:
        stats.add(path)
    return y


# ---------------------------------------------------------------------------------------------------------------
# QuantizedTensor -> Op (decode to bf16 elements; second-level scales kept apart)
# ---------------------------------------------------------------------------------------------------------------
_F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
F8_ELEMENT = {v: k for k, v in _F8.items()}  # torch fp8 dtype -> element name
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # code -> value


def _e8m0_bf16(e: torch.Tensor) -> torch.Tensor:
    """E8M0 byte -> 2^(E-127) as bf16 (same exponent field as fp32: bits = E << 7; E = 0 -> 2^-127, the bf16
    subnormal 0x0040; E = 255 -> NaN), exact."""
    ei = e.to(torch.int16)
    bits = torch.where(ei == 0, torch.full_like(ei, 0x0040), ei << 7)
    bits = torch.where(ei == 255, torch.full_like(ei, 0x7FC0), bits)
    return bits.view(torch.bfloat16)


def decode_op(q, rows: Optional[int] = None) -> Op:
    """A formats.QuantizedTensor -> Op in the ORIGINAL orientation [R, C] (columnwise copies transposed back), the
    first `rows` rows (padding dropped). Op.dense() is bitwise formats.dequantize(q, float32)."""
    from .. import formats

    fmt = q.fmt
    decoder = _DECODERS.get(fmt.kind)
    op = decoder(q, rows) if decoder is not None else None
    if op is not None:
        return op
    dense = formats.dequantize(q, torch.float32)
    if rows is not None:
        dense = dense[:rows]
    exact = _EXACT_IN_BF16.get(fmt.kind, _never)(fmt)
    return Op(dense.to(torch.bfloat16) if exact else dense, None, exact)


def _never(fmt) -> bool:
    return False


def _decode_mxfp8(q, rows: Optional[int]) -> Optional[Op]:
    fmt = q.fmt
    if fmt.block in (None, (1, 32), (32, 1)):
        r, c = q.data.shape
        from .. import kernels

        if q.data.is_cuda and kernels.available():  # one pass: bytes + E8M0 -> bf16 values
            from ..kernels.triton_decode import mxfp8_decode_bf16

            v = mxfp8_decode_bf16(q.data, q.scale, fmt.element, q.axis).reshape(q.shape)
            return Op(v if rows is None else v[:rows])
        vals = q.data.view(_F8[fmt.element]).to(torch.bfloat16)
        if q.axis == "row":  # scale [R, C/32]
            v = (vals.view(r, c // 32, 32) * _e8m0_bf16(q.scale)[..., None]).view(r, c)
        else:  # columnwise copy, data not transposed: scale [R/32, C]
            v = (vals.view(r // 32, 32, c) * _e8m0_bf16(q.scale)[:, None, :]).view(r, c)
        v = v.reshape(q.shape)
        return Op(v if rows is None else v[:rows])
    return None


def _decode_nvfp4(q, rows: Optional[int]) -> Optional[Op]:
    if q.fmt.block in (None, (1, 16)) and q.axis == "row":
        from .. import kernels

        if q.data.is_cuda and kernels.available():  # one pass: packed codes + block scales -> bf16 elements
            from ..kernels.triton_decode import nvfp4_decode_bf16

            v = nvfp4_decode_bf16(q.data, q.scale)
        else:
            codes = torch.stack([q.data & 0xF, q.data >> 4], dim=-1).reshape(q.data.shape[0], -1)  # low nibble first
            vals = torch.tensor(_E2M1, dtype=torch.float32, device=q.data.device)[codes.long()]
            r, c = vals.shape
            v = (vals.view(r, c // 16, 16) * q.scale.view(torch.float8_e4m3fn).float().view(r, c // 16, 1))
            v = v.view(r, c).to(torch.bfloat16)
        s = q.global_scale.float()
        if rows is not None:
            v = v[:rows]
            s = s[:rows] if s.numel() > 1 else s
        return Op(v, s)
    return None


# The one-pass decoders by kind (None: a layout they do not take -> the dense reference dequantization), and the
# kinds whose dense dequantization is exact in bf16 (element x 2^k, like MXFP8: pow2-scaled FP8 blocks).
_DECODERS = {FormatKind.MXFP8: _decode_mxfp8, FormatKind.NVFP4: _decode_nvfp4}
_EXACT_IN_BF16 = {FormatKind.FP8_BLOCK: lambda fmt: fmt.scale_dtype == "pow2"}


def _fp8_kernel_ok(x: torch.Tensor, k: int) -> bool:
    from .. import kernels

    return x.is_cuda and k % 128 == 0 and kernels.available()


def _fp8_a_buffers(m16: int, k: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(data [m16, K], scale_inv [m16, K/128]) for a 1x128 FP8 GEMM operand A, the scale grid allocated outer-dim-
    major (its transpose contiguous): the layout cuBLASLt's block-scaled GEMM reads (NativeFp8Gemm: `outer_major_m4`
    is then a view, no copy per GEMM)."""
    data = torch.empty(m16, k, dtype=torch.uint8, device=device)
    scale = torch.empty(k // 128, m16, dtype=torch.float32, device=device).t()
    return data, scale


def fp8_rows16(x16: torch.Tensor, fmt, what: str = ""):
    """1x128 FP8 quantization of x16 [M, K] as (q, a_data, a_scale): q = numerics.quantize(x16, fmt) (its bytes, for
    fallbacks and checks: views of the buffers); a_data / a_scale = the quantization of x16 zero-padded to a multiple
    of 16 rows (a zero row: zero bytes, scale_inv 1 - NativeFp8Gemm's own padding of token counts cuBLASLt refuses,
    which then needs no copy), written by ONE kernel launch with the scale grid in cuBLASLt's layout. Without the
    kernel (CPU), q's own tensors."""
    m, k = x16.shape
    if not _fp8_kernel_ok(x16, k):
        from . import numerics

        q = numerics.quantize(x16, fmt, what=what)
        return q, q.data, q.scale
    from ..formats.base import QuantizedTensor
    from ..kernels import triton_fp8_block as kern

    data, sinv = _fp8_a_buffers(-(-m // 16) * 16, k, x16.device)
    with torch.cuda.device(x16.device):
        kern.quantize(x16.contiguous(), fmt.element, square=False, pow2=fp8_block_pow2(fmt), out=(data, sinv),
                      pad_rows_to=16)
    q = QuantizedTensor(fmt=fmt, shape=(m, k), data=data[:m], scale=sinv[:m], axis="row", orig_dtype=x16.dtype,
                        kernel="triton")
    return q, data, sinv


def fp8_rowcol16(g: torch.Tensor, fmt):
    """Both 1x128 FP8 copies of g [M, N] from ONE read of g (one kernel launch), for the native backward:
    (q_row, row_data, row_scale, q_col). q_row = the rowwise copy (dgrad's A operand), with row_data / row_scale its
    bytes for g zero-padded to a multiple of 16 rows, as `fp8_rows16`; q_col = the columnwise copy of g zero-padded
    to a multiple of 128 tokens (wgrad's A operand, [N, Mp]), quantized without a padded copy of g."""
    from .. import kernels

    m, n = g.shape
    pow2 = fp8_block_pow2(fmt)
    if not _fp8_kernel_ok(g, n):
        q_row, q_col = kernels.fp8_block_quantize_rowcol(g, fmt.element, pow2=pow2, pad_rows_to=128, fmt=fmt)
        return q_row, q_row.data, q_row.scale, q_col
    from ..formats.base import QuantizedTensor
    from ..kernels import triton_fp8_block as kern

    data, sinv = _fp8_a_buffers(-(-m // 16) * 16, n, g.device)
    with torch.cuda.device(g.device):
        _, _, cd, cs = kern.quantize_rowcol(g.contiguous(), fmt.element, pow2=pow2, pad_rows_to=128,
                                            out_row=(data, sinv), row_pad_to=16)
    q_row = QuantizedTensor(fmt=fmt, shape=(m, n), data=data[:m], scale=sinv[:m], axis="row", orig_dtype=g.dtype,
                            kernel="triton")
    mp = cd.shape[1]
    q_col = QuantizedTensor(fmt=fmt, shape=(mp, n), data=cd, scale=cs, axis="col", orig_dtype=g.dtype,
                            kernel="triton")
    return q_row, data, sinv, q_col


# ---------------------------------------------------------------------------------------------------------------
# native FP8 block-scaled GEMM (Hopper)
# ---------------------------------------------------------------------------------------------------------------
def native_fp8_available(device) -> bool:
    """torch._scaled_mm with 1x128 / 128x128 block scales: cuBLASLt implements it on sm_90 only."""
    if not (isinstance(device, torch.device) and device.type == "cuda") or not hasattr(torch, "_scaled_mm"):
        return False
    return torch.cuda.get_device_capability(device) == (9, 0)


def _grid_l4_view(s: torch.Tensor) -> torch.Tensor:
    """cuBLASLt's 128x128 scale grid [R, L] stored with its K-block count padded to L4 = roundup(L, 4): a [R, L4]
    buffer (zeros beyond L, never read) viewed as [R, L] with row stride L4."""
    r, l4 = s.shape[0], -(-s.shape[1] // 4) * 4
    if l4 == s.shape[1]:
        return s.contiguous()
    buf = s.new_zeros(r, l4)
    buf[:, :s.shape[1]] = s
    return buf[:, :s.shape[1]]


def outer_major_m4(s: torch.Tensor) -> torch.Tensor:
    """A 1x128 scale grid [M, L] laid out outer-dim-major with its column stride padded to M4 = roundup(M, 4) (16-byte
    aligned columns): the H200 run (torch 2.11) refused the plain outer-dim-major layout for every M % 4 != 0
    ("scale_a.size()=[39, 1], stride=[1, 1]" ... for the token counts of single experts) and accepted M % 4 == 0."""
    m, l = s.shape
    m4 = -(-m // 4) * 4
    if m4 == m:
        return s.t().contiguous().t()
    buf = s.new_zeros(l, m4)
    buf[:, :m] = s.t()
    return buf[:, :m].t()


def _scale_layouts(b_scale, b_block) -> list[tuple[str, str]]:
    """Candidate (scale_a, scale_b) layouts, the documented one first, as (A form, B form) names of _A_FORMS /
    _B_FORMS (`_layout` builds one: a verified shape class builds only its own, each candidate being a few small
    copies and the hot path one GEMM per call). A: 1x128 outer-dim-major [M, C/128]. B given as the [C, N] transpose
    view of our [N, C] bytes: 1x128 -> [C/128, N] (torch's test_scaled_mm_vs_emulated_block_wise), 128x128 -> the
    [L, N/128] transpose of the grid, which torch checks as [N/128, L] with row stride L4 (newer torch) or L
    (older), or padded to [N/128, L4] (the probe's shapes had L % 4 == 0)."""
    bs = [b for b in _B_FORMS[b_block == (1, 128)]
          if not (b == "b128:l4-padded" and b_scale.shape[1] % 4 == 0)]  # no K-block padding to add: = l4-view
    return [(a, b) for a in _A_FORMS for b in bs]


# the scale layouts as functions of the scale tensor (first A form: 16-byte columns; the last for other torch builds)
_A_FORMS = {"a-m4/": outer_major_m4, "": lambda s: s.t().contiguous().t(), "a-contig/": lambda s: s.contiguous()}
_B_FORMS = {
    True: {"b1x128:m4": lambda s: outer_major_m4(s).t(), "b1x128:t-contig": lambda s: s.t().contiguous(),
           "b1x128:t-view": lambda s: s.contiguous().t()},
    False: {"b128:l4-view": lambda s: _grid_l4_view(s).t(), "b128:contig": lambda s: s.contiguous().t(),
            "b128:l4-padded": lambda s: F.pad(s, (0, (-s.shape[1]) % 4)).t()},
}


def _layout(form: tuple[str, str], a_scale, b_scale, b_block) -> tuple:
    """(scale_a, scale_b) in the layout `form` = (A form, B form) of `_scale_layouts`."""
    a, b = form
    return _A_FORMS[a](a_scale), _B_FORMS[b_block == (1, 128)][b](b_scale)


def _ref_blocked(a_data, a_scale, a_block, b_data, b_scale, b_block, ea, eb) -> torch.Tensor:
    """fp32 GEMM of the dequantized operands (the block-scaled math spelled out) for the first-use check."""
    def deq(d, s, blk, e):
        v = d.view(_F8[e]).float()
        r, c = v.shape
        if blk[0] > 1:
            s = s.repeat_interleave(blk[0], 0)[:r]
        return v * s.repeat_interleave(blk[1], 1)[:, :c]
    return deq(a_data, a_scale, a_block, ea) @ deq(b_data, b_scale, b_block, eb).t()


def _row_major(t: torch.Tensor) -> torch.Tensor:
    """t itself when cuBLASLt can read it in place as a row-major matrix (unit column stride, 16-aligned leading
    dimension: a row or column slice of a grouped buffer), else a contiguous copy."""
    if t.stride(-1) == 1 and t.stride(0) % 16 == 0 and t.stride(0) >= t.shape[1] and t.data_ptr() % 16 == 0:
        return t
    return t.contiguous()


def write_into(out: Optional[torch.Tensor], y: torch.Tensor) -> torch.Tensor:
    """y itself (out None) or y copied into out (a GEMM result for a slice of a grouped buffer)."""
    if out is None:
        return y
    out.copy_(y)
    return out


def mm_bf16_into(out: torch.Tensor, a16: torch.Tensor, b16: torch.Tensor, stats: Optional[GemmStats] = None
                 ) -> torch.Tensor:
    """out (fp32 [M, N]) = a16 [M, C] @ b16 [N, C]^T for bf16 operands with fp32 accumulation, written in place (a row
    slice of a grouped buffer): `mm`'s BF16 x BF16 path without a new output per GEMM."""
    if a16.is_cuda:
        if _mm_bf16_f32(a16, b16, out) is None:  # no fp32-output bf16 GEMM in this torch: `mm`'s fp32 GEMM
            return out.copy_(mm(Op(a16), Op(b16), stats))
        path = BF16_TC
    else:  # CPU: the fp32 GEMM of the same (bf16-valued) operands, as `mm`
        torch.mm(a16.float(), b16.float().t(), out=out)
        path = FP32
    if stats is not None:
        stats.add(path)
    return out


def _msg(e: BaseException) -> str:
    """torch's refusal: its first line and its tail (the 'Got ... size/stride' part that says what was wrong)."""
    t = str(e)
    return t if len(t) <= 500 else f"{t[:120]} ... {t[-380:]}"


class NativeFp8Gemm:
    """Native FP8 block-scaled GEMMs (torch._scaled_mm) with the layout state they learn on first use: one per
    executor (the trainer's and the rollout's each own one), never module-global, so two models in one process (or a
    test) never see each other's choices.

    `recipes`: (a_block, b_block, ea, eb) -> the (scale layout, out dtype) that last passed the check (the first guess
    at a new shape class); `verified`: shape class -> the layout checked against the block-scaled math in that class;
    `refused`: shape classes refused in every layout (emulated from then on); `errors`: recipe -> the last refusal or
    mismatch (torch's message names the layout), for the run report."""

    def __init__(self):
        self.recipes: dict = {}
        self.verified: dict = {}
        self.refused: dict = {}
        self.errors: dict = {}

    def __call__(self, a_data, a_scale, a_block, b_data, b_scale, b_block, ea="e4m3", eb="e4m3",
                 stats: Optional[GemmStats] = None, out: Optional[torch.Tensor] = None) -> Optional[torch.Tensor]:
        """fp32 [M, N] = A @ B^T with A = a_data [M, C] (uint8 fp8 bytes) scaled per `a_block` ((1, 128): scale_inv
        [M, C/128]) and B = b_data [N, C] scaled per `b_block` ((128, 128): [N/128, C/128]; (1, 128): [N, C/128]),
        both row-major as our quantizers store them. None when cuBLASLt cannot run this call (the caller emulates it).

        The scale layout and output dtype are chosen per (recipe, C, N) on first use, by checking candidates (the
        recipe's last good one first) against the fp32 GEMM of the dequantized operands (rel. error < 1e-2), then
        reused for every M; a shape refused in every layout is remembered and emulated.

        `out`: an fp32 [M, N] tensor (a row slice of a grouped buffer, say) the result is written into and returned
        as; None: a new tensor. Operands may be row slices or column slices of larger row-major buffers (leading
        dimension = the buffer's row stride, a multiple of 16): cuBLASLt reads them in place, no copy."""
        m, c = a_data.shape
        pad = (-m) % 16
        if pad and a_block == (1, 128):
            # torch 2.11 on the H200 refused every scale layout tried for M % 4 != 0 (e.g. 3033 tokens x 2048 x
            # 3072, the token counts of single experts) and accepted M % 4 == 0. A's rows are independent under 1x128
            # scales: zero rows (fp8 +0, scale 1) appended and their outputs dropped leave every real output
            # unchanged. (H200 run 2026-12-01: 1260 of 1260 fp8 trainer GEMMs native with this, 720 refused before.)
            a_pad = torch.cat([a_data, a_data.new_zeros(pad, c)])
            s_pad = torch.cat([a_scale.float(), a_scale.new_ones(pad, a_scale.shape[1], dtype=torch.float32)])
            y = self(a_pad, s_pad, a_block, b_data, b_scale, b_block, ea, eb, stats)
            return None if y is None else write_into(out, y[:m])
        n = b_data.shape[0]
        key = (a_block, b_block, ea, eb)
        if c % 128 or n % 16 or a_block != (1, 128) or b_block not in ((1, 128), (128, 128)) \
                or (ea, eb) == ("e5m2", "e5m2"):
            return None
        cls = (key, c if b_block == (128, 128) else (c // 128) % 4, n)
        if self.refused.get(cls):
            return None
        a8 = _row_major(a_data).view(_F8[ea])
        b8 = _row_major(b_data).view(_F8[eb]).t()  # [C, N] column-major: the transpose view of the [N, C] bytes
        a_scale, b_scale = a_scale.float(), b_scale.float()
        # a layout torch accepts could be read differently at other block counts: each shape class is checked once
        # (128x128 grids: the weight's (C, N); 1x128 x 1x128 (wgrad, C = tokens): N and C/128 mod 4)
        state = self.verified.get(cls)
        if state is not None:
            form, dt = state
            sa, sb = _layout(form, a_scale, b_scale, b_block)
            try:
                if out is not None and dt == torch.float32:
                    y = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=dt, out=out)
                else:
                    y = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=dt)
                    y = write_into(out, y if dt == torch.float32 else y.float())
                if stats is not None:
                    stats.add(NATIVE_FP8)
                return y
            except (RuntimeError, ValueError, NotImplementedError) as e:
                self.errors[key] = f"[{m}x{c}x{n} {''.join(form)}] {type(e).__name__}: {_msg(e)}"
        want = _ref_blocked(a_data, a_scale, a_block, b_data, b_scale, b_block, ea, eb)
        prev = self.recipes.get(key) or None
        order = ([prev[0]] if prev else []) + [f for f in _scale_layouts(b_scale, b_block)
                                                 if not prev or f != prev[0]]
        for form in order:
            name = "".join(form)
            sa, sb = _layout(form, a_scale, b_scale, b_block)
            for dt in ((prev[1],) if prev and form == prev[0] else ()) + (torch.float32, torch.bfloat16):
                try:
                    y = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=dt).float()
                except (RuntimeError, ValueError, NotImplementedError) as e:
                    self.errors[key] = f"[{m}x{c}x{n} {name} {dt}] {type(e).__name__}: {_msg(e)}"
                    continue
                rel = float((y - want).norm() / want.norm().clamp(min=1e-30))
                if rel < 1e-2:
                    self.recipes[key] = self.verified[cls] = (form, dt)  # the recipe's first guess at new shapes
                    if stats is not None:
                        stats.add(NATIVE_FP8)
                    return write_into(out, y)
                self.errors[key] = (f"[{m}x{c}x{n} {name} {dt}] result differs from the block-scaled math "
                                    f"(rel {rel:.2e})")
        self.refused[cls] = True
        return None
