"""Emulated low-precision GEMMs: what trainer and rollout run when native MXFP8 / NVFP4 / FP8 kernels are absent
(CPU, and Hopper for MXFP8/NVFP4: TE 2.20.2 transformer_engine/pytorch/quantization.py `_compute_mxfp8_support` /
`_compute_nvfp4_support` require compute capability 10.0).

    y = fake_quantize(x, act_fmt) @ dequantize(weight_q).T + bias

Both operands are the EXACT decoded values of the quantized bytes (weights: the stored QuantizedTensor;
activations: quantized on the fly with the activation format, per-token scales for Scope.PER_TOKEN).
The matmul runs in `compute_dtype` (fp32 by default: the decoded MXFP8/NVFP4 values are exact in fp32, so the
only rounding is the fp32 accumulation; with bf16 the NVFP4 operands are rounded once more, S_dec being arbitrary).
A native block-scaled tensor-core GEMM accumulates in fp32 in a different order, so emulated and native outputs
agree to fp32 accumulation error, not bitwise.
"""

from __future__ import annotations

from typing import Optional

import torch

from ..precision import TensorFormat
from .base import FormatInputError, QuantizedTensor


def emulated_linear(x: torch.Tensor, weight_q: QuantizedTensor | torch.Tensor, act_fmt: TensorFormat,
                    bias: Optional[torch.Tensor] = None, out_dtype: Optional[torch.dtype] = None, *,
                    compute_dtype: torch.dtype = torch.float32,
                    act_global_amax: Optional[torch.Tensor] = None) -> torch.Tensor:
    """F.linear with a quantized weight [N, K] (rowwise, blocks along K) and activations x [..., K] quantized in
    `act_fmt` (identity for bf16/fp16/fp32). `act_global_amax`: NVFP4 activation G override (per-expert scope).
    Returns [..., N] in `out_dtype` (default x.dtype). A plain tensor weight is used as is (high precision)."""
    from . import dequantize, fake_quantize  # late import: package __init__ imports this module's siblings

    if isinstance(weight_q, QuantizedTensor):
        if weight_q.axis != "row":
            raise FormatInputError("emulated_linear: the weight must be the rowwise copy (axis='row', blocks along "
                                   "K); got a columnwise QuantizedTensor")
        w = dequantize(weight_q, compute_dtype)
    elif isinstance(weight_q, torch.Tensor):
        w = weight_q.to(compute_dtype)
    else:
        raise FormatInputError(f"emulated_linear: weight must be a QuantizedTensor or a tensor, "
                               f"got {type(weight_q).__name__}")
    if w.dim() != 2:
        raise FormatInputError(f"emulated_linear: weight must be 2-D [N, K], got shape {tuple(w.shape)}")
    if x.shape[-1] != w.shape[1]:
        raise FormatInputError(f"emulated_linear: x last dim {x.shape[-1]} != weight K {w.shape[1]} "
                               f"(weight shape {tuple(w.shape)})")
    xq = fake_quantize(x, act_fmt, axis="row", global_amax=act_global_amax, out_dtype=compute_dtype)
    y = torch.matmul(xq, w.t())
    if bias is not None:
        y = y + bias.to(compute_dtype)
    return y.to(out_dtype or x.dtype)
