"""The engine's one seam to the reference quantizers (precision_dsl.formats): format dispatch on a TensorFormat.

Everything the engine quantizes (trainer weights/activations/gradients, weight-update payloads, rollout activations)
goes through `quantize` / `dequantize` / `fake_quantize` here, so trainer and rollout use the same bit-exact
references (TE >= 2.14 rules, see formats/mxfp8.py and formats/nvfp4.py). Formats are emulated: quantize ->
dequantize -> FP32 GEMM (no MXFP8/NVFP4 tensor cores on CPU / Hopper).
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import FormatKind, TensorFormat


class EngineFormatError(ValueError):
    """A plan asks the embedded engine for a format it cannot emulate (message names the tensor + a hint)."""


def _hp_dtype(fmt: TensorFormat) -> torch.dtype:
    return {FormatKind.BF16: torch.bfloat16, FormatKind.FP16: torch.float16, FormatKind.FP32: torch.float32}[fmt.kind]


def round_hp(x: torch.Tensor, fmt: TensorFormat) -> torch.Tensor:
    """Round to a high-precision storage format (bf16/fp16/fp32) and back to fp32."""
    return x.to(_hp_dtype(fmt)).to(torch.float32)


def _scope(fmt: TensorFormat) -> str:
    return fmt.global_scale or "tensor"


def _pad_rows(x2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """Zero-pad rows to a multiple (zeros never raise a block amax, so padded blocks quantize like TE's padded
    buffers); returns (padded, original rows)."""
    m = x2.shape[0]
    pad = (-m) % multiple
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])], 0)
    return x2, m


def quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row", global_amax=None, what: str = ""):
    """QuantizedTensor of `x` in `fmt` (weights and payloads: the bytes are what trainer and rollout compare)."""
    from ..formats import mxfp8, nvfp4

    if fmt.kind == FormatKind.MXFP8:
        return mxfp8.quantize(x, element=fmt.element, axis=axis, tile_2d=fmt.block == (32, 32), fmt=fmt)
    if fmt.kind == FormatKind.NVFP4:
        return nvfp4.quantize(x, axis=axis, scope=_scope(fmt), tile_2d=fmt.block == (16, 16),
                              global_amax=global_amax, fmt=fmt)
    raise EngineFormatError(f"{what or 'tensor'}: format {fmt.short()} is not emulated by the embedded engine yet "
                            "(hint: use an mxfp8 / nvfp4 / bf16 policy, or --engine miles)")


def dequantize(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from ..formats import mxfp8, nvfp4

    if q.fmt.kind == FormatKind.MXFP8:
        return mxfp8.dequantize(q, dtype)
    if q.fmt.kind == FormatKind.NVFP4:
        return nvfp4.dequantize(q, dtype)
    raise EngineFormatError(f"cannot dequantize format {q.fmt.short()}")


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row", global_amax=None,
                  what: str = "") -> torch.Tensor:
    """dequantize(quantize(x)) as fp32 [same shape]; high-precision formats just round. axis="col" zero-pads M to
    the block size (wgrad operands have arbitrary token counts)."""
    if not fmt.is_quantized:
        return round_hp(x, fmt)
    from ..formats import mxfp8, nvfp4

    shape = x.shape
    x2 = x.reshape(-1, shape[-1]).float()
    m = x2.shape[0]
    if fmt.kind == FormatKind.MXFP8:
        if axis == "col" or fmt.block == (32, 32):
            x2, m = _pad_rows(x2, 32)
        out = mxfp8.fake_quantize(x2, element=fmt.element, axis=axis, tile_2d=fmt.block == (32, 32))
    elif fmt.kind == FormatKind.NVFP4:
        if axis == "col" or fmt.block == (16, 16):
            x2, m = _pad_rows(x2, 16)
        out = nvfp4.fake_quantize(x2, axis=axis, scope=_scope(fmt), tile_2d=fmt.block == (16, 16),
                                  global_amax=global_amax)
    else:
        raise EngineFormatError(f"{what or 'tensor'}: format {fmt.short()} is not emulated by the embedded engine "
                                "yet (hint: use an mxfp8 / nvfp4 / bf16 policy, or --engine miles)")
    return out[:m].reshape(shape)


def group_amax(tensors) -> torch.Tensor:
    from ..formats import nvfp4

    return nvfp4.group_amax(list(tensors))


def payload_tensors(q) -> dict[str, torch.Tensor]:
    return q.tensors()


def optional_amax(x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
    return None if x is None else x.detach().abs().amax().float().reshape(1)
