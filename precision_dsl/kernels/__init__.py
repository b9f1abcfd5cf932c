"""Fused Triton quantize kernels for Hopper (H100/H200, sm_90) with the readable references as fallback.

Every entry point here has the signature and the result (a `QuantizedTensor`, byte for byte) of the matching
reference in precision_dsl/formats/ (the oracle, tests/test_kernels.py checks it on the golden vectors and on
random tensors of real shapes). When the kernels cannot run - no CUDA, no Triton, a CPU tensor, a GPU older than
sm_89 (no fp8 cvt) - or the request is one the kernels do not cover (MXFP8 32x32 tiles, NVFP4 per-row scope with
a given per-row amax, empty tensors, invalid shapes/dtypes, which the reference reports with a clear
FormatInputError) the call is answered by the reference.

    available() -> bool
    nvfp4_quantize(x, axis="row", scope="tensor", tile_2d=False, global_amax=None, fmt=None)
    mxfp8_quantize(x, element="e4m3", axis="row", tile_2d=False, fmt=None)
    mxfp8_quantize_rowcol(x, element="e4m3") -> (rowwise, columnwise)      # one read of x for both copies
    fp8_block_quantize(x, element="e4m3", block=(1, 128), pow2=True, axis="row", fmt=None)

Heavy imports (torch, triton) happen inside the functions so that importing this package stays cheap.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

__all__ = ["available", "nvfp4_quantize", "mxfp8_quantize", "mxfp8_quantize_rowcol", "fp8_block_quantize"]


@functools.lru_cache(maxsize=None)
def _device_ok(index: int) -> bool:
    import torch

    major, minor = torch.cuda.get_device_capability(index)
    return (major, minor) >= (8, 9)  # cvt.rn.satfinite.{e4m3x2,e5m2x2}.f32 needs sm_89+


@functools.lru_cache(maxsize=None)
def _triton_ok() -> bool:
    """Triton importable AND able to switch libdevice's flush-to-zero off (`enable_reflect_ftz`, triton 3.x with the
    NVIDIA backend; tested with 3.6.0): without it `div_rn` flushes subnormal quotients and the kernels would not be
    byte-exact, so they are not used."""
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except Exception:
        return False
    fields = CUDAOptions.__dataclass_fields__
    return "enable_reflect_ftz" in fields and "enable_fp_fusion" in fields


def available() -> bool:
    """True when the Triton kernels can run here: a CUDA device of compute capability >= 8.9 and a Triton that can
    compile them exactly (see _triton_ok)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except Exception:
        return False
    return _triton_ok() and _device_ok(torch.cuda.current_device())


def _usable(x) -> bool:
    import torch

    return (isinstance(x, torch.Tensor) and x.is_cuda and x.dim() >= 1 and x.numel() > 0
            and x.dtype in (torch.float32, torch.bfloat16, torch.float16) and available()
            and _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device()))


def _as_2d(x):
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    return x.reshape(m, k).contiguous()


def nvfp4_quantize(x, axis: str = "row", scope: str = "tensor", tile_2d: bool = False, global_amax=None,
                   fmt=None):
    """NVFP4 (TE >= 2.14), same contract as `precision_dsl.formats.nvfp4.quantize`."""
    from ..formats import nvfp4 as ref
    from ..formats.base import QuantizedTensor

    if not _usable(x) or axis not in ("row", "col") or scope not in ref.SCOPES + ("expert", "group"):
        return ref.quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, global_amax=global_amax, fmt=fmt)
    import torch

    x2 = _as_2d(x)
    m, k = x2.shape
    if k % 16 or ((tile_2d or axis == "col") and m % 16) or (tile_2d and scope == "row") or \
            (scope == "group" and global_amax is None) or (scope == "row" and global_amax is not None):
        return ref.quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, global_amax=global_amax, fmt=fmt)
    if axis == "col":
        x2 = x2.t().contiguous()
    from . import triton_nvfp4 as kern

    with torch.cuda.device(x2.device):
        if scope == "row":
            data, scale, sdec, g = kern.row_scaled(x2)
        else:
            g_in = None
            if global_amax is not None:
                g_in = torch.as_tensor(global_amax, dtype=torch.float32).to(x2.device)
                if g_in.numel() != 1:
                    return ref.quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, global_amax=global_amax,
                                        fmt=fmt)
            data, scale, sdec, g = kern.per_tensor(x2, g_in, tile_2d)
    return QuantizedTensor(fmt=fmt or ref.make_format(scope, tile_2d), shape=tuple(x.shape), data=data,
                               scale=scale, global_scale=sdec, global_amax=g, axis=axis, orig_dtype=x.dtype)


def mxfp8_quantize_rowcol(x, element: str = "e4m3"):
    """(rowwise 1x32, columnwise 32x1) MXFP8 copies of x from one read of x (TE's layouts; data not transposed).
    Same bytes as `mxfp8.quantize(x, element, axis="row")` and `(..., axis="col")`."""
    from ..formats import mxfp8 as ref
    from ..formats.base import QuantizedTensor

    if not _usable(x) or element not in ("e4m3", "e5m2"):
        return ref.quantize(x, element, axis="row"), ref.quantize(x, element, axis="col")
    x2 = _as_2d(x)
    m, k = x2.shape
    if k % 32 or m % 32:
        return ref.quantize(x, element, axis="row"), ref.quantize(x, element, axis="col")
    import torch

    from . import triton_mxfp8 as kern

    with torch.cuda.device(x2.device):
        rd, rs, cd, cs = kern.quantize_rowcol(x2, element, True, True)
    f = ref.make_format(element)
    row = QuantizedTensor(fmt=f, shape=tuple(x.shape), data=rd, scale=rs, axis="row", orig_dtype=x.dtype)
    col = QuantizedTensor(fmt=f, shape=tuple(x.shape), data=cd, scale=cs, axis="col", orig_dtype=x.dtype)
    return row, col


def mxfp8_quantize(x, element: str = "e4m3", axis: str = "row", tile_2d: bool = False, fmt=None):
    """MXFP8 (TE rule), same contract as `precision_dsl.formats.mxfp8.quantize` (32x32 tiles: reference)."""
    from ..formats import mxfp8 as ref
    from ..formats.base import QuantizedTensor

    if not _usable(x) or tile_2d or element not in ("e4m3", "e5m2") or axis not in ("row", "col"):
        return ref.quantize(x, element, axis=axis, tile_2d=tile_2d, fmt=fmt)
    x2 = _as_2d(x)
    m, k = x2.shape
    if (axis == "row" and k % 32) or (axis == "col" and (m % 32 or k % 32)):
        return ref.quantize(x, element, axis=axis, tile_2d=tile_2d, fmt=fmt)
    import torch

    from . import triton_mxfp8 as kern

    with torch.cuda.device(x2.device):
        rd, rs, cd, cs = kern.quantize_rowcol(x2, element, rowwise=axis == "row", colwise=axis == "col")
    data, scale = (rd, rs) if axis == "row" else (cd, cs)
    return QuantizedTensor(fmt=fmt or ref.make_format(element), shape=tuple(x.shape), data=data, scale=scale,
                               axis=axis, orig_dtype=x.dtype)


def fp8_block_quantize(x, element: str = "e4m3", block=(1, 128), pow2: bool = True, axis: str = "row",
                       fmt: Optional[object] = None):
    """FP8 block scaling (TE Float8BlockScaling), same contract as `precision_dsl.formats.fp8_block.quantize`."""
    from ..formats import fp8_block as ref
    from ..formats.base import QuantizedTensor

    block = tuple(block) if isinstance(block, (tuple, list)) else block
    if not _usable(x) or element not in ("e4m3", "e5m2") or block not in ref.BLOCKS or axis not in ("row", "col"):
        return ref.quantize(x, element, block, pow2, axis=axis, fmt=fmt)
    import torch

    from . import triton_fp8_block as kern

    x2 = _as_2d(x)
    with torch.cuda.device(x2.device):
        data, sinv = kern.quantize(x2, element, square=block == (128, 128), pow2=pow2, transpose=axis == "col")
    return QuantizedTensor(fmt=fmt or ref.make_format(element, block, pow2), shape=tuple(x.shape), data=data,
                               scale=sinv, axis=axis, orig_dtype=x.dtype)


def quantize(x, fmt, *, axis: str = "row", global_amax=None):
    """Format-generic entry point with the contract of `precision_dsl.formats.quantize(x, fmt, ...)`: the fused
    Triton kernel for `fmt` when `x` is on a capable GPU (byte-identical to the reference, tests/test_kernels.py),
    otherwise the reference itself (CPU, FP8 per-tensor, shapes or options the kernels do not take)."""
    from .. import formats
    from ..formats import check_format, fp8_block_args, mxfp8_layout, nvfp4_args
    from ..precision import FormatKind

    if not _usable(x):
        return formats.quantize(x, fmt, axis=axis, global_amax=global_amax)
    # The TensorFormat -> arguments mapping (and its validation) is the reference dispatch's, so the two can't drift.
    check_format(fmt, global_amax)
    if fmt.kind == FormatKind.NVFP4:
        tile_2d, scope = nvfp4_args(fmt)
        return nvfp4_quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, global_amax=global_amax, fmt=fmt)
    if fmt.kind == FormatKind.MXFP8:
        ax, tile_2d = mxfp8_layout(fmt, axis)
        return mxfp8_quantize(x, element=fmt.element, axis=ax, tile_2d=tile_2d, fmt=fmt)
    if fmt.kind == FormatKind.FP8_BLOCK:
        block, pow2 = fp8_block_args(fmt)
        return fp8_block_quantize(x, element=fmt.element, block=block, pow2=pow2, axis=axis, fmt=fmt)
    return formats.quantize(x, fmt, axis=axis, global_amax=global_amax)
