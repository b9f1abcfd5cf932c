"""Shared bit-level helpers of the reference quantizers (fp32 bit patterns, fp8 casts, input checks).

Rules every reference follows:
  * all arithmetic is IEEE fp32 round-to-nearest-even (RN), no flush-to-zero, as TE's cast kernels (compiled without
    --use_fast_math: TE transformer_engine/common/CMakeLists.txt); bf16/fp16 inputs are upcast exactly to fp32 first;
  * a correctly rounded quotient a/b is computed as `torch.div(a_t, b_t)` with both operands fp32 tensors of the
    SAME shape and device: on CUDA `tensor / python_scalar` (and a CPU 0-dim divisor) is `x * RN(1/b)` (ATen
    native/cuda/BinaryDivTrueKernel.cu `div_true_kernel_cuda`), and `scalar / tensor` is `reciprocal(t) * scalar`
    (torch/_tensor.py `__rtruediv__`) - two roundings;
  * float8 casts are preceded by a clamp to +-Fmax: eager casts did not saturate finite overflow before torch 2.13,
    and the E5M2 cast still turns overflow into inf (checked on torch 2.13 CPU);
  * never `torch.compile` these functions: Triton lowers fp32 `/` to an approximate division (triton-lang/triton
    #10661).
"""

from __future__ import annotations

import math

import torch

from ..precision import FP8_MAX  # noqa: F401  (re-exported to the format modules)
from .base import FormatInputError

NAN_BYTE = 0x7F  # every NaN element's byte, E4M3 and E5M2: what cvt.rn.satfinite (TE's kernels, ours) writes

FLT_MAX = 3.4028234663852886e38  # largest finite fp32
FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def as_2d_fp32(x: torch.Tensor, what: str) -> tuple[torch.Tensor, tuple[int, ...]]:
    """Validate `x` and view it as a contiguous fp32 [M, K] matrix (M = prod(shape[:-1]), K = shape[-1]).

    Accepted: fp32 / bf16 / fp16 tensors with >= 1 dim, any strides (non-contiguous views are copied to a
    contiguous tensor first, values unchanged), any device. Empty tensors are allowed (results are empty).
    Returns (x2d_fp32, original_shape)."""
    if not isinstance(x, torch.Tensor):
        raise FormatInputError(f"{what}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise FormatInputError(
            f"{what}: input dtype {x.dtype} is not supported; the reference quantizers take float32, bfloat16 or "
            f"float16 (cast with x.float() first; integer / fp8 / float64 inputs are rejected to avoid silent rounding)"
        )
    if x.dim() == 0:
        raise FormatInputError(f"{what}: input is a 0-dim scalar; quantizers need a tensor with a last (K) dimension "
                               f"(use x.reshape(1, 1) if you really mean one element)")
    shape = tuple(x.shape)
    k = shape[-1]
    m = math.prod(shape[:-1])
    return x.reshape(m, k).contiguous().float(), shape


def require_divisible(what: str, dim_name: str, size: int, block: int, hint: str) -> None:
    if size % block != 0:
        raise FormatInputError(
            f"{what}: {dim_name}={size} is not divisible by the block size {block}; {hint}"
        )


def f32_bits(t: torch.Tensor) -> torch.Tensor:
    """int32 bit pattern of an fp32 tensor."""
    return t.contiguous().view(torch.int32)


def f32_from_bits(b: torch.Tensor) -> torch.Tensor:
    return b.to(torch.int32).contiguous().view(torch.float32)


def f32_const(v: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """0-dim fp32 tensor holding RN_fp32(v) (v is rounded once, from the Python double)."""
    return torch.tensor(v, dtype=torch.float32, device=device)


def rn_div(num: float | torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """Correctly rounded fp32 quotient num/den (elementwise, IEEE RN), safe on CPU and CUDA.

    `num` is broadcast to den's shape as a real tensor so that PyTorch never takes its multiply-by-reciprocal
    shortcut for scalar divisors/dividends."""
    den = den.float()
    if isinstance(num, torch.Tensor):
        num_t = num.float().expand_as(den).contiguous() if num.shape != den.shape else num.float()
    else:
        num_t = torch.full_like(den, float(num))
    return torch.div(num_t, den)


# Below this many elements a block max is computed by folding halves with torch.maximum instead of amax(dim):
# on CPU a dim-reduction of >= 32768 elements opens an OpenMP parallel region, which on a loaded 2-core machine
# costs milliseconds (measured: 4-8 ms vs 35 us for a 256x128 tensor), while each fold step stays below the
# parallel grain size. Max is exact, so both paths give identical bits; above the threshold amax is faster.
_FOLD_MAX_NUMEL = 1 << 20


def _fold_max(a: torch.Tensor, dim: int) -> torch.Tensor:
    """max over `dim` (kept, size 1) by pairwise folding while the size is even; NaN propagates like amax."""
    n = a.shape[dim]
    while n > 1 and n % 2 == 0:
        n //= 2
        a = torch.maximum(a.narrow(dim, 0, n), a.narrow(dim, n, n))
    return a if n == 1 else a.amax(dim=dim, keepdim=True)


def _max_over(a: torch.Tensor, dim, keepdim: bool) -> torch.Tensor:
    if dim is None:
        return a.amax()
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    if a.numel() > _FOLD_MAX_NUMEL or a.numel() == 0:
        return a.amax(dim=dims, keepdim=keepdim)
    for d in dims:
        a = _fold_max(a, d)
    return a if keepdim else a.squeeze(dims)


def abs_amax_nan(x: torch.Tensor, dim=None, keepdim: bool = False) -> tuple[torch.Tensor, bool]:
    """(max |x| over `dim` ignoring NaN, whether x contained a NaN) - NaN is ignored like the hardware max of TE's
    kernels; a NaN-only reduction gives 0.

    Cheap in the common case: torch.amax / torch.maximum propagate NaN, so NaN is only replaced (one more pass)
    when the (small) reduced tensor contains a NaN."""
    a = x.abs()
    r = _max_over(a, dim, keepdim)
    if not bool(torch.isnan(r).any()):
        return r, False
    a = a.masked_fill_(torch.isnan(a), 0.0)
    return _max_over(a, dim, keepdim), True


def abs_amax(x: torch.Tensor, dim=None, keepdim: bool = False) -> torch.Tensor:
    """max |x| over `dim`, ignoring NaN (see abs_amax_nan)."""
    return abs_amax_nan(x, dim, keepdim)[0]


def fp8_bytes_satfinite(y: torch.Tensor, element: str, nan_byte: int | None = None) -> torch.Tensor:
    """fp32 -> fp8 (E4M3 / E5M2) bytes as `cvt.rn.satfinite`: RNE, finite overflow and +-inf clamp to +-Fmax,
    NaN stays NaN. `nan_byte` (e.g. 0x7F, TE's choice for every NaN) overrides the NaN byte torch would pick
    (torch keeps the NaN's sign bit); pass it only when y may hold a NaN (it costs a pass)."""
    fmax = FP8_MAX[element]
    q = y.clamp(-fmax, fmax).to(FP8_DTYPES[element]).view(torch.uint8)
    if nan_byte is not None:
        q = q.masked_fill_(torch.isnan(y), nan_byte)
    return q


def fp8_bytes_to_f32(b: torch.Tensor, element: str) -> torch.Tensor:
    return b.contiguous().view(FP8_DTYPES[element]).float()
