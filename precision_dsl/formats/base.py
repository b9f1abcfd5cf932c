"""Common container for quantized tensors and the format-generic entry points.

Every format module (`mxfp8`, `nvfp4`, `fp8_block`, `fp8_tensor`) implements

    quantize(x, ...) -> QuantizedTensor          # packed bytes + scales, bit-exact to TransformerEngine
    dequantize(q, dtype=torch.float32) -> Tensor

and `precision_dsl.formats` (the package's `__init__`) dispatches on a `TensorFormat` (the plan IR's vocabulary):

    quantize(x, fmt, *, axis="row", global_amax=None) -> QuantizedTensor
    dequantize(q, dtype=torch.float32) -> Tensor
    fake_quantize(x, fmt, **kw) -> Tensor          # dequantize(quantize(x)) in x.dtype

Conventions (all formats):
  * `x` is viewed as 2-D [M, K] with M = prod(shape[:-1]); K is the contraction (last) dim.
  * `axis="row"` quantizes blocks along K (the forward / rowwise copy); `axis="col"` blocks along M
    (the columnwise copy used by wgrad/dgrad). Data layout per format is documented in its module.
  * `global_amax` (NVFP4 only) overrides the amax used for the second-level scale: the share-scale
    group passes max(amax of all members) here; per-row scope passes nothing (computed per row).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ..format_specs import FormatInputError  # noqa: F401  (raised by the format specs' argument mapping too)
from ..precision import TensorFormat


@dataclass
class QuantizedTensor:
    fmt: TensorFormat
    shape: tuple[int, ...]  # original (logical) shape of x
    data: torch.Tensor  # uint8 bytes (fp8 bytes, or two E2M1 codes per byte)
    scale: Optional[torch.Tensor]  # block scales: uint8 (E8M0 / E4M3 bytes) or float32 scale_inv (fp8 block / tensor)
    global_scale: Optional[torch.Tensor] = None  # NVFP4 S_dec (fp32; [1] per tensor or [M] per row)
    global_amax: Optional[torch.Tensor] = None  # NVFP4 G used to derive S_enc/S_dec
    axis: str = "row"  # "row" | "col"
    orig_dtype: torch.dtype = torch.bfloat16
    kernel: str = "reference"  # which implementation produced the bytes: "reference" | "triton" (kernels.quantize)

    @property
    def nbytes(self) -> int:
        n = self.data.numel() * self.data.element_size()
        for t in (self.scale, self.global_scale):
            if t is not None:
                n += t.numel() * t.element_size()
        return n

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors, by role name (data / scale / global_scale), for byte comparisons and transport."""
        out = {"data": self.data}
        if self.scale is not None:
            out["scale"] = self.scale
        if self.global_scale is not None:
            out["global_scale"] = self.global_scale
        return out
