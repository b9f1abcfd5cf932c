"""Compact <-> GEMM-swizzled ("128x4", cuBLAS "32_4_4") block-scale layout for MXFP8 and NVFP4.

Source: TE `gemm_swizzled_scale_idx` (common/cast/mxfp8/swizzle.cuh, common/swizzle/swizzle.cu); torchao
`to_blocked` and FlashInfer `get_sf_out_offset_128x4` produce the same byte order (golden README, 0 mismatches).

For a logical scale matrix S[R, C] (uint8), zero-pad to Rp = roundup(R, 128), Cp = roundup(C, 4) and place S[r, c]
at flat byte offset

    ((r // 128) * (Cp // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + (c % 4)

The result is returned as a [Rp, Cp] uint8 tensor whose reshape(-1) is that byte stream (the golden files' layout).
Padding bytes are 0 (TE zeroes them in swizzled mode). Which matrix is "logical S" per format/axis:
  * MXFP8 1x32 rowwise: scale [M, K/32];  MXFP8 32x1 columnwise: scale.T [K, M/32]
  * NVFP4 1x16 rowwise: scale [M, K/16];  NVFP4 1x16 colwise: scale [K, M/16] (already the scale of x.T)
(`logical_scale_for_gemm(q)` picks it from a QuantizedTensor.)
"""

from __future__ import annotations

import torch

from .base import FormatInputError, QuantizedTensor
from ..precision import FormatKind


def _roundup(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzled_shape(rows: int, cols: int) -> tuple[int, int]:
    return _roundup(rows, 128), _roundup(cols, 4)


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Compact S[R, C] -> swizzled [roundup(R,128), roundup(C,4)] (zero padding)."""
    if scale.dim() != 2:
        raise FormatInputError(f"swizzle_128x4: scale must be 2-D [R, C], got shape {tuple(scale.shape)}")
    r, c = scale.shape
    rp, cp = swizzled_shape(r, c)
    padded = scale.new_zeros((rp, cp))
    padded[:r, :c] = scale
    # r = 128a + 32b + i, c = 4j + k  ->  offset order (a, j, i, b, k)
    blocks = padded.view(rp // 128, 4, 32, cp // 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(rp, cp).contiguous()


def unswizzle_128x4(swizzled: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """Inverse of `swizzle_128x4`: swizzled bytes ([Rp, Cp] or flat) -> compact S[rows, cols]."""
    rp, cp = swizzled_shape(rows, cols)
    if swizzled.numel() != rp * cp:
        raise FormatInputError(f"unswizzle_128x4: expected {rp * cp} bytes for a [{rows}, {cols}] scale matrix "
                               f"(padded to [{rp}, {cp}]), got {swizzled.numel()}")
    blocks = swizzled.reshape(rp // 128, cp // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return blocks.reshape(rp, cp)[:rows, :cols].contiguous()


# (kind, block) -> the [R, C] scale matrix of a quantized tensor that the GEMM layout swizzles.
_GEMM_SCALE = {
    (FormatKind.MXFP8, (1, 32)): lambda q: q.scale if q.axis == "row" else q.scale.t().contiguous(),
    (FormatKind.NVFP4, (1, 16)): lambda q: q.scale,
}


def logical_scale_for_gemm(q: QuantizedTensor) -> torch.Tensor:
    """The [R, C] scale matrix that the GEMM layout swizzles, for an MXFP8 (1x32 / 32x1) or NVFP4 (1x16) tensor."""
    scale_of = _GEMM_SCALE.get((q.fmt.kind, q.fmt.block))
    if scale_of is not None:
        return scale_of(q)
    raise FormatInputError(f"swizzle: no GEMM-swizzled scale layout is defined for {q.fmt.short()} (axis={q.axis}); "
                           f"only MXFP8 1x32/32x1 and NVFP4 1x16 scales are swizzled")


def swizzled_scale(q: QuantizedTensor) -> torch.Tensor:
    return swizzle_128x4(logical_scale_for_gemm(q))
