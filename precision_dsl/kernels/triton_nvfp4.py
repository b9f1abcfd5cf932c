"""Fused NVFP4 quantize kernels (Triton, Hopper sm_90), byte-identical to precision_dsl.formats.nvfp4 (TE >= 2.14).

Kernels (all read element PAIRS as one int32 / int64 word, see _common.unpack_pair):
  * `_nvfp4_row_scaled_chunked_kernel` (default where the row is <= 8 chunks of 64 blocks) /
    `_nvfp4_row_scaled_kernel`: per-token ("row") NVFP4 in ONE pass: each program holds whole rows in registers,
    row amax -> S_enc/S_dec per row -> E4M3 block scales -> packed E2M1. Writes data [M, K/2], scale [M, K/16],
    S_dec [M] and G [M]. (`_nvfp4_row_scaled_loop_kernel`: rows too long for registers, read twice.)
  * `_amax_flat_kernel` (default) / `_amax_kernel`: per-tensor amax (NaN-ignoring) by an integer atomic max on the fp32 bit pattern (monotonic for
    non-negative floats) - the first of the two passes of per-tensor NVFP4 (skipped when `global_amax` is given,
    e.g. for a share-scale group).
  * `_nvfp4_tensor_kernel`: 1x16 or 16x16 (2-D weight tiles) quantization with one G read from device memory
    (no host synchronisation): S_enc/S_dec are derived in every program, identically. K_MAJOR picks the order in
    which programs walk the tensor (row stripes first, or a stripe's block columns first).
    L2_HINTS of both kernels (per_tensor's l2_keep): L2 eviction-priority hints so the quantize pass finds the
    tail of x the amax pass just read still in L2; they change no byte. PARTS / G_PARTS (per_tensor's
    amax_parts): per-program partial maxima reduced by the quantize kernel instead of a zero-filled atomic. PACKED
    (per_tensor's packed): block amaxes on the packed halves, as the per-token kernel takes them.
  * `_nvfp4_tile2d_rows_kernel` (default for 16x16): 4 threads a 16x16 tile, each holding 16 / SPLIT rows of
    4 * SPLIT elements, so the tile max is taken in registers plus two shuffles (SPLIT 4: 16-byte loads, 8-byte
    stores).

Numerics (see the reference's module docstring for the formulas and _common for the exactness rules):
    S_enc = min(RN(2688/G), FLT_MAX), 1 if G == 0 or S_enc == 0;  S_dec = RN(1/S_enc)
    sf = e4m3_rn(min(RN(a_b * RN(S_enc * RN(1/6))), 448));  enc = min(RN(1/RN(f32(sf) * S_dec)), FLT_MAX)
    code = E2M1_rne(clamp(RN(x * enc), -6, 6)) | 8 * (y < 0)
RN(1/v) is `rcp.rn.f32` (_common.rcp_rn: IEEE RN like div.rn.f32, fewer instructions); the E2M1 code is the low
byte of one rounding add (_common.e2m1_word). The kernels are issue-bound: `python benchmarks/sass_count.py` counts
their SASS instructions per element offline (sm_90, no GPU needed).
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from ._common import FLT_MAX, USE_RCP, e2m1_word, f32_const, rcp_rn, unpack_pair

RCP6_BITS = tl.constexpr(0x3E2AAAAB)  # RN(1/6)


@triton.jit
def _global_scales(g):
    """(S_enc, S_dec) from fp32 G (TE compute_global_encode_scaling_factor_FP4)."""
    g = tl.maximum(g, 0.0)
    s_enc = tl.minimum(tl.math.div_rn(tl.full(g.shape, 2688.0, tl.float32), g), FLT_MAX)
    s_enc = tl.where((g == 0.0) | (s_enc == 0.0), 1.0, s_enc)
    s_dec = rcp_rn(s_enc)  # RN(1/S_enc); S_enc = RN(2688/G) itself stays a division (not a reciprocal)
    return s_enc, s_dec


@triton.jit
def _block_scale(amax_b, s_enc, s_dec):
    """(E4M3 scale byte as uint8, fp32 per-block encode multiplier) for block amaxes (broadcast against s_enc)."""
    mul = s_enc * f32_const(RCP6_BITS)
    sf = tl.minimum(amax_b * mul, 448.0).to(tl.float8e4nv)
    sf_f = sf.to(tl.float32)
    enc = tl.minimum(rcp_rn(sf_f * s_dec), FLT_MAX)
    return sf.to(tl.uint8, bitcast=True), enc


@triton.jit
def _pack_codes(lo, hi, enc):
    """Two fp32 elements -> one byte (element 2j low nibble, 2j+1 high nibble). Bits 4-22 of an e2m1_word are 0
    (see there), so its low BYTE is the code and w_lo + (w_hi << 4) has the packed byte in its low 8 bits (one
    IMAD, no mask); the truncation to uint8 drops the bits above."""
    w_lo = e2m1_word(lo * enc)
    w_hi = e2m1_word(hi * enc)
    return (w_lo + (w_hi << 4)).to(tl.uint8)


@triton.jit
def _block_amax(lo, hi):
    """amax of each 16-element block (its 8 pairs on the last axis): NaN-ignoring max.f32, then max(., 0) so that an
    all-NaN block is 0."""
    return tl.maximum(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=-1), 0.0)


@triton.jit
def _encode_blocks(lo, hi, amax_b, s_enc, s_dec):
    """The block-scale step every NVFP4 kernel shares: block amax (>= 0) -> E4M3 scale with the global scale -> its
    reciprocal encode multiplier -> packed E2M1 bytes. amax_b is lo's shape without the pair axis, or broadcasts
    into it from the left (16x16 tiles: one amax per block column); s_enc / s_dec broadcast against amax_b.
    Returns (scale bytes shaped like amax_b, packed bytes shaped like lo)."""
    sf, enc = _block_scale(amax_b, s_enc, s_dec)
    return sf, _pack_codes(lo, hi, tl.expand_dims(enc, -1))


@triton.jit
def _pair_offsets(r64, stride, nb):
    """Word offsets [BM, BNB, 8] of the 8 pair words (16 elements) of blocks nb in rows r64 (int64). Row bases are
    multiples of 8 words (K % 16 == 0); the hint lets Triton use 16-byte loads and stores for any K."""
    pr = tl.arange(0, 8)
    return tl.multiple_of(r64 * stride, 8)[:, None, None] + nb[None, :, None] * 8 + pr[None, None, :]


@triton.jit
def _load_block_tile(xp_ptr, M, NB, stride_xp, IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_NB: tl.constexpr):
    """This program's tile of a (row, 16-element block) grid - program axis 0 over BLOCK_M rows, axis 1 over BLOCK_NB
    blocks - read as fp32 pairs: (lo, hi [BM, BNB, 8], rows, rows as int64, nb, row mask, block mask)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    nb = tl.program_id(1) * BLOCK_NB + tl.arange(0, BLOCK_NB)
    rmask = rows < M
    bmask = nb < NB
    r64 = rows.to(tl.int64)
    u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb), mask=rmask[:, None, None] & bmask[None, :, None], other=0)
    lo, hi = unpack_pair(u, IN_DTYPE)
    return lo, hi, rows, r64, nb, rmask, bmask


@triton.jit
def _nvfp4_row_scaled_kernel(xp_ptr, data_ptr, scale_ptr, sdec_ptr, amax_ptr, M, NB, stride_xp, stride_d,
                             stride_s, IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NB: tl.constexpr,
                             EVEN: tl.constexpr = False):
    """Per-row NVFP4. xp: [M, K/2] pair words; NB = K/16 blocks per row; BLOCK_NB >= NB (whole row per program).
    EVEN: NB == BLOCK_NB and M % BLOCK_M == 0 - no masks."""
    pid = tl.program_id(0)
    stride_xp = tl.multiple_of(stride_xp, 8)  # K/2 pair words with K % 16 == 0
    stride_d = tl.multiple_of(stride_d, 8)
    rows = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    nb = tl.arange(0, BLOCK_NB)
    rmask = rows < M
    mask3 = rmask[:, None, None] & (nb < NB)[None, :, None]
    r64 = rows.to(tl.int64)
    if EVEN:
        u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb))
    else:
        u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb), mask=mask3, other=0)
    lo, hi = unpack_pair(u, IN_DTYPE)
    amax_b = _block_amax(lo, hi)  # [BM, BNB]
    g = tl.max(amax_b, axis=1)  # [BM]
    s_enc, s_dec = _global_scales(g)
    sf, packed = _encode_blocks(lo, hi, amax_b, s_enc[:, None], s_dec[:, None])
    if EVEN:
        tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed)
        tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf)
        tl.store(sdec_ptr + rows, s_dec)
        tl.store(amax_ptr + rows, g)
    else:
        tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed, mask=mask3)
        mask2 = rmask[:, None] & (nb < NB)[None, :]
        tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf, mask=mask2)
        tl.store(sdec_ptr + rows, s_dec, mask=rmask)
        tl.store(amax_ptr + rows, g, mask=rmask)


@triton.jit
def _amax_kernel(xp_ptr, amax_bits_ptr, M, NP, stride_xp, IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_P: tl.constexpr):
    """amax_bits (int32, zero-initialised) = max over the tensor of the bit pattern of |x| (NaN ignored)."""
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask = (rows < M)[:, None] & (cols < NP)[None, :]
    u = tl.load(xp_ptr + rows.to(tl.int64)[:, None] * stride_xp + cols[None, :], mask=mask, other=0)
    lo, hi = unpack_pair(u, IN_DTYPE)
    a = tl.maximum(tl.max(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=1), axis=0), 0.0)
    tl.atomic_max(amax_bits_ptr, a.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _flat_abs_max(xp_ptr, offs, N, IN_DTYPE: tl.constexpr, EVEN: tl.constexpr, EVICT: tl.constexpr):
    """max(max |x| over the pair words at offs, 0) (NaN ignored), loaded with L2 eviction policy EVICT."""
    if EVEN:
        u = tl.load(xp_ptr + offs, eviction_policy=EVICT)
    else:
        u = tl.load(xp_ptr + offs, mask=offs < N, other=0, eviction_policy=EVICT)
    lo, hi = unpack_pair(u, IN_DTYPE)
    return tl.maximum(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=0), 0.0)


@triton.jit
def _amax_flat_kernel(xp_ptr, amax_bits_ptr, N, keep_from, IN_DTYPE: tl.constexpr, BLOCK: tl.constexpr,
                      EVEN: tl.constexpr, PDL: tl.constexpr = False, L2_HINTS: tl.constexpr = False,
                      PARTS: tl.constexpr = False, LAUNCH_NEXT: tl.constexpr = False):
    """`_amax_kernel` over a contiguous tensor viewed as N pair words: one 1-D reduction per program (in-thread,
    then one warp + one cross-warp step) instead of a row reduction followed by a column reduction.
    EVEN: N % BLOCK == 0, no masks (padding lanes would read 0, which cannot raise a max of |x| >= 0).
    PDL (launched with launch_pdl right after the accumulator's zero-fill, see tensor_amax): the kernel may start
    before that fill has finished, so it reads and reduces x first (x was complete before the fill started) and
    waits for the fill (griddepcontrol.wait) only before its atomic; it lets the next kernel launch at once.
    L2_HINTS: programs from `keep_from` on (the tensor's tail) load with the L2 evict_last policy, the ones before
    with evict_first (PTX createpolicy.fractional.L2::evict_{last,first} + ld.global.L2::cache_hint, which Triton
    emits for eviction_policy on sm_80+), so what L2 holds when the pass ends is the tail that per_tensor's
    quantize pass (REVERSE) reads first, not whatever plain LRU left of it. A hint only: the bytes are the same.
    PARTS: no accumulator and no atomic: program i stores the bit pattern of its max to amax_bits_ptr[i] (int32
    [programs], uninitialised), and the kernel that reads G reduces them (_nvfp4_tensor_kernel G_PARTS), so no
    zero-fill kernel precedes this one. It is launched plainly (its predecessor wrote x); LAUNCH_NEXT still lets
    the next kernel launch at once (PDL there waits for this one before it reads the parts).
    LAUNCH_NEXT and PDL compile only for the GPU (the interpreter has no griddepcontrol)."""
    if PDL or LAUNCH_NEXT:
        gdc_launch_dependents()
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    # each branch reduces its own load: only the scalar max leaves it (a branch that yielded the loaded words
    # would keep all of them live at the join: 70 registers instead of 32 offline, sm_90)
    if L2_HINTS:
        if pid >= keep_from:
            a = _flat_abs_max(xp_ptr, offs, N, IN_DTYPE, EVEN, "evict_last")
        else:
            a = _flat_abs_max(xp_ptr, offs, N, IN_DTYPE, EVEN, "evict_first")
    else:
        a = _flat_abs_max(xp_ptr, offs, N, IN_DTYPE, EVEN, "")
    if PARTS:
        tl.store(amax_bits_ptr + pid, a.to(tl.int32, bitcast=True))
    else:
        if PDL:
            gdc_wait()
        tl.atomic_max(amax_bits_ptr, a.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _nvfp4_tensor_kernel(xp_ptr, data_ptr, scale_ptr, g_ptr, sdec_ptr, M, NB, stride_xp, stride_d, stride_s,
                         gout_ptr, n_parts, IN_DTYPE: tl.constexpr, TILE_2D: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_NB: tl.constexpr, EVEN: tl.constexpr = False, K_MAJOR: tl.constexpr = False,
                         PDL: tl.constexpr = False, REVERSE: tl.constexpr = False,
                         L2_HINTS: tl.constexpr = False, G_PARTS: tl.constexpr = 0, PACKED: tl.constexpr = False):
    """Per-tensor NVFP4 with G read from g_ptr (fp32 [1]). Program = BLOCK_M rows x BLOCK_NB 16-element blocks.
    PDL (launched with launch_pdl right after the amax kernel that writes G, see per_tensor): the kernel may start
    while that kernel runs, so it loads its x tile and takes the block amaxes first (x is not written by it) and
    waits for it (griddepcontrol.wait: its writes are then visible) only before it reads G.
    TILE_2D: blocks are 16x16 tiles (BLOCK_M must be 16; scale is [M/16, K/16]).
    EVEN: M % BLOCK_M == 0 and NB % BLOCK_NB == 0 - no masks (no zero fill of masked lanes, no predicates).
    K_MAJOR: program axis 0 over the block columns, axis 1 over the row stripes. Programs start in axis-0-first
    order, so the ones resident at one time read a few whole row stripes (contiguous memory); with axis 0 over the
    stripes they read one narrow column strip of every row of the tensor at once.
    REVERSE: the programs walk the tensor from its end (program i takes the tile of program n - 1 - i on both axes).
    Right after the amax pass, which walks it from the start, the first tiles read are the ones that pass read
    last: those still in L2 can be read from there before later reads evict them (a forward walk of a tensor
    larger than what L2 keeps of it finds its head evicted). Measured on the H200: ~1% at 16384x7168, level at
    8192x2048 (TENSOR_REVERSE). The bytes do not depend on the order.
    L2_HINTS: x is loaded and data / scale are stored with the L2 evict_first policy: each x line is read once
    (a hit where the amax pass kept it with evict_last, see _amax_flat_kernel) and the outputs are not read again
    here, so neither should push the kept lines out before their reads. A hint only: the bytes are the same.
    G_PARTS (> 0, a power of two >= n_parts): g_ptr holds the n_parts per-program bit patterns of the amax kernel
    (_amax_flat_kernel PARTS); every program takes their integer max, clamped at 0 (the atomic max into a
    zero-filled word, exactly: a -0.0 part reads as a negative integer and loses to 0), and program 0 stores it to
    gout_ptr (int32 [1]: the G that per_tensor returns). Unused (gout_ptr, n_parts any) when G_PARTS is 0.
    PACKED (bf16 / fp16; fp32 pairs take the unpacked path): the block amaxes are taken on the packed halves
    (_words_block_amax, max.bf16x2 / max.f16x2) and the fp32 unpack of x waits until G is known, so what a program
    holds across the PDL wait is one register per pair word, not two (sm_90, 4 x 64 blocks / 2 warps: 56 registers
    instead of 93, the same instruction count, `benchmarks/sass_count.py`): more quantize programs stay resident
    beside the amax kernel's. Same bytes as the fp32 max on every input, NaN and inf included (see
    _words_block_amax). The [BM, BNB, 8] words are reduced as [BM * BNB, 8] (a register-only reshape: no layout
    conversion in the SASS) because the interpreter reduces a negative axis wrongly."""
    EVICT: tl.constexpr = "evict_first" if L2_HINTS else ""
    if K_MAJOR:
        pid_b = tl.program_id(0)
        pid_m = tl.program_id(1)
        if REVERSE:
            pid_b = tl.num_programs(0) - 1 - pid_b
            pid_m = tl.num_programs(1) - 1 - pid_m
    else:
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1)
        if REVERSE:
            pid_m = tl.num_programs(0) - 1 - pid_m
            pid_b = tl.num_programs(1) - 1 - pid_b
    stride_xp = tl.multiple_of(stride_xp, 8)  # K/2 pair words with K % 16 == 0
    stride_d = tl.multiple_of(stride_d, 8)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    nb = pid_b * BLOCK_NB + tl.arange(0, BLOCK_NB)
    r64 = rows.to(tl.int64)
    rmask = rows < M
    bmask = nb < NB
    if EVEN:
        u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb), eviction_policy=EVICT)
    else:
        u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb), mask=rmask[:, None, None] & bmask[None, :, None],
                    other=0, eviction_policy=EVICT)
    if PACKED:
        amax_b = tl.reshape(_words_block_amax(tl.reshape(u, (BLOCK_M * BLOCK_NB, 8)), IN_DTYPE, True),
                            (BLOCK_M, BLOCK_NB))
    else:
        lo, hi = unpack_pair(u, IN_DTYPE)
        amax_b = _block_amax(lo, hi)  # [BM, BNB]
    if PDL:
        gdc_wait()
    if PACKED:
        lo, hi = unpack_pair(u, IN_DTYPE)  # after the wait: only the words are held across it
    if G_PARTS:
        parts = tl.arange(0, G_PARTS)
        g_bits = tl.maximum(tl.max(tl.load(g_ptr + parts, mask=parts < n_parts, other=0), axis=0), 0)
        g = g_bits.to(tl.float32, bitcast=True)
    else:
        g = tl.load(g_ptr)
    s_enc, s_dec = _global_scales(g)
    if (pid_m == 0) & (pid_b == 0):
        tl.store(sdec_ptr, s_dec)
        if G_PARTS:
            tl.store(gout_ptr, g_bits)
    if TILE_2D:
        # the tile's amax is the max of its 16 rows' block amaxes (all >= 0, so max(., 0) needs no repeat)
        sf, packed = _encode_blocks(lo, hi, tl.max(amax_b, axis=0), s_enc, s_dec)  # sf [BNB]
        if EVEN:
            tl.store(scale_ptr + pid_m.to(tl.int64) * stride_s + nb, sf, eviction_policy=EVICT)
        else:
            tl.store(scale_ptr + pid_m.to(tl.int64) * stride_s + nb, sf, mask=bmask, eviction_policy=EVICT)
    else:
        sf, packed = _encode_blocks(lo, hi, amax_b, s_enc, s_dec)
        if EVEN:
            tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf, eviction_policy=EVICT)
        else:
            tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf, mask=rmask[:, None] & bmask[None, :],
                     eviction_policy=EVICT)
    if EVEN:
        tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed, eviction_policy=EVICT)
    else:
        tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed,
                 mask=rmask[:, None, None] & bmask[None, :, None], eviction_policy=EVICT)


@triton.jit
def _nvfp4_tile2d_rows_kernel(xp_ptr, data_ptr, scale_ptr, g_ptr, sdec_ptr, M, NB, stride_xp, stride_d, stride_s,
                              IN_DTYPE: tl.constexpr, BLOCK_NB: tl.constexpr, EVEN: tl.constexpr = False,
                              K_MAJOR: tl.constexpr = False, SPLIT: tl.constexpr = 1):
    """16x16 NVFP4 (as _nvfp4_tensor_kernel with TILE_2D) with 4 threads a tile, each holding 2 * SPLIT pair words
    (4 * SPLIT elements) of 16 / SPLIT of its rows, so the tile max is taken in registers and only a tile's 4 threads
    exchange values (two shuffles per tile, none across warps); 64 elements a thread, BLOCK_NB = 8 * num_warps.

    The tile is [4 / SPLIT, SPLIT, BLOCK_NB, 16 / SPLIT, 2 * SPLIT] = (column part, row part, block, row, word):
    the words are the contiguous axis (one 8 * SPLIT-byte load a row) and Triton's coalescing puts the threads on
    the remaining axes in axis order (triton 3.6 Coalesce: order by contiguity, ties in axis order), i.e. 4 threads
    a tile, 8 tiles a warp, warps over tiles, the rows of a row part in each thread (benchmarks/sass_count.py:
    2 shuffles per tile). SPLIT 1: 16 rows of 4 elements (8-byte loads, 2-byte stores); SPLIT 2: 8 rows of 8
    (16-byte loads, 4-byte stores): half the memory instructions and row addresses."""
    if K_MAJOR:
        pid_b = tl.program_id(0)
        pid_m = tl.program_id(1)
    else:
        pid_m = tl.program_id(0)
        pid_b = tl.program_id(1)
    stride_xp = tl.multiple_of(stride_xp, 8)
    stride_d = tl.multiple_of(stride_d, 8)
    RH: tl.constexpr = 16 // SPLIT  # rows a thread
    W: tl.constexpr = 2 * SPLIT  # pair words a thread a row
    q = tl.arange(0, 4 // SPLIT)
    h = tl.arange(0, SPLIT)
    nb = pid_b * BLOCK_NB + tl.arange(0, BLOCK_NB)
    r = tl.arange(0, RH)
    w = tl.arange(0, W)
    rows = pid_m * 16 + h[:, None] * RH + r[None, :]  # [SPLIT, RH]
    r64 = rows.to(tl.int64)
    inner = q[:, None, None, None, None] * W + nb[None, None, :, None, None] * 8 + w[None, None, None, None, :]
    x_offs = inner + tl.multiple_of(r64 * stride_xp, [8, 8])[None, :, None, :, None]
    d_offs = inner + tl.multiple_of(r64 * stride_d, [8, 8])[None, :, None, :, None]
    bmask = nb < NB
    mask5 = bmask[None, None, :, None, None] & (rows < M)[None, :, None, :, None]
    if EVEN:
        u = tl.load(xp_ptr + x_offs)
    else:
        u = tl.load(xp_ptr + x_offs, mask=mask5, other=0)
    lo, hi = unpack_pair(u, IN_DTYPE)
    g = tl.load(g_ptr)
    s_enc, s_dec = _global_scales(g)
    if (pid_m == 0) & (pid_b == 0):
        tl.store(sdec_ptr, s_dec)
    a = tl.max(tl.max(tl.maximum(tl.abs(lo), tl.abs(hi)), axis=4), axis=3)  # [4 / SPLIT, SPLIT, BNB], in-thread
    amax_t = tl.maximum(tl.max(tl.max(a, axis=1), axis=0), 0.0)  # [BNB]: max.f32 ignores NaN, all-NaN tile -> 0
    sf, enc = _block_scale(amax_t, s_enc, s_dec)
    packed = _pack_codes(lo, hi, enc[None, None, :, None, None])
    if EVEN:
        tl.store(scale_ptr + pid_m.to(tl.int64) * stride_s + nb, sf)
        tl.store(data_ptr + d_offs, packed)
    else:
        tl.store(scale_ptr + pid_m.to(tl.int64) * stride_s + nb, sf, mask=bmask)
        tl.store(data_ptr + d_offs, packed, mask=mask5)


@triton.jit
def _nvfp4_row_scaled_loop_kernel(xp_ptr, data_ptr, scale_ptr, sdec_ptr, amax_ptr, M, NB, stride_xp, stride_d,
                                  stride_s, IN_DTYPE: tl.constexpr, CHUNK_NB: tl.constexpr):
    """Per-row NVFP4, one row per program, the row read twice in CHUNK_NB-block chunks (amax pass, then the
    quantize pass mostly from L2). Variant for rows too long to keep in registers; also a tuning alternative."""
    row = tl.program_id(0).to(tl.int64)
    stride_xp = tl.multiple_of(stride_xp, 8)
    stride_d = tl.multiple_of(stride_d, 8)
    pr = tl.arange(0, 8)
    cb = tl.arange(0, CHUNK_NB)
    acc = tl.zeros([CHUNK_NB], tl.float32)
    for start in range(0, NB, CHUNK_NB):
        nb = start + cb
        m = (nb < NB)[:, None]
        u = tl.load(xp_ptr + row * stride_xp + nb[:, None] * 8 + pr[None, :], mask=m, other=0)
        lo, hi = unpack_pair(u, IN_DTYPE)
        acc = tl.maximum(acc, _block_amax(lo, hi))
    g = tl.max(acc, axis=0)
    s_enc, s_dec = _global_scales(g)
    for start in range(0, NB, CHUNK_NB):
        nb = start + cb
        bm = nb < NB
        u = tl.load(xp_ptr + row * stride_xp + nb[:, None] * 8 + pr[None, :], mask=bm[:, None], other=0)
        lo, hi = unpack_pair(u, IN_DTYPE)
        sf, packed = _encode_blocks(lo, hi, _block_amax(lo, hi), s_enc, s_dec)
        tl.store(data_ptr + row * stride_d + nb[:, None] * 8 + pr[None, :], packed, mask=bm[:, None])
        tl.store(scale_ptr + row * stride_s + nb, sf, mask=bm)
    tl.store(sdec_ptr + row, s_dec)
    tl.store(amax_ptr + row, g)


@triton.jit
def _max_half2(a, b, IN_DTYPE: tl.constexpr):
    """Lane-wise NaN-ignoring max of two words of packed bf16 / fp16 pairs whose sign bits are clear.

    Compiled: `max.bf16x2` / `max.f16x2` (PTX ISA, sm_80+), one instruction for two elements: a NaN operand yields
    the other operand, two NaNs the canonical NaN 0x7FFF. Interpreted (no PTX there), the same rule on the halves
    as integers: with the sign clear, the bit patterns order like the values, and a half above the infinity's
    pattern (0x7F80 bf16, 0x7C00 fp16) is a NaN."""
    if USE_RCP:
        if IN_DTYPE == 0:
            return tl.inline_asm_elementwise("max.bf16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                             is_pure=True, pack=1)
        else:
            return tl.inline_asm_elementwise("max.f16x2 $0, $1, $2;", "=r,r,r", [a, b], dtype=tl.int32,
                                             is_pure=True, pack=1)
    else:
        inf_bits = 0x7F80 if IN_DTYPE == 0 else 0x7C00
        a_lo, a_hi, b_lo, b_hi = a & 0xFFFF, a >> 16, b & 0xFFFF, b >> 16
        lo = tl.where(a_lo > inf_bits, tl.where(b_lo > inf_bits, 0x7FFF, b_lo),
                      tl.where(b_lo > inf_bits, a_lo, tl.maximum(a_lo, b_lo)))
        hi = tl.where(a_hi > inf_bits, tl.where(b_hi > inf_bits, 0x7FFF, b_hi),
                      tl.where(b_hi > inf_bits, a_hi, tl.maximum(a_hi, b_hi)))
        return lo | (hi << 16)


@triton.jit
def _max_bf16x2(a, b):
    return _max_half2(a, b, 0)


@triton.jit
def _max_f16x2(a, b):
    return _max_half2(a, b, 1)


@triton.jit
def _words_block_amax(u, IN_DTYPE: tl.constexpr, PACKED: tl.constexpr):
    """Block amax [CH] of pair words u [CH, 8] (2-D: triton 3.6's interpreter reduces a negative axis wrongly), equal to _block_amax(*unpack_pair(u)) on every input.

    PACKED (bf16 / fp16; fp32 pairs take the unpacked path): the max is taken on the packed halves (sign
    cleared with one AND, then _max_half2 down the block), so the fp32 unpack of the data is not needed before
    the store and the compiler keeps one register per pair word live across the row's amax instead of two (sm_90,
    K = 7168: 94 registers instead of 156, `benchmarks/sass_count.py`). abs and max are exact in any precision
    and both maxes ignore NaN, so the fp32 of the packed max is the fp32 max: an all-NaN block gives NaN there and
    0 after max(., 0), as in _block_amax."""
    if PACKED and IN_DTYPE != 2:
        a = u & 0x7FFF7FFF
        if IN_DTYPE == 0:
            m = tl.reduce(a, 1, _max_bf16x2)
        else:
            m = tl.reduce(a, 1, _max_f16x2)
        lo, hi = unpack_pair(m, IN_DTYPE)
        return tl.maximum(tl.maximum(lo, hi), 0.0)
    else:
        lo, hi = unpack_pair(u, IN_DTYPE)
        return _block_amax(lo, hi)


@triton.jit
def _load_chunk(xp_ptr, row_off, NB, C: tl.constexpr, CH: tl.constexpr, IN_DTYPE: tl.constexpr,
                EVEN: tl.constexpr = False, PACKED: tl.constexpr = False):
    """Pair words [CH, 8] of blocks [C*CH, (C+1)*CH) of one row and their block amax [CH]. EVEN: NB % CH == 0."""
    nb = C * CH + tl.arange(0, CH)
    pr = tl.arange(0, 8)
    if EVEN:
        u = tl.load(xp_ptr + row_off + nb[:, None] * 8 + pr[None, :])
    else:
        u = tl.load(xp_ptr + row_off + nb[:, None] * 8 + pr[None, :], mask=(nb < NB)[:, None], other=0)
    return u, _words_block_amax(u, IN_DTYPE, PACKED)


@triton.jit
def _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u, amax_b, s_enc, s_dec, C: tl.constexpr, CH: tl.constexpr,
                 IN_DTYPE: tl.constexpr, EVEN: tl.constexpr = False):
    nb = C * CH + tl.arange(0, CH)
    pr = tl.arange(0, 8)
    lo, hi = unpack_pair(u, IN_DTYPE)
    sf, packed = _encode_blocks(lo, hi, amax_b, s_enc, s_dec)
    if EVEN:
        tl.store(data_ptr + d_off + nb[:, None] * 8 + pr[None, :], packed)
        tl.store(scale_ptr + s_off + nb, sf)
    else:
        bm = nb < NB
        tl.store(data_ptr + d_off + nb[:, None] * 8 + pr[None, :], packed, mask=bm[:, None])
        tl.store(scale_ptr + s_off + nb, sf, mask=bm)


@triton.jit
def _nvfp4_row_scaled_chunked_kernel(xp_ptr, data_ptr, scale_ptr, sdec_ptr, amax_ptr, M, NB, stride_xp, stride_d,
                                     stride_s, IN_DTYPE: tl.constexpr, NCH: tl.constexpr, CH: tl.constexpr,
                                     EVEN: tl.constexpr = False, PACKED: tl.constexpr = False):
    """Per-row NVFP4, one row per program, the row held in registers as NCH (<= 8) chunks of CH blocks.

    For rows whose block count is not a power of two (K = 7168 -> 448 blocks = 7 x 64) the whole-row kernel pads
    to 512 blocks and wastes 1/8 of its instructions on masked lanes; here only ceil(NB/CH)*CH blocks are touched.
    Chunks are separate register tensors (unrolled with constexpr ifs), so nothing is re-read. EVEN: NB % CH == 0
    (no masks)."""
    row = tl.program_id(0).to(tl.int64)
    x_off = tl.multiple_of(row * stride_xp, 8)
    u0, a0 = _load_chunk(xp_ptr, x_off, NB, 0, CH, IN_DTYPE, EVEN, PACKED)
    acc = a0  # elementwise max over the chunks first: one cross-thread reduction per row, not one per chunk
    if NCH > 1:
        u1, a1 = _load_chunk(xp_ptr, x_off, NB, 1, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a1)
    if NCH > 2:
        u2, a2 = _load_chunk(xp_ptr, x_off, NB, 2, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a2)
    if NCH > 3:
        u3, a3 = _load_chunk(xp_ptr, x_off, NB, 3, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a3)
    if NCH > 4:
        u4, a4 = _load_chunk(xp_ptr, x_off, NB, 4, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a4)
    if NCH > 5:
        u5, a5 = _load_chunk(xp_ptr, x_off, NB, 5, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a5)
    if NCH > 6:
        u6, a6 = _load_chunk(xp_ptr, x_off, NB, 6, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a6)
    if NCH > 7:
        u7, a7 = _load_chunk(xp_ptr, x_off, NB, 7, CH, IN_DTYPE, EVEN, PACKED)
        acc = tl.maximum(acc, a7)
    g = tl.max(acc, axis=0)
    s_enc, s_dec = _global_scales(g)
    d_off = tl.multiple_of(row * stride_d, 8)
    s_off = row * stride_s
    _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u0, a0, s_enc, s_dec, 0, CH, IN_DTYPE, EVEN)
    if NCH > 1:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u1, a1, s_enc, s_dec, 1, CH, IN_DTYPE, EVEN)
    if NCH > 2:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u2, a2, s_enc, s_dec, 2, CH, IN_DTYPE, EVEN)
    if NCH > 3:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u3, a3, s_enc, s_dec, 3, CH, IN_DTYPE, EVEN)
    if NCH > 4:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u4, a4, s_enc, s_dec, 4, CH, IN_DTYPE, EVEN)
    if NCH > 5:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u5, a5, s_enc, s_dec, 5, CH, IN_DTYPE, EVEN)
    if NCH > 6:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u6, a6, s_enc, s_dec, 6, CH, IN_DTYPE, EVEN)
    if NCH > 7:
        _store_chunk(data_ptr, scale_ptr, d_off, s_off, NB, u7, a7, s_enc, s_dec, 7, CH, IN_DTYPE, EVEN)
    tl.store(sdec_ptr + row, s_dec)
    tl.store(amax_ptr + row, g)


# ----------------------------------------------------------------------------------------------- host wrappers

# Launch configs the benchmark sweeps (benchmarks/quantize.py, every one a row of its table) and the GPU tests check
# byte for byte; {} is the wrapper's default. A config is only a different tiling of the same per-block arithmetic.
# Rows the H200 sweep of session 15 ruled out (benchmarks/RESULTS.md) are not repeated: per-token block_m=4,
# chunk=32 / 1 warp, loop_chunk, chunk=64 / 4 warps; 1x16 16-row tiles; 16x16 64-tile stripes.
# packed=False: the chunked kernel's block max in fp32 (the default until session 23), 156 registers at K = 7168 (6
# programs of 2 warps an SM; capped at 128 with a 16-byte spill, 8 fit: 88% / 83% of copy in session 23's run, vs
# 95% / 87% for the packed default at 94 registers). chunk=128 / 4 warps: packed, 64 registers, 17.0 SASS / element.
ROW_CONFIGS = ({}, dict(packed=False), dict(chunk=0), dict(block_m=2, num_warps=2), dict(block_m=1, num_warps=4),
               dict(chunk=128, num_warps=4), dict(packed=False, maxnreg=128))
TENSOR_CONFIGS = ({}, dict(k_major=False), dict(block_m=8, block_nb=64, num_warps=4, k_major=False),
                  dict(block_m=8, block_nb=16, num_warps=2, k_major=False), dict(reverse=True),
                  dict(reverse=True, k_major=False), dict(l2_keep=0.25), dict(l2_keep=0.5), dict(l2_keep=0.75),
                  dict(amax_parts=True), dict(amax_parts=True, l2_keep=0.5), dict(packed=True),
                  dict(packed=True, block_m=8), dict(packed=True, amax_parts=True))
# the 1x16 quantize pass after per_tensor's own amax pass walks the tensor from its end (_nvfp4_tensor_kernel
# REVERSE). H200, session 26, per-tensor incl. amax (PDL), backwards / forwards in the same run: 135.0 / 136.2 us
# and 135.3 / 136.9 us at 16384x7168, 23.8 / 24.0 us and 23.5 / 23.5 us at 8192x2048 (benchmarks/RESULTS.md)
TENSOR_REVERSE = True
# l2_keep of per_tensor: the share of L2 the amax pass fills with evict_last lines of the tensor's tail for the
# reversed quantize pass (L2_HINTS of _amax_flat_kernel / _nvfp4_tensor_kernel); by default only for a tensor that
# fits in L2 whole. H100, session 28, two runs, per-tensor incl. amax at 8192x2048 (32 MiB, fits): keep 0.5
# 26.5 / 26.6 us against 27.6 / 27.9 us without; with amax_parts 25.6 / 25.7 us. At 16384x7168 (224 MiB) the
# hints cost 2% (179.6 against 175.9 us), hence the size rule (benchmarks/RESULTS.md).
TENSOR_L2_KEEP = 0.5
# amax_parts of per_tensor: the amax pass stores one partial max per program and the quantize kernel reduces them,
# instead of a zero-filled accumulator (one kernel launch) and atomics; only up to AMAX_PARTS_MAX programs (at
# 16384 words a program, 8192x2048 is 512, 16384x7168 3584: the atomic path). H100, session 28, two runs at
# 8192x2048: 27.0 / 27.0 us against 27.6 / 27.9 us (benchmarks/RESULTS.md).
TENSOR_AMAX_PARTS = True
AMAX_PARTS_MAX = 1024
# packed of per_tensor: the 1x16 quantize kernel takes its block amaxes on the packed bf16 / fp16 halves and unpacks
# x to fp32 only after G is known (_nvfp4_tensor_kernel PACKED), the change that took the per-token kernel from
# 80% / 84% to 95% / 87% of copy (session 23). Offline sm_90 at the default tile: 56 registers instead of 93 with G
# given, 60 instead of 96 launched with PDL after its own amax pass (16 programs of 2 warps an SM instead of 10),
# the same instruction count (`sass_count.py --kernels tensorpdl`). Measured on an H100 (session 28, two runs): level
# at 16384x7168, 0.6-0.8 us slower at 8192x2048 (28.4-28.5 against 27.6-27.9 us), level with G given: the registers
# did not turn into speed, so it is off; to be removed unless the H200 rows of benchmarks/quantize.py disagree.
TENSOR_PACKED = False
# 16x16 (the H200 sweep: 16 tiles / 4 warps 70% / 65% against 87% / 79% for 1x16): the 1x16 kernel on the same
# 16-row x 16-block tiles measured 71% / 68%, so the 16-row reduction is not what costs; the rows test the access
# pattern (k_major: programs walk a stripe's tiles first) and where the 16-row max is taken: block_nb=16 / 1 warp
# and thread_rows keep each thread's 16 rows in its registers (no cross-warp step; 165 / 76 registers).
TILE2D_CONFIGS = ({}, dict(thread_rows=False), dict(thread_rows=False, k_major=True),
                  dict(thread_rows=False, block_nb=32, num_warps=4),
                  dict(thread_rows=False, block_nb=16, num_warps=1, k_major=True), dict(k_major=False),
                  dict(split=1), dict(split=2), dict(split=4, num_warps=1), dict(split=4, num_warps=4))
# row parts of _nvfp4_tile2d_rows_kernel (per_tensor's split=): H200, session 20, amax given, % of copy at
# 16384x7168 / 8192x2048 in one run: split 4 90% / 81%, split 2 86% / 82%, split 1 (16 rows of 4 elements a
# thread, 2-byte stores) 75% / 78%; split 4 with 1 or 4 warps 88% / 81-82% (benchmarks/RESULTS.md)
TILE2D_SPLIT = 4
# amax at 8192x2048 (the tiled kernel measured 75% of copy there, 98% at 16384x7168): the flat kernel at
# 8192 words (8 warps, 32 registers: 8 programs = 64 warps per SM) launches 1024 programs into 132 x 8 = 1056
# slots, ONE wave with 32 words (8 16-byte loads) in flight per thread, so there is no wave tail to remove; what
# is left is fixed cost (the zero-fill of the accumulator is a kernel of its own, the start and drain of one wave,
# 1024 same-address atomics). The rows: fatter programs (16384 words: half the atomics, 512 programs, 64 words
# per thread), smaller ones at the same 32 words per thread (4096 / 4 warps: 2048 programs in 2112 slots of 16 per
# SM) and at 16 (2048 / 4 warps, 26 registers: 4096 programs, two waves). The default is the fat one since
# session 20: half the amax programs stay resident, so under PDL the quantize kernel's programs start beside them;
# per-tensor incl. amax at 8192x2048 took 24.1 / 23.5 us against 24.5 / 24.1 us at 8192 words in two H200 runs, level
# at 16384x7168 (135.5 against 135.1 us; benchmarks/RESULTS.md, session 20).
AMAX_CONFIGS = ({}, dict(flat_block=0), dict(flat_block=8192), dict(flat_block=4096, num_warps=4),
                dict(flat_block=2048, num_warps=4))


def _launch_cfg_rows(nb: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_NB, num_warps) for the whole-row kernel (rows the register-chunked kernel does not take):
    one row per 2-warp program, at least 512 pair words per program for short rows. H200 sweep, session 15
    (benchmarks/RESULTS.md) at K = 2048: 1 row / 2 warps 83% of copy, the 2-row tile 80%, 1 row / 4 warps 77%;
    ROW_CONFIGS keeps the 2-row tile (block_m=2) for the benchmark."""
    from ._common import next_pow2

    bnb = next_pow2(nb)
    bm = max(1, min(16, 512 // (bnb * 8)))
    return bm, bnb, 2


# Default wherever it applies (the row is a whole number of <= 8 chunks of 64 blocks, K = 1024 .. 8192 in steps of
# 1024): the register-chunked kernel, 2 warps. H200 sweep, session 15 (benchmarks/RESULTS.md), % of copy at
# 16384x7168 / 8192x2048: chunk=64 / 2 warps 87% / 84%; the whole row (one row, 2 warps; padded to 512 blocks at
# K = 7168) 65% / 83%; chunk=128 / 4 warps 86% / 77%; 2-row tiles 53% / 80%. chunk=0 forces the whole row.
DEFAULT_CHUNK = 64
# The chunked kernel's block max on packed bf16 / fp16 halves (_words_block_amax; fp32 input ignores it). H200,
# session 23, one run (benchmarks/RESULTS.md): % of copy at 16384x7168 / 8192x2048, packed 95% / 87% against 80% /
# 84% unpacked; 94 registers instead of 156 at K = 7168, so 10 programs of 2 warps fit an SM instead of 6.
DEFAULT_PACKED = True


def row_scaled(x2, *, block_m=None, num_warps=None, loop_chunk=None, chunk=None, maxnreg=None, packed=None):
    """Per-row NVFP4 of a contiguous [M, K] bf16/fp16/fp32 CUDA tensor (K % 16 == 0).
    Returns (data uint8 [M, K/2], scale uint8 [M, K/16], S_dec fp32 [M], G fp32 [M]). block_m / num_warps /
    loop_chunk / chunk / maxnreg (ptx register cap of the chunked kernel) / packed (the chunked kernel's block max
    on packed halves, default DEFAULT_PACKED): launch shape only, the bytes do not depend on them."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    m, k = x2.shape
    nb = k // 16
    dev = x2.device
    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty((m, nb), dtype=torch.uint8, device=dev)
    sdec = torch.empty((m,), dtype=torch.float32, device=dev)
    amax = torch.empty((m,), dtype=torch.float32, device=dev)
    if m == 0 or k == 0:
        sdec.fill_(1.0)
        amax.zero_()
        return data, scale, sdec, amax
    xp = pair_view(x2)
    code = in_dtype_code(x2.dtype)
    bm, bnb, warps = _launch_cfg_rows(nb)
    if chunk is None and block_m is None and loop_chunk is None and nb % DEFAULT_CHUNK == 0 \
            and nb // DEFAULT_CHUNK <= 8:
        chunk = DEFAULT_CHUNK
    if chunk and -(-nb // chunk) <= 8:  # register-resident row in <= 8 chunks of `chunk` blocks
        _nvfp4_row_scaled_chunked_kernel[(m,)](xp, data, scale, sdec, amax, m, nb, xp.stride(0), data.stride(0),
                                               scale.stride(0), IN_DTYPE=code, NCH=-(-nb // chunk), CH=chunk,
                                               EVEN=nb % chunk == 0,
                                               PACKED=DEFAULT_PACKED if packed is None else bool(packed),
                                               num_warps=num_warps or 2,
                                               **LAUNCH_OPTS,
                                               **({"maxnreg": maxnreg} if maxnreg else {}))
        return data, scale, sdec, amax
    if loop_chunk is None and bnb * 8 > 16384:
        loop_chunk = 256
    if loop_chunk:
        _nvfp4_row_scaled_loop_kernel[(m,)](xp, data, scale, sdec, amax, m, nb, xp.stride(0), data.stride(0),
                                            scale.stride(0), IN_DTYPE=code, CHUNK_NB=loop_chunk,
                                            num_warps=num_warps or 4, **LAUNCH_OPTS)
        return data, scale, sdec, amax
    bm = block_m or bm
    warps = num_warps or warps
    _nvfp4_row_scaled_kernel[(triton.cdiv(m, bm),)](xp, data, scale, sdec, amax, m, nb, xp.stride(0),
                                                     data.stride(0), scale.stride(0), IN_DTYPE=code, BLOCK_M=bm,
                                                     BLOCK_NB=bnb, EVEN=nb == bnb and m % bm == 0, num_warps=warps,
                                                     **LAUNCH_OPTS)
    return data, scale, sdec, amax


AMAX_FLAT_BLOCK = 16384  # pair words per program of the flat amax kernel (0: the [rows, words] tile kernel)
AMAX_NUM_WARPS = 8  # warps per program of the flat amax kernel


def use_pdl(pdl, device) -> bool:
    """Whether to launch with programmatic dependent launch: pdl None (the default) or true, and the device has it
    (sm_90+, compiled kernels; the interpreter runs programs one by one)."""
    import os

    import torch

    return ((pdl is None or bool(pdl)) and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
            and torch.cuda.get_device_capability(device)[0] >= 9)


def l2_cache_bytes(device) -> int:
    """The L2 size of a CUDA device (torch's L2_cache_size); 0 elsewhere (the interpreter has no L2)."""
    import torch

    return int(torch.cuda.get_device_properties(device).L2_cache_size) if device.type == "cuda" else 0


def tensor_amax(x2, *, flat_block=None, num_warps=None, pdl=None, keep_bytes=0):
    """fp32 [1] max|x| of a contiguous [M, K] CUDA tensor (K even), NaN ignored, one kernel + atomics.
    flat_block: pair words per program of `_amax_flat_kernel` (default AMAX_FLAT_BLOCK; 0 = `_amax_kernel`).
    pdl (flat kernel): launch it with programmatic dependent launch after the accumulator's zero-fill, and let
    the next launch start early (default: PDL where available; see _amax_flat_kernel).
    keep_bytes (flat kernel): the programs that read the last keep_bytes of x (rounded up to whole programs)
    load with the L2 evict_last policy and the others with evict_first (L2_HINTS there); 0 = no hints."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    m, k = x2.shape
    bits = torch.zeros((1,), dtype=torch.int32, device=x2.device)
    flat_block = AMAX_FLAT_BLOCK if flat_block is None else flat_block
    if m and k and flat_block:  # contiguous x2: one flat run of pair words
        xp = pair_view(x2).reshape(-1)
        n = xp.numel()
        pdl = use_pdl(pdl, x2.device)
        programs = triton.cdiv(n, flat_block)
        keep_programs = -(-max(0, int(keep_bytes)) // (xp.element_size() * flat_block))
        _amax_flat_kernel[(programs,)](xp, bits, n, max(0, programs - keep_programs),
                                       IN_DTYPE=in_dtype_code(x2.dtype), BLOCK=flat_block,
                                       EVEN=n % flat_block == 0, PDL=pdl, L2_HINTS=keep_programs > 0,
                                       num_warps=num_warps or AMAX_NUM_WARPS,
                                       **({"launch_pdl": True} if pdl else {}), **LAUNCH_OPTS)
    elif m and k:
        xp = pair_view(x2)
        np_ = xp.shape[1]
        bp = min(1024, max(16, 1 << (np_ - 1).bit_length()))
        bm = max(1, 8192 // bp)
        grid = (triton.cdiv(m, bm), triton.cdiv(np_, bp))
        _amax_kernel[grid](xp, bits, m, np_, xp.stride(0), IN_DTYPE=in_dtype_code(x2.dtype), BLOCK_M=bm,
                           BLOCK_P=bp, num_warps=num_warps or 8, **LAUNCH_OPTS)
    return bits.view(torch.float32)


def _amax_parts(x2, keep_bytes: int, launch_next: bool):
    """(int32 [programs] partial amax bit patterns, programs) of `_amax_flat_kernel` PARTS over a non-empty
    contiguous x2 at the default launch shape, or None past AMAX_PARTS_MAX programs (the caller takes the atomic
    pass). Launched without launch_pdl (the kernel before it wrote x); launch_next: let the next launch (a PDL one)
    start at once."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    xp = pair_view(x2).reshape(-1)
    n = xp.numel()
    programs = triton.cdiv(n, AMAX_FLAT_BLOCK)
    if programs > AMAX_PARTS_MAX:
        return None
    parts = torch.empty((programs,), dtype=torch.int32, device=x2.device)
    keep_programs = -(-max(0, int(keep_bytes)) // (xp.element_size() * AMAX_FLAT_BLOCK))
    _amax_flat_kernel[(programs,)](xp, parts, n, max(0, programs - keep_programs), IN_DTYPE=in_dtype_code(x2.dtype),
                                   BLOCK=AMAX_FLAT_BLOCK, EVEN=n % AMAX_FLAT_BLOCK == 0, L2_HINTS=keep_programs > 0,
                                   PARTS=True, LAUNCH_NEXT=launch_next, num_warps=AMAX_NUM_WARPS, **LAUNCH_OPTS)
    return parts, programs


def per_tensor(x2, global_amax=None, tile_2d=False, *, block_m=None, block_nb=None, num_warps=None,
               k_major=None, thread_rows=True, one_pass=False, pdl=None, split=None, reverse=None, l2_keep=None,
               amax_parts=None, packed=None):
    """Per-tensor NVFP4 (1x16, or 16x16 tiles) of a contiguous [M, K] CUDA tensor. `global_amax` (fp32, 1 element,
    on the device) replaces the amax pass (share-scale groups). k_major: consecutive programs walk the block
    columns of a row stripe (see _nvfp4_tensor_kernel; ignored past 65535 stripes, CUDA's limit on grid axis 1);
    None = on, except for the 16x16 TILE_2D kernel (thread_rows=False).
    thread_rows (16x16 only, the default): `_nvfp4_tile2d_rows_kernel` (16 / split rows of 4 * split elements per
    thread, split default TILE2D_SPLIT; block_nb defaults to 8 * num_warps); False = `_nvfp4_tensor_kernel` with
    TILE_2D.
    pdl (1x16 `_nvfp4_tensor_kernel`, without global_amax): the amax and the quantize kernel are launched with
    programmatic dependent launch (each may start while the one before it drains and waits for it only where it
    reads what that one wrote); default: where available (use_pdl). With global_amax nothing is launched
    early: the kernel that wrote it (or x) is the caller's.
    reverse (1x16 `_nvfp4_tensor_kernel`): its programs walk the tensor from the end (see REVERSE there); default
    TENSOR_REVERSE (on) when this call runs the amax pass, off with global_amax.
    l2_keep (1x16 `_nvfp4_tensor_kernel`): a fraction of the device's L2 (torch's L2_cache_size); the amax pass
    marks the last l2_keep * L2 bytes it reads evict_last and the rest evict_first, and the quantize pass loads x
    and stores its outputs evict_first (L2_HINTS of both kernels), so the reversed quantize pass finds the tail in
    L2; default TENSOR_L2_KEEP where x fits in L2 whole, else 0; 0 = no hints. With global_amax only the quantize
    kernel's hints apply.
    amax_parts (1x16 without global_amax): the amax pass writes one partial max per program and the quantize kernel
    reduces them (PARTS / G_PARTS of the two kernels): no zero-fill launch, no atomics; default TENSOR_AMAX_PARTS,
    taken only where the flat amax kernel has <= AMAX_PARTS_MAX programs.
    packed (1x16 `_nvfp4_tensor_kernel`, and its TILE_2D path): block amaxes on the packed bf16 / fp16 halves, x
    unpacked only after G is read (PACKED there); default TENSOR_PACKED. Launch shape only: same bytes.
    one_pass (1x16 without global_amax): the amax and the quantize pass in one launch
    (triton_segments.nvfp4_segment_fused with the tensor as its one group: a tensor that fits in L2 is read from
    HBM once); tensors it cannot tile take the two kernels.
    Returns (data, scale, S_dec [1], G [1])."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code, next_pow2, pair_view

    m, k = x2.shape
    nb = k // 16
    dev = x2.device
    if one_pass and global_amax is None and not tile_2d and m and k and x2.is_contiguous():
        from . import triton_segments

        if triton_segments.item_blocks_for(m, k):
            data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
            scale = torch.empty((m, nb), dtype=torch.uint8, device=dev)
            sdec = torch.empty((1,), dtype=torch.float32, device=dev)
            bits = triton_segments.nvfp4_segment_fused(x2, m, m, data, scale, sdec)
            return data, scale, sdec, bits.view(torch.float32)
    reverse = (TENSOR_REVERSE and global_amax is None) if reverse is None else bool(reverse)
    pdl = global_amax is None and use_pdl(pdl, dev)
    l2_bytes = 0 if tile_2d else l2_cache_bytes(dev)  # 16x16 takes no hints
    if l2_keep is None:  # the default keeps a tail in L2 only where the whole tensor fits there
        l2_keep = TENSOR_L2_KEEP if 0 < x2.numel() * x2.element_size() <= l2_bytes else 0.0
    l2_keep = float(l2_keep)
    if not 0.0 <= l2_keep <= 1.0:
        raise ValueError(f"per_tensor: l2_keep is a fraction of the L2 cache, 0..1, not {l2_keep}")
    l2_hints = l2_keep > 0 and not tile_2d
    keep_bytes = int(l2_keep * l2_bytes) if l2_hints else 0
    amax_parts = TENSOR_AMAX_PARTS if amax_parts is None else bool(amax_parts)
    packed = TENSOR_PACKED if packed is None else bool(packed)
    parts = (_amax_parts(x2, keep_bytes, pdl) if amax_parts and global_amax is None and not tile_2d and m and k
             else None)
    if parts is not None:
        g_in, n_parts = parts
        g_bits = torch.empty((1,), dtype=torch.int32, device=dev)
        g = g_bits.view(torch.float32)
    else:
        g = (tensor_amax(x2, pdl=pdl, keep_bytes=keep_bytes)
             if global_amax is None else global_amax.reshape(1).to(device=dev, dtype=torch.float32))
        g_in, g_bits, n_parts = g, g, 0
    data = torch.empty((m, k // 2), dtype=torch.uint8, device=dev)
    scale = torch.empty(((m // 16) if tile_2d else m, nb), dtype=torch.uint8, device=dev)
    sdec = torch.empty((1,), dtype=torch.float32, device=dev)
    if m and k:
        xp = pair_view(x2)
        # defaults, H200 sweeps of session 15 (benchmarks/RESULTS.md), % of copy at 16384x7168 / 8192x2048 with
        # the amax given: 1x16 4 rows x 64 blocks / 2 warps, k_major 90% / 79% (row-major order 86% / 77%, 8 x 64 /
        # 4 warps 83% / 72%); 16x16 thread_rows 76% / 79% against the TILE_2D kernel's 69-70% / 65-66% (16 tiles /
        # 4 warps, either order), 32 tiles / 4 warps 65% / 62% (fewer SASS instructions per element, 14.6 vs
        # 16.1, but slower: the SASS count is not the bound there). 16x16 thread_rows, six runs of sessions 25-26:
        # k_major order 81-92% / 80-82%, row-major order 80-90% / 76-80%
        thread_rows = bool(thread_rows) and tile_2d
        if k_major is None:
            k_major = not tile_2d or thread_rows
        bm = 16 if tile_2d else (block_m or 4)
        warps = num_warps or (2 if thread_rows else 4 if tile_2d else 2)
        bnb = block_nb or (8 * warps if thread_rows else
                           min(16 if tile_2d else 64, max(1, 1 << (nb - 1).bit_length())))
        grid = (triton.cdiv(m, bm), triton.cdiv(nb, bnb))
        k_major = bool(k_major) and grid[0] <= 65535
        if k_major:
            grid = grid[::-1]
        if thread_rows:
            _nvfp4_tile2d_rows_kernel[grid](xp, data, scale, g, sdec, m, nb, xp.stride(0), data.stride(0),
                                            scale.stride(0), IN_DTYPE=in_dtype_code(x2.dtype), BLOCK_NB=bnb,
                                            EVEN=m % bm == 0 and nb % bnb == 0, K_MAJOR=k_major,
                                            SPLIT=split or TILE2D_SPLIT, num_warps=warps, **LAUNCH_OPTS)
            return data, scale, sdec, g
        # PDL: the amax kernel, the launch right before this one (nothing between them launches a kernel), wrote g
        _nvfp4_tensor_kernel[grid](xp, data, scale, g_in, sdec, m, nb, xp.stride(0), data.stride(0),
                                   scale.stride(0), g_bits, n_parts, IN_DTYPE=in_dtype_code(x2.dtype),
                                   TILE_2D=tile_2d, BLOCK_M=bm, BLOCK_NB=bnb,
                                   EVEN=m % bm == 0 and nb % bnb == 0, K_MAJOR=k_major, PDL=pdl, REVERSE=reverse,
                                   L2_HINTS=l2_hints, G_PARTS=next_pow2(n_parts) if n_parts else 0,
                                   PACKED=packed, num_warps=warps,
                                   **({"launch_pdl": True} if pdl else {}), **LAUNCH_OPTS)
    else:
        sdec.fill_(1.0)  # empty tensor: G = 0 -> S_enc = 1
    return data, scale, sdec, g
