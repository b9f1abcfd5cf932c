"""NVFP4 reference quantizer (E2M1 elements, E4M3 block scales, FP32 second-level scale), bit-exact to TE >= 2.14.

Source of truth: TransformerEngine 2.20.0.dev0 (commit d0067d0): `compute_global_encode_scaling_factor_FP4` and
`compute_decoding_scaling_factor` (common/cast/nvfp4/core_nvfp4.cuh), the NVFP4 cast kernels
(common/cast/nvfp4/quantize_transpose_nvfp4.cuh) and the Python reference
`NVFP4QuantizerRef` (transformer_engine/pytorch/custom_recipes/reference_nvfp4.py), which produced the golden
vectors ../shared/golden/quantizers/nvfp4__*. FlashInfer 0.6.18 `fp4_quantize` gives the same bytes only with
FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH=1 and S_enc computed as below. TE <= 2.13 used a different block-scale
formula (RN(RN(a_b/6) * S_enc)): pin TE >= 2.14.

Elements E2M1: magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) at index 0..7, code = sign << 3 | index, two codes per
byte, element 2j in the LOW nibble and element 2j+1 in the HIGH nibble.

Second-level ("global") scale scope, G = fp32 amax:
  * Scope.TENSOR: G = max|x| of the whole tensor -> global_amax/global_scale shape [1]
  * Scope.PER_TOKEN (the IR's "row"): G_r = max|x[r, :]| per row (= per token for activations; TE
              row_scaled_nvfp4) -> shape [rows]
  * given   : `global_amax=` (per-expert or share-scale group: pass `group_amax([gate, up])`) -> shape [1]
Tiles: 1x16 (block along K) or 16x16 (2-D weight scaling, per-tensor G only). axis="col" is the same recipe applied
to x.T (TE's columnwise copy): data [K, M/2], scale [K, M/16] (1x16) or [K/16, M/16] (16x16); per-row scope then
uses the amax of each row of x.T (= column of x).

Layouts (axis="row"; x viewed as [M, K]): data uint8 [M, K/2]; scale uint8 E4M3 bytes [M, K/16] (1x16) or
[M/16, K/16] (16x16, one byte per tile; TE repeats it over the 16 rows); global_scale = S_dec fp32;
global_amax = G fp32. Compact, unswizzled scales; `swizzle.swizzle_128x4` gives the GEMM layout.

Executable description (all fp32, RN = round-to-nearest-even, no FTZ; divisions are IEEE divisions)::

    S_enc = min(RN(2688 / G), FLT_MAX)          # 2688 = 448 * 6
    if G == 0 or S_enc == 0: S_enc = 1          # (G = inf also ends here)
    S_dec = RN(1 / S_enc)                       # what checkpoints call weight_scale_2
    for each block b (16 consecutive elements of a row, or a 16x16 tile):
        a_b  = max |x| over b
        sf_b = e4m3_rn(min(RN(a_b * RN(S_enc * RN(1/6))), 448))   # may be 0 or an E4M3 subnormal
        enc  = min(RN(1 / RN(f32(sf_b) * S_dec)), FLT_MAX)        # sf_b == 0 -> 1/0 = inf -> FLT_MAX
        y    = RN(x * enc), clamped to [-6, 6]
        idx  = E2M1 RNE of |y|: <=0.25->0, <0.75->0.5, <=1.25->1, <1.75->1.5, <=2.5->2, <3.5->3, <=5->4, else 6
               (ties to the even code: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4)
        code = idx | 8 * (y < 0)
    decode: x ~= e2m1(code) * f32(sf_b) * S_dec

Edge cases:
  * sign of zero: a negative y that rounds to 0 keeps its sign (code 8); y == -0.0 (exact -0.0 input, or a
    negative x whose product RN(x*enc) underflows to -0.0) gives code 0, as TE's Python reference (`x >= 0`).
    (torchao's hardware-emulating converter would give 8 there; Blackwell hardware is unverified.)
  * G == 0 (all-zero tensor/row): S_enc = 1, every byte 0;
  * block-scale underflow: 0 < a_b but sf_b == 0 (a_b / G below ~2e-6) -> enc = FLT_MAX, so the block's non-zero
    elements become +-6 (codes 7 / 15) next to a 0 scale byte (they dequantize to 0). TE does exactly this.
  * saturation: sf_b is clamped to 448 before the E4M3 cast; y is clamped to +-6;
  * subnormal inputs are exact (no FTZ);
  * NaN / Inf inputs are outside the bit-exact contract (TE's Python reference and its kernels disagree): here
    NaN is ignored by the amax (like the kernels) and a NaN element encodes as code 7 (+6, what the satfinite
    hardware cvt is believed to do; TE's Python reference writes 0); +-inf saturates to +-6 (G = inf -> S_enc = 1).

Shapes: K % 16 == 0 for rowwise 1x16; M % 16 == 0 as well for colwise and 16x16 (TE's NVFP4Quantizer requires both
for every tensor; this reference only requires what the asked-for copy needs). Inputs: float32 / bfloat16 /
float16, >= 1-D (flattened to [M, K]), any strides (copied), empty allowed (G = 0).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from ..precision import FP8_MAX, FormatKind, Scope, TensorFormat
from ._numerics import FLT_MAX, abs_amax, as_2d_fp32, require_divisible, rn_div
from .base import FormatInputError, QuantizedTensor

BLOCK = 16
E2M1_MAX = 6.0
E4M3_MAX = FP8_MAX["e4m3"]
GLOBAL_NUMERATOR = 2688.0  # 448 * 6 (TE; 1536 = 256 * 6 only with 4over6-256, not supported here)
# E2M1 magnitudes by index 0..7; codes 8..15 are the negatives (code 8 is -0.0).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
SCOPES = (Scope.TENSOR, Scope.PER_TOKEN)
KIND = FormatKind.NVFP4  # the format spec this module is the reference of (format_specs.SPECS)


def make_format(scope: str = Scope.TENSOR, tile_2d: bool = False) -> TensorFormat:
    return TensorFormat(kind=KIND, element="e2m1", block=(16, 16) if tile_2d else (1, 16),
                        scale_dtype="e4m3", global_scale=scope)  # type: ignore[arg-type]


def global_encode_scale(amax: torch.Tensor) -> torch.Tensor:
    """TE `compute_global_encode_scaling_factor_FP4`: S_enc = min(RN(2688/G), FLT_MAX); G == 0 or S_enc == 0 -> 1."""
    g = amax.float()
    s_enc = rn_div(GLOBAL_NUMERATOR, g).clamp(max=FLT_MAX)
    return torch.where((g == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)


def global_decode_scale(s_enc: torch.Tensor) -> torch.Tensor:
    """S_dec = RN(1 / S_enc) (the GEMM alpha factor / checkpoint `weight_scale_2`)."""
    return rn_div(1.0, s_enc)


def group_amax(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """Shared G for a share-scale group (e.g. gate+up of one expert, or all tokens of one expert's input):
    the max over the members' amax, fp32 [1]. Pass it as `global_amax=` to quantize every member."""
    if len(tensors) == 0:
        raise FormatInputError("nvfp4.group_amax: needs at least one tensor")
    amaxes = []
    for i, t in enumerate(tensors):
        x2, _ = as_2d_fp32(t, f"nvfp4.group_amax: member {i}")
        amaxes.append(abs_amax(x2) if x2.numel() else torch.zeros((), device=x2.device))
    return torch.stack([a.to(amaxes[0].device) for a in amaxes]).amax().reshape(1)


def _block_scale_and_enc(amax_b: torch.Tensor, s_enc: torch.Tensor, s_dec: torch.Tensor):
    """(sf fp8-e4m3 tensor, enc fp32) for block amaxes broadcastable against s_enc / s_dec."""
    rcp6 = rn_div(1.0, torch.full((), 6.0, dtype=torch.float32, device=amax_b.device))  # 0x3E2AAAAB
    mul = s_enc * rcp6
    sf = (amax_b * mul).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    enc = rn_div(1.0, sf.float() * s_dec).clamp(max=FLT_MAX)
    return sf, enc


def e2m1_round(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """E2M1 round-to-nearest-even of fp32 y, saturating at 6: returns (|value| on the grid
    {0, .5, 1, 1.5, 2, 3, 4, 6} as fp32, negative mask y < 0).

    Vectorized with the "magic number" trick, which is ONE correctly rounded fp32 addition: for a = |y| the E2M1
    grid spacing is 0.5 on [0, 2), 1 on [2, 4) and 2 on [4, 6]; adding C = 2^22, 2^23 or 2^24 (whose fp32 ulp is
    exactly that spacing) rounds a to the grid with RNE, and subtracting C is exact. Because the grid value's parity
    equals its E2M1 mantissa parity, the ties land as specified: 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2,
    3.5->4, 5->4. C is picked from a's fp32 exponent (a < 2 -> 2^22, [2, 4) -> 2^23, >= 4 -> 2^24). NaN -> 6
    (torch.fmin ignores NaN)."""
    neg = y < 0
    a = y.abs()
    torch.fmin(a, torch.full((), E2M1_MAX, dtype=torch.float32, device=y.device), out=a)
    c_bits = (a.view(torch.int32) >> 23).clamp_(127, 129).add_(22).bitwise_left_shift_(23)
    magic = c_bits.view(torch.float32)
    return a.add_(magic).sub_(magic), neg


def e2m1_codes(r: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """uint8 codes (sign << 3 | index) from `e2m1_round`'s output. For r >= 1 the index is the fp32 exponent and
    top mantissa bit: (bits >> 22) - 252 (1 -> 2, 1.5 -> 3, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7); 0 -> 0, 0.5 -> 1."""
    idx = ((r.view(torch.int32) >> 22) - 252).clamp_(min=0) + (r == 0.5).to(torch.int32)
    return idx.to(torch.uint8) | (neg.to(torch.uint8) << 3)


def _pack(codes: torch.Tensor) -> torch.Tensor:
    """[R, C] codes -> [R, C/2] bytes, even element in the low nibble."""
    pairs = codes.reshape(codes.shape[0], codes.shape[1] // 2, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def _unpack(data: torch.Tensor) -> torch.Tensor:
    lo = data & 0x0F
    hi = data >> 4
    return torch.stack([lo, hi], dim=-1).reshape(data.shape[0], data.shape[1] * 2)


def _codes_to_f32(codes: torch.Tensor) -> torch.Tensor:
    lut = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=codes.device)
    return lut[codes.long()]


def _resolve_scope(scope: str, global_amax) -> str:
    if scope not in Scope.ALL:
        raise FormatInputError(f"nvfp4: scope must be one of {' | '.join(Scope.ALL)}, got {scope!r}")
    if scope == Scope.GROUP and global_amax is None:
        raise FormatInputError("nvfp4: scope 'group' needs global_amax=group_amax([member tensors]) so that every "
                               "member of the share-scale group gets the same S_dec")
    return scope


def _given_global_amax(global_amax, scope: str, rows: int, device, what: str) -> Optional[torch.Tensor]:
    """Validated fp32 G from the caller ([1], or [rows] for per-row scope), or None."""
    if global_amax is None:
        return None
    g = torch.as_tensor(global_amax, dtype=torch.float32).to(device)
    if bool((torch.isnan(g) | (g < 0)).any()):
        raise FormatInputError(f"{what}: global_amax must be >= 0 and not NaN (it is a max |x|), got "
                               f"{g.flatten()[:4].tolist()}")
    if g.numel() == 1:
        return g.reshape(1)
    if scope == Scope.PER_TOKEN and g.shape == (rows,):
        return g.reshape(rows)
    raise FormatInputError(f"{what}: global_amax must have 1 element (or [rows]={rows} for per-row scope), "
                           f"got shape {tuple(g.shape)}")


def _quantize_matrix(m2: torch.Tensor, scope: str, g: Optional[torch.Tensor], tile_2d: bool):
    """Quantize fp32 [R, C] along C (blocks of 16 or 16x16 tiles). G is `g` if given, else the max of the block
    amaxes per row (scope PER_TOKEN) or over the tensor (== max |x|, one pass saved).
    Returns (r, neg, sf, s_dec, G): E2M1 magnitudes and signs in the blocked view, the E4M3 block scales (fp8
    tensor, blocked view), S_dec and G ([1] or [R])."""
    r, c = m2.shape
    if tile_2d:
        blocks = m2.view(r // BLOCK, BLOCK, c // BLOCK, BLOCK)
        amax_b = abs_amax(blocks, dim=(1, 3), keepdim=True)  # [R/16, 1, C/16, 1]; per-tensor G only
    else:
        blocks = m2.view(r, c // BLOCK, BLOCK)
        amax_b = abs_amax(blocks, dim=2, keepdim=True)  # [R, C/16, 1]
    if g is None:
        if scope == Scope.PER_TOKEN:
            g = amax_b.reshape(r, c // BLOCK).amax(dim=1) if r and c else torch.zeros(r, device=m2.device)
        else:
            g = amax_b.amax().reshape(1) if amax_b.numel() else torch.zeros(1, device=m2.device)
    s_enc = global_encode_scale(g)
    s_dec = global_decode_scale(s_enc)
    if tile_2d:
        sf, enc = _block_scale_and_enc(amax_b, s_enc, s_dec)
    else:
        sf, enc = _block_scale_and_enc(amax_b, s_enc.view(-1, 1, 1), s_dec.view(-1, 1, 1))
    mag, neg = e2m1_round(blocks * enc)
    return mag, neg, sf, s_dec, g


def _scale_2d(sf: torch.Tensor, r: int, c: int, tile_2d: bool) -> torch.Tensor:
    return sf.reshape(r // BLOCK, c // BLOCK) if tile_2d else sf.reshape(r, c // BLOCK)


def _prepare(x, axis: str, tile_2d: bool, scope: str, global_amax, what: str):
    if axis not in ("row", "col"):
        raise FormatInputError(f"{what}: axis must be 'row' or 'col', got {axis!r}")
    scope = _resolve_scope(scope, global_amax)
    if tile_2d and scope == Scope.PER_TOKEN:
        raise FormatInputError(f"{what}: 16x16 tiles need a per-tensor global scale (TE: row-scaled NVFP4 is "
                               f"incompatible with 2D quantization); use scope='tensor' or 1x16 blocks")
    x2, shape = as_2d_fp32(x, what)
    m, k = x2.shape
    hint = ("pad it with zeros to a multiple of 16 (TE's NVFP4Quantizer requires M % 16 == 0 and K % 16 == 0) or "
            "give this tensor a non-NVFP4 format")
    if tile_2d or axis == "row":
        require_divisible(what, "K (last dim)", k, BLOCK, hint)
    if tile_2d or axis == "col":
        require_divisible(what, "M (product of leading dims)", m, BLOCK, hint)
    m2 = x2 if axis == "row" else x2.t().contiguous()
    g = _given_global_amax(global_amax, scope, m2.shape[0], m2.device, what)
    return m2, shape, g, scope


def quantize(x: torch.Tensor, axis: str = "row", scope: str = Scope.TENSOR, tile_2d: bool = False,
             global_amax: Optional[torch.Tensor | float] = None,
             fmt: Optional[TensorFormat] = None) -> QuantizedTensor:
    """Quantize `x` to NVFP4 exactly as TE >= 2.14 (see module docstring).

    scope: a `Scope` value: TENSOR | PER_TOKEN | EXPERT | GROUP (EXPERT / GROUP = per tensor, with G normally given
    via `global_amax`; GROUP requires it). global_amax: overrides G (1 element; or [rows] with PER_TOKEN)."""
    what = f"nvfp4 {'16x16' if tile_2d else '1x16'} {scope} (axis={axis})"
    m2, shape, g, scope = _prepare(x, axis, tile_2d, scope, global_amax, what)
    mag, neg, sf, s_dec, g = _quantize_matrix(m2, scope, g, tile_2d)
    codes = e2m1_codes(mag, neg).reshape(m2.shape)
    return QuantizedTensor(fmt=fmt or make_format(scope, tile_2d), shape=shape, data=_pack(codes),
                           scale=_scale_2d(sf, *m2.shape, tile_2d).view(torch.uint8).contiguous(),
                           global_scale=s_dec, global_amax=g, axis=axis, orig_dtype=x.dtype)


def _decode_matrix(vals: torch.Tensor, sf: torch.Tensor, s_dec: torch.Tensor, tile_2d: bool) -> torch.Tensor:
    """signed E2M1 values [R, C] (fp32) * f32(sf) * S_dec, in this order (the first product is exact)."""
    r, c = vals.shape
    sff = sf.float()
    if tile_2d:
        out = vals.view(r // BLOCK, BLOCK, c // BLOCK, BLOCK) * sff.view(r // BLOCK, 1, c // BLOCK, 1) * s_dec
    else:
        out = vals.view(r, c // BLOCK, BLOCK) * sff.view(r, c // BLOCK, 1) * s_dec.view(-1, 1, 1)
    return out.reshape(r, c)


def dequantize(q: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x ~= e2m1(code) * f32(sf) * S_dec (fp32: the first product is exact, one rounding for the second),
    returned in `dtype`, original shape and orientation (axis="col" is transposed back)."""
    tile_2d = q.fmt.block == (16, 16)
    vals = _codes_to_f32(_unpack(q.data))
    out = _decode_matrix(vals, q.scale.view(torch.float8_e4m3fn), q.global_scale, tile_2d)
    if q.axis == "col":
        out = out.t()
    return out.reshape(q.shape).to(dtype)


def fake_quantize(x: torch.Tensor, axis: str = "row", scope: str = Scope.TENSOR, tile_2d: bool = False,
                  global_amax: Optional[torch.Tensor | float] = None,
                  out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """dequantize(quantize(x)) in `out_dtype` (default x.dtype), same bits, without nibble packing."""
    what = f"nvfp4 fake_quantize {'16x16' if tile_2d else '1x16'} {scope} (axis={axis})"
    m2, shape, g, scope = _prepare(x, axis, tile_2d, scope, global_amax, what)
    mag, neg, sf, s_dec, _ = _quantize_matrix(m2, scope, g, tile_2d)
    vals = torch.where(neg, -mag, mag).reshape(m2.shape)  # -0.0 for code 8, like the LUT
    out = _decode_matrix(vals, _scale_2d(sf, *m2.shape, tile_2d), s_dec, tile_2d)
    if axis == "col":
        out = out.t()
    return out.reshape(shape).to(out_dtype or x.dtype)
