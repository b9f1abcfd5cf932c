"""The rollout engine's own activation quantizers: a second implementation, written from the golden set's spec text
(../shared/golden/quantizers/README.md, "Semantics", TE >= 2.14 rules), sharing no code with precision_dsl.formats.

Real RL stacks quantize rollout activations with the inference engine's kernels (FlashInfer / SGLang), not with
the trainer's (TransformerEngine); the two are aligned byte for byte by testing, not by sharing code. This module is
that second implementation: fp32 bit arithmetic for the E8M0 exponent, a comparison-count E2M1 coder, torch's own
RNE float8 casts after an explicit satfinite clamp. `tests/test_rollout_numerics.py` checks it byte for byte
against every activation-relevant variant of the golden vectors (1x32 / 32x1 MXFP8, 1x16 NVFP4 per row and per
tensor, 1x128 / 128x128 FP8 block), rowwise and columnwise.

Every function takes a 2-D tensor [M, K] (bf16 or fp32, upcast exactly) and quantizes blocks along K; columnwise
copies are the same call on x.T. Results are plain tensors (bytes + scales), not formats.QuantizedTensor.
"""

from __future__ import annotations

import torch

FLT_MAX = 3.4028234663852886e38
BF16_MAX = 3.3895313892515355e38
FMAX = {"e4m3": 448.0, "e5m2": 57344.0}
F8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _f32(v: float, device) -> torch.Tensor:
    return torch.tensor(v, dtype=torch.float32, device=device)


def _blocks(x: torch.Tensor, size: int) -> torch.Tensor:
    """[M, K] -> [M, K/size, size] (K must be a multiple of size)."""
    m, k = x.shape
    if k % size:
        raise ValueError(f"K={k} is not a multiple of the block size {size}")
    return x.reshape(m, k // size, size)


def _nan_free_abs(x: torch.Tensor) -> torch.Tensor:
    a = x.abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


def _fp8_bytes(v: torch.Tensor, element: str) -> torch.Tensor:
    """RNE cast of fp32 values to fp8 with saturation of finite overflow and of +-inf ('satfinite'); NaN -> 0x7F."""
    fmax = FMAX[element]
    nan = torch.isnan(v)
    q = v.clamp(-fmax, fmax).to(F8[element]).view(torch.uint8)
    return torch.where(nan, torch.full_like(q, 0x7F), q)


# ---------------------------------------------------------------------------------------------------------------
# MXFP8: E8M0 block exponent, 1x32 blocks
# ---------------------------------------------------------------------------------------------------------------
def e8m0_from_amax(amax: torch.Tensor, element: str) -> torch.Tensor:
    """Spec step 1-2: d = RN(amax * RN(1/Fmax)); E = 'round up, saturate finite' of d's exponent. int32."""
    d = amax.float() * (_f32(1.0, amax.device) / _f32(FMAX[element], amax.device))
    bits = d.view(torch.int32)
    exp = (bits >> 23) & 0xFF
    man = bits & 0x7FFFFF
    e = torch.where(exp == 0, (man > 0x400000).to(torch.int32), exp + (man != 0).to(torch.int32))
    e = torch.where(exp >= 254, torch.full_like(e, 254), e)  # exponent 254 stays; inf (255) saturates to 254
    e = torch.where(d == 0, torch.zeros_like(e), e)
    return torch.where(torch.isnan(d), torch.full_like(e, 255), e)


def pow2_from_e8m0(e: torch.Tensor, negate: bool) -> torch.Tensor:
    """2^(E-127) (negate=False) or 2^(127-E) (negate=True) as fp32, built from bits (2^-127 is a subnormal)."""
    p = (127 - e) if negate else (e - 127)
    bits = torch.where(p >= -126, (p + 127) << 23, torch.full_like(p, 0x00400000) >> (-127 - p).clamp(min=0))
    return bits.to(torch.int32).view(torch.float32)


def mxfp8(x: torch.Tensor, element: str = "e4m3") -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [M, K], scale uint8 E8M0 [M, K/32])."""
    xb = _blocks(x.float(), 32)
    e = e8m0_from_amax(_nan_free_abs(xb).amax(-1), element)
    q = _fp8_bytes(xb * pow2_from_e8m0(e, negate=True)[..., None], element)
    return q.reshape(x.shape), e.to(torch.uint8)


# ---------------------------------------------------------------------------------------------------------------
# NVFP4: E2M1 elements, E4M3 1x16 block scales, fp32 second-level scale per tensor or per row
# ---------------------------------------------------------------------------------------------------------------
def nvfp4_global(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Spec step 2: (S_enc, S_dec) from G (any shape)."""
    g = amax.float()
    s_enc = torch.minimum(_f32(2688.0, g.device) / g, _f32(FLT_MAX, g.device))
    s_enc = torch.where((g == 0) | (s_enc == 0), torch.ones_like(s_enc), s_enc)
    return s_enc, _f32(1.0, g.device) / s_enc


# E2M1 decision points in ascending order; True: crossed when |y| > t (a tie rounds down to the even code),
# False: when |y| >= t (a tie rounds up to the even code)
_E2M1_DECISIONS = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False), (5.0, True))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """E2M1 round-to-nearest-even by counting crossed decision points (ties to the even code); sign = y < 0.
    Counted in uint8 (the count is at most 7): a quarter of the memory traffic of int32 counts."""
    a = y.abs()
    idx = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for t, strict in _E2M1_DECISIONS:
        idx += (a > t) if strict else (a >= t)
    return idx | ((y < 0).to(torch.uint8) << 3)


def nvfp4(x: torch.Tensor, per_token: bool, global_amax: torch.Tensor | None = None
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data uint8 [M, K/2], scale uint8 E4M3 [M, K/16], G fp32 ([M] or [1]), S_dec fp32 (same shape))."""
    xf = x.float()
    xb = _blocks(xf, 16)
    amax_b = xb.abs().amax(-1)  # [M, K/16]; the max of a row's (the tensor's) block maxima is its max |x|
    if global_amax is not None:
        g = global_amax.float().reshape(-1)
    elif per_token:  # one second-level scale per row = per token
        g = amax_b.amax(-1) if amax_b.shape[1] else xf.abs().amax(-1)
    else:
        g = amax_b.amax().reshape(1) if amax_b.numel() else xf.abs().amax().reshape(1)
    s_enc, s_dec = nvfp4_global(g)
    col = (lambda t: t[:, None]) if g.numel() > 1 else (lambda t: t.reshape(1, 1))
    sixth = _f32(1.0, x.device) / _f32(6.0, x.device)
    block_mul = col(s_enc * sixth)  # RN(S_enc * RN(1/6))
    sf = torch.minimum(amax_b * block_mul, _f32(448.0, x.device)).to(torch.float8_e4m3fn)
    enc = torch.minimum(_f32(1.0, x.device) / (sf.float() * col(s_dec)), _f32(FLT_MAX, x.device))
    y = (xb * enc[..., None]).clamp(-6.0, 6.0)
    codes = e2m1_codes(y).reshape(x.shape[0], -1)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed, sf.view(torch.uint8), g, s_dec


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Unpack [M, K/2] bytes to fp32 E2M1 values [M, K] (low nibble = even element): one lookup per byte in a
    256 x 2 table of (low, high) value pairs."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    byte = torch.arange(256, device=packed.device)
    pairs = torch.stack([table[byte & 0xF], table[byte >> 4]], dim=-1)  # [256, 2]
    return torch.nn.functional.embedding(packed.long(), pairs).reshape(packed.shape[0], -1)


# ---------------------------------------------------------------------------------------------------------------
# FP8 block (TE Float8BlockScaling / DeepSeek-V3): 1x128 or 128x128 blocks, fp32 or power-of-two scale
# ---------------------------------------------------------------------------------------------------------------
def fp8_block(x: torch.Tensor, element: str = "e4m3", block: tuple[int, int] = (1, 128), pow2: bool = True
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(data uint8 [M, K], scale_inv fp32 [ceil(M/br), ceil(K/bc)]); partial blocks use their valid elements."""
    m, k = x.shape
    br, bc = block
    input_max = BF16_MAX if x.dtype == torch.bfloat16 else FLT_MAX
    xf = x.float()
    mp, kp = -(-m // br) * br, -(-k // bc) * bc
    padded = torch.zeros(mp, kp, dtype=torch.float32, device=x.device)
    padded[:m, :k] = xf
    tiles = padded.reshape(mp // br, br, kp // bc, bc)
    amax = _nan_free_abs(tiles).amax(dim=(1, 3))
    scale = _f32(FMAX[element], x.device) / amax
    scale = torch.where(torch.isinf(scale), _f32(input_max, x.device), scale)
    scale = torch.where((amax == 0) | torch.isnan(amax), torch.ones_like(scale), scale)
    if pow2:
        scale = (scale.view(torch.int32) & torch.tensor(-8388608, dtype=torch.int32, device=x.device)
                 ).view(torch.float32)  # 0xFF800000: sign + exponent bits
    scale_inv = _f32(1.0, x.device) / scale
    full = scale.repeat_interleave(br, 0).repeat_interleave(bc, 1)[:m, :k]
    return _fp8_bytes(xf * full, element), scale_inv
