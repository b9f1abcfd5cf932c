"""THE quantize entry point: one call, an explicit kernel choice, and a report of which path ran.

    quantize(x, fmt, *, axis="row", global_amax=None, kernel="auto") -> QuantizedTensor   # q.kernel says which ran

`kernel` (torchao's KernelPreference idea):
  * "reference": the readable, bit-exact reference in precision_dsl/formats/ (the numerics oracle);
  * "triton":    the fused Triton kernel; a call it cannot run raises KernelUnavailable saying why (never a silent
                 fallback);
  * "auto":      the kernel when it can run this call on a GPU, else the reference.
Either way the result is byte for byte the reference's (tests/test_kernels.py: golden vectors and random tensors,
on the H200 and on CPU under Triton's interpreter). The kernel runs on a CUDA device of compute capability >= 8.9
(fp8 cvt) with a Triton that can switch libdevice's flush-to-zero off, or on CPU under TRITON_INTERPRET=1. It does
not cover FP8 per-tensor, MXFP8 32x32 tiles, NVFP4 16x16 tiles with a per-token scope or a given per-token amax, and
shapes that do not divide into blocks (the reference raises a FormatInputError for those that are invalid).

The per-format entry points take the reference modules' own arguments (benchmarks and tests use them):
    nvfp4_quantize(x, axis="row", scope=Scope.TENSOR, tile_2d=False, global_amax=None, fmt=None, kernel="auto")
    mxfp8_quantize(x, element="e4m3", axis="row", tile_2d=False, fmt=None, kernel="auto")
    mxfp8_quantize_rowcol(x, element="e4m3", kernel="auto") -> (rowwise, columnwise)   # one read of x for both
    fp8_block_quantize(x, element="e4m3", block=(1, 128), pow2=True, axis="row", fmt=None, kernel="auto",
                       pad_rows_to=1)                 # pad_rows_to: as if x[M, K] were zero-padded to a multiple
    fp8_block_quantize_rowcol(x, element="e4m3", pow2=True, pad_rows_to=128, fmt=None, kernel="auto")
        -> (rowwise 1x128, columnwise 1x128 of the row-padded x)                        # one read of x for both

Triton is imported only when a kernel launches (the package itself needs formats/, i.e. torch).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
from typing import Callable, Optional

from ..formats import FormatInputError, check_format, quantizer_kwargs
from ..precision import FormatKind, Scope

__all__ = ["KERNELS", "KernelUnavailable", "available", "quantize", "nvfp4_quantize",
           "mxfp8_quantize", "mxfp8_quantize_rowcol", "fp8_block_quantize", "fp8_block_quantize_rowcol"]

KERNELS = ("auto", "triton", "reference")


class KernelUnavailable(FormatInputError):
    """kernel="triton" was requested for a call the fused kernels cannot run here (the message says why)."""


def interpreting() -> bool:
    """Triton's interpreter (TRITON_INTERPRET=1): kernels run on CPU tensors with numpy semantics (CI)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


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
    """True when the Triton kernels can run on a GPU here: a CUDA device of compute capability >= 8.9 and a Triton
    that can compile them exactly (see _triton_ok)."""
    try:
        import torch

        if not torch.cuda.is_available():
            return False
    except Exception:
        return False
    return _triton_ok() and _device_ok(torch.cuda.current_device())


def _why_not_device(x) -> Optional[str]:
    """Why the fused kernels cannot take tensor `x` at all (None: they can)."""
    import torch

    if not isinstance(x, torch.Tensor):
        return f"expected a torch.Tensor, got {type(x).__name__}"
    if x.dim() < 1 or x.numel() == 0:
        return "empty or 0-dim tensor"
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return f"input dtype {x.dtype} (the kernels take fp32/bf16/fp16)"
    if interpreting():
        if x.is_cuda:
            return "TRITON_INTERPRET=1 runs kernels on CPU tensors only"
        try:
            import triton  # noqa: F401
        except ImportError:
            return "TRITON_INTERPRET=1 but triton is not installed"
        return None
    if not x.is_cuda:
        return "x is not a CUDA tensor (run under TRITON_INTERPRET=1 to use the kernels on CPU)"
    if not available():
        return "no CUDA device of compute capability >= 8.9 with a Triton that can switch flush-to-zero off"
    if not _device_ok(x.device.index if x.device.index is not None else torch.cuda.current_device()):
        return f"device {x.device} is older than sm_89 (no fp8 conversion instructions)"
    return None


def _on_device(x):
    """The CUDA device context of a launch (none for CPU tensors under the interpreter)."""
    import torch

    return torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext()


def _as_2d(x):
    k = x.shape[-1]
    m = math.prod(x.shape[:-1])
    return x.reshape(m, k).contiguous()


def _choose(kernel: str, x, why: Callable[[], Optional[str]], what: str) -> str:
    """The path a call takes: "triton" or "reference"; refuses kernel="triton" when the kernel cannot run it.
    "auto" takes the kernel for CUDA tensors only (the interpreter is for tests: kernel="triton" on CPU)."""
    if kernel not in KERNELS:
        raise FormatInputError(f"kernel must be one of {', '.join(KERNELS)}, got {kernel!r}")
    if kernel == "reference" or (kernel == "auto" and not getattr(x, "is_cuda", False)):
        return "reference"
    reason = why()
    if reason is None:
        return "triton"
    if kernel == "triton":
        raise KernelUnavailable(f"{what}: kernel='triton' cannot run this call: {reason}")
    return "reference"


def _ran(q, path: str):
    q.kernel = path  # the report: which implementation produced these bytes
    return q


# ---- NVFP4 --------------------------------------------------------------------------------------------------------
def _why_not_nvfp4(x, axis, scope, tile_2d, global_amax) -> Optional[str]:
    reason = _why_not_device(x)
    if reason:
        return reason
    if axis not in ("row", "col") or scope not in Scope.ALL:
        return f"axis {axis!r} / scope {scope!r}"
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if k % 16 or ((tile_2d or axis == "col") and m % 16):
        return f"shape {tuple(x.shape)} does not divide into 16-element blocks"
    if tile_2d and scope == Scope.PER_TOKEN:
        return "16x16 tiles with a per-token scale"
    if scope == Scope.GROUP and global_amax is None:
        return "scope 'group' without a global_amax"
    if scope == Scope.PER_TOKEN and global_amax is not None:
        return "a given per-token amax"
    if global_amax is not None:
        import torch

        if torch.as_tensor(global_amax).numel() != 1:
            return "a global_amax with more than one element"
    return None


def nvfp4_quantize(x, axis: str = "row", scope: str = Scope.TENSOR, tile_2d: bool = False, global_amax=None,
                   fmt=None, kernel: str = "auto"):
    """NVFP4 (TE >= 2.14), same contract as `precision_dsl.formats.nvfp4.quantize`."""
    from ..formats import nvfp4 as ref

    path = _choose(kernel, x, lambda: _why_not_nvfp4(x, axis, scope, tile_2d, global_amax), "nvfp4")
    if path == "reference":
        return _ran(ref.quantize(x, axis=axis, scope=scope, tile_2d=tile_2d, global_amax=global_amax, fmt=fmt), path)
    import torch

    from ..formats.base import QuantizedTensor
    from . import triton_nvfp4 as kern

    x2 = _as_2d(x)
    if axis == "col":
        x2 = x2.t().contiguous()
    with _on_device(x2):
        if scope == Scope.PER_TOKEN:
            data, scale, sdec, g = kern.row_scaled(x2)
        else:
            g_in = None if global_amax is None else torch.as_tensor(global_amax, dtype=torch.float32).to(x2.device)
            data, scale, sdec, g = kern.per_tensor(x2, g_in, tile_2d)
    return _ran(QuantizedTensor(fmt=fmt or ref.make_format(scope, tile_2d), shape=tuple(x.shape), data=data,
                                scale=scale, global_scale=sdec, global_amax=g, axis=axis, orig_dtype=x.dtype), path)


# ---- MXFP8 --------------------------------------------------------------------------------------------------------
def _why_not_mxfp8(x, element, axis, tile_2d) -> Optional[str]:
    reason = _why_not_device(x)
    if reason:
        return reason
    if tile_2d:
        return "MXFP8 32x32 tiles (the kernel writes 1x32 / 32x1 blocks)"
    if element not in ("e4m3", "e5m2") or axis not in ("row", "col"):
        return f"element {element!r} / axis {axis!r}"
    m, k = math.prod(x.shape[:-1]), x.shape[-1]
    if k % 32 or (axis == "col" and m % 32):
        return f"shape {tuple(x.shape)} does not divide into 32-element blocks"
    return None


def mxfp8_quantize(x, element: str = "e4m3", axis: str = "row", tile_2d: bool = False, fmt=None,
                   kernel: str = "auto"):
    """MXFP8 (TE rule), same contract as `precision_dsl.formats.mxfp8.quantize`."""
    from ..formats import mxfp8 as ref

    path = _choose(kernel, x, lambda: _why_not_mxfp8(x, element, axis, tile_2d), "mxfp8")
    if path == "reference":
        return _ran(ref.quantize(x, element, axis=axis, tile_2d=tile_2d, fmt=fmt), path)
    from ..formats.base import QuantizedTensor
    from . import triton_mxfp8 as kern

    x2 = _as_2d(x)
    with _on_device(x2):
        rd, rs, cd, cs = kern.quantize_rowcol(x2, element, rowwise=axis == "row", colwise=axis == "col")
    data, scale = (rd, rs) if axis == "row" else (cd, cs)
    return _ran(QuantizedTensor(fmt=fmt or ref.make_format(element), shape=tuple(x.shape), data=data, scale=scale,
                                axis=axis, orig_dtype=x.dtype), path)


def mxfp8_quantize_rowcol(x, element: str = "e4m3", kernel: str = "auto"):
    """(rowwise 1x32, columnwise 32x1) MXFP8 copies of x from one read of x (TE's layouts; data not transposed).
    Same bytes as `mxfp8.quantize(x, element, axis="row")` and `(..., axis="col")`."""
    from ..formats import mxfp8 as ref

    path = _choose(kernel, x, lambda: _why_not_mxfp8(x, element, "col", False), "mxfp8 row+col")
    if path == "reference":
        return (_ran(ref.quantize(x, element, axis="row"), path), _ran(ref.quantize(x, element, axis="col"), path))
    from ..formats.base import QuantizedTensor
    from . import triton_mxfp8 as kern

    x2 = _as_2d(x)
    with _on_device(x2):
        rd, rs, cd, cs = kern.quantize_rowcol(x2, element, True, True)
    f = ref.make_format(element)
    row = QuantizedTensor(fmt=f, shape=tuple(x.shape), data=rd, scale=rs, axis="row", orig_dtype=x.dtype)
    col = QuantizedTensor(fmt=f, shape=tuple(x.shape), data=cd, scale=cs, axis="col", orig_dtype=x.dtype)
    return _ran(row, path), _ran(col, path)


# ---- FP8 block ----------------------------------------------------------------------------------------------------
def _why_not_fp8_block(x, element, block, axis) -> Optional[str]:
    from ..formats import fp8_block as ref

    reason = _why_not_device(x)
    if reason:
        return reason
    if element not in ("e4m3", "e5m2") or block not in ref.BLOCKS or axis not in ("row", "col"):
        return f"element {element!r} / block {block} / axis {axis!r}"
    return None


def _padded_rows(x, pad_rows_to) -> tuple[int, int, int]:
    """(M, Mp, K) of x's [M, K] view zero-padded to Mp = roundup(M, pad_rows_to) rows ((0, 0, 0) for what is not a
    >= 1-D tensor: the reference refuses that with its own message)."""
    import torch

    if not isinstance(pad_rows_to, int) or isinstance(pad_rows_to, bool) or pad_rows_to < 1:
        raise FormatInputError(f"fp8_block: pad_rows_to must be a positive int, got {pad_rows_to!r}")
    if not isinstance(x, torch.Tensor) or x.dim() == 0:
        return 0, 0, 0
    m = math.prod(x.shape[:-1])
    return m, -(-m // pad_rows_to) * pad_rows_to, x.shape[-1]


def _ref_padded(x, m: int, mp: int):
    """x itself (Mp == M, also what `_padded_rows` does not pad: the reference refuses it with its own message) or its
    [M, K] view with Mp - M zero rows appended: what the padded copies quantize."""
    import torch

    if mp == m:
        return x
    x2 = x.reshape(m, x.shape[-1])
    return torch.cat([x2, x2.new_zeros(mp - m, x2.shape[1])])


def fp8_block_quantize(x, element: str = "e4m3", block=(1, 128), pow2: bool = True, axis: str = "row",
                       fmt: Optional[object] = None, kernel: str = "auto", pad_rows_to: int = 1):
    """FP8 block scaling (TE Float8BlockScaling), same contract as `precision_dsl.formats.fp8_block.quantize`.

    pad_rows_to > 1: the result is that of x's [M, K] view zero-padded to Mp = roundup(M, pad_rows_to) rows
    (byte for byte `quantize(torch.cat([x, zeros(Mp - M, K)]))`, shape (Mp, K); x itself when Mp == M); the kernel
    masks its loads instead of materialising the zeros (the wgrad operands of the fp8 backward: axis="col")."""
    from ..formats import fp8_block as ref

    block = tuple(block) if isinstance(block, (tuple, list)) else block
    m, mp, k = _padded_rows(x, pad_rows_to)
    path = _choose(kernel, x, lambda: _why_not_fp8_block(x, element, block, axis), "fp8_block")
    if path == "reference":
        return _ran(ref.quantize(_ref_padded(x, m, mp), element, block, pow2, axis=axis, fmt=fmt), path)
    from ..formats.base import QuantizedTensor
    from . import triton_fp8_block as kern

    x2 = _as_2d(x)
    with _on_device(x2):
        data, sinv = kern.quantize(x2, element, square=block == (128, 128), pow2=pow2, transpose=axis == "col",
                                   pad_rows_to=pad_rows_to)
    return _ran(QuantizedTensor(fmt=fmt or ref.make_format(element, block, pow2),
                                shape=tuple(x.shape) if mp == m else (mp, k), data=data, scale=sinv, axis=axis,
                                orig_dtype=x.dtype), path)


def fp8_block_quantize_rowcol(x, element: str = "e4m3", pow2: bool = True, pad_rows_to: int = 128,
                              fmt: Optional[object] = None, kernel: str = "auto"):
    """(rowwise, columnwise) 1x128 FP8 block copies of x from one read of x (the fp8 backward's operands):
    rowwise = fp8_block_quantize(x, element, (1, 128), pow2, axis="row") (never padded), columnwise =
    fp8_block_quantize(x, element, (1, 128), pow2, axis="col", pad_rows_to=pad_rows_to), byte for byte."""
    from ..formats import fp8_block as ref

    m, mp, k = _padded_rows(x, pad_rows_to)
    path = _choose(kernel, x, lambda: _why_not_fp8_block(x, element, (1, 128), "col"), "fp8_block row+col")
    if path == "reference":
        return (_ran(ref.quantize(x, element, (1, 128), pow2, axis="row", fmt=fmt), path),
                _ran(ref.quantize(_ref_padded(x, m, mp), element, (1, 128), pow2, axis="col", fmt=fmt), path))
    from ..formats.base import QuantizedTensor
    from . import triton_fp8_block as kern

    x2 = _as_2d(x)
    with _on_device(x2):
        rd, rs, cd, cs = kern.quantize_rowcol(x2, element, pow2=pow2, pad_rows_to=pad_rows_to)
    f = fmt or ref.make_format(element, (1, 128), pow2)
    row = QuantizedTensor(fmt=f, shape=tuple(x.shape), data=rd, scale=rs, axis="row", orig_dtype=x.dtype)
    col = QuantizedTensor(fmt=f, shape=tuple(x.shape) if mp == m else (mp, k), data=cd, scale=cs, axis="col",
                          orig_dtype=x.dtype)
    return _ran(row, path), _ran(col, path)


# ---- the one entry point ------------------------------------------------------------------------------------------
# The kernel entry of each kind that has one; each takes the reference's arguments (format_specs'
# `FormatSpec.quantizer_kwargs`, through `formats.quantizer_kwargs`) plus fmt= and kernel=.
ENTRIES = {
    FormatKind.NVFP4: nvfp4_quantize,
    FormatKind.MXFP8: mxfp8_quantize,
    FormatKind.FP8_BLOCK: fp8_block_quantize,
}


def quantize(x, fmt, *, axis: str = "row", global_amax=None, kernel: str = "auto"):
    """Quantize `x` to plan format `fmt` (contract of `precision_dsl.formats.quantize`) on the path `kernel` chooses;
    `q.kernel` of the result says which ran ("triton" | "reference")."""
    from .. import formats

    # The TensorFormat -> arguments mapping (and its validation) is the reference dispatch's, so the two can't drift.
    check_format(fmt, global_amax)
    entry = ENTRIES.get(fmt.kind)
    if entry is not None:
        return entry(x, **quantizer_kwargs(fmt, axis, global_amax), fmt=fmt, kernel=kernel)
    _choose(kernel, x, lambda: f"no Triton kernel for {fmt.short()}", fmt.short())
    return _ran(formats.quantize(x, fmt, axis=axis, global_amax=global_amax), "reference")
