"""The engine's one seam to the reference quantizers (precision_dsl.formats): format dispatch on a TensorFormat.

Everything the engine quantizes (trainer weights/activations/gradients, weight-update payloads, rollout activations)
goes through `quantize` / `dequantize` / `fake_quantize` here, so trainer and rollout use the same bit-exact
references (TE >= 2.14 rules, see formats/mxfp8.py and formats/nvfp4.py). Formats are emulated: quantize ->
dequantize -> FP32 GEMM (no MXFP8/NVFP4 tensor cores on CPU / Hopper).
"""

from __future__ import annotations

import torch

from .. import formats, kernels
from ..precision import TensorFormat, is_per_token
from ..errors import PolicycError


class EngineFormatError(PolicycError, ValueError):
    """A plan asks the embedded engine for a format it cannot emulate (message names the tensor + a hint)."""


def round_hp(x: torch.Tensor, fmt: TensorFormat) -> torch.Tensor:
    """Round to a high-precision storage format (bf16/fp16/fp32) and back to fp32."""
    return x.to(formats.torch_dtype(fmt)).to(torch.float32)


def _pad_rows(x2: torch.Tensor, multiple: int) -> tuple[torch.Tensor, int]:
    """Zero-pad rows to a multiple (zeros never raise a block amax, so padded blocks quantize like TE's padded
    buffers); returns (padded, original rows)."""
    m = x2.shape[0]
    pad = (-m) % multiple
    if pad:
        x2 = torch.cat([x2, x2.new_zeros(pad, x2.shape[1])], 0)
    return x2, m


def _block_rows(fmt: TensorFormat, axis: str) -> int:
    """Rows a block spans over the [M, K] view (columnwise copies and 2-D tiles need M % that == 0)."""
    return fmt.spec.block_rows(fmt, axis)


def quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row", global_amax=None, what: str = ""):
    """QuantizedTensor of `x` in `fmt` (weights and payloads: the bytes are what trainer and rollout compare)."""
    try:  # the fused Triton kernel for CUDA tensors, the reference otherwise: the same bytes either way
        return kernels.quantize(x, fmt, axis=axis, global_amax=global_amax)
    except formats.FormatInputError as e:
        raise EngineFormatError(f"{what or 'tensor'}: {e}") from None


def dequantize(q, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return formats.dequantize(q, dtype)


def fake_quantize(x: torch.Tensor, fmt: TensorFormat, *, axis: str = "row", global_amax=None,
                  what: str = "") -> torch.Tensor:
    """dequantize(quantize(x)) as fp32, same shape; high-precision formats just round. Operands whose token count
    is not a multiple of the block height (columnwise wgrad copies, expert batches) are zero-padded first: zeros
    never raise a block amax, so the real rows quantize exactly as in TE's padded buffers. A bf16 `x` is quantized
    AS bf16 (TE's in_dtype: FP8 block scaling clamps an overflowing scale to the input dtype's max; MXFP8/NVFP4
    do not depend on the input dtype) - the trainer passes its BF16 operands, as the rollout does."""
    if not fmt.is_quantized:
        return round_hp(x.float(), fmt)
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        x2 = x2.float()
    x2, m = _pad_rows(x2, _block_rows(fmt, axis))
    try:
        if x2.is_cuda:  # fused quantize kernel + dequantize: bitwise the same values as formats.fake_quantize
            out = formats.dequantize(kernels.quantize(x2, fmt, axis=axis, global_amax=global_amax), torch.float32)
        else:
            out = formats.fake_quantize(x2, fmt, axis=axis, global_amax=global_amax, out_dtype=torch.float32)
    except formats.FormatInputError as e:
        raise EngineFormatError(f"{what or 'tensor'}: {e}") from None
    return out[:m].reshape(shape)


def fake_quantize_partitioned(x: torch.Tensor, fmt: TensorFormat, parts: int, *, what: str = "") -> torch.Tensor:
    """Activation fake-quant as `parts` expert-TP ranks do it for a row-parallel GEMM: the input is split along K and
    each rank quantizes its own slice, so a per-token (row) scale is computed inside each partition (TE / FlashInfer
    behaviour). For parts == 1, or scopes that do not depend on the split, this is plain `fake_quantize`."""
    if parts <= 1 or not fmt.is_quantized or not is_per_token(fmt):
        return fake_quantize(x, fmt, what=what) if fmt.is_quantized else round_hp(x, fmt)
    k = x.shape[-1]
    if k % parts:
        raise EngineFormatError(f"{what or 'tensor'}: K={k} does not split into {parts} expert-TP partitions")
    chunks = x.split(k // parts, dim=-1)
    return torch.cat([fake_quantize(c.contiguous(), fmt, what=f"{what} (ETP shard {i})")
                      for i, c in enumerate(chunks)], dim=-1)


def group_amax(tensors) -> torch.Tensor:
    return formats.group_amax(list(tensors))
