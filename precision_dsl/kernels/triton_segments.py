"""Grouped ("segment") kernels for the live weight update: many same-shaped tensors in ONE launch.

A segment is a [rows, K] matrix made of `n_members` stacked tensors of `rows_per_member` rows each (all routed
experts of one layer, gate/up interleaved per expert as in Megatron's fc1). Per-tensor quantities (NVFP4's
second-level scale) are computed per member - or per share-scale group of `rows_per_group` rows (gate + up of one
expert share one amax) - so every member's bytes equal what the per-tensor kernels / the references produce for
that tensor alone (tests/test_weight_update_gpu.py checks this byte for byte on the GPU).

  * `_seg_amax_kernel`: per-group amax (NaN-ignoring; for bf16 computed on the integer magnitude bits, see the
    kernel; integer atomic max on the fp32 bits, like
    triton_nvfp4._amax_kernel, reduced per row first so a program may straddle groups) + a non-finite element
    count (the update refuses NaN/Inf weights; folded into the pass that reads the weights anyway).
  * `_nvfp4_seg_kernel`: triton_nvfp4._nvfp4_tensor_kernel (1x16 blocks) with G read per row's group and S_dec
    written once per member (row tiles: any member shape).
  * item kernels (`nvfp4_segment_items`): the contiguous segment as a flat run of
    items of IB 16-element blocks that never straddle a member (so each item has ONE group: one atomic, one G
    load), no padded lanes for any K: `_seg_amax_items_kernel` then `_nvfp4_seg_items_kernel` (which also fills
    the ModelOpt input_scale).
  * `_nvfp4_seg_predicted_kernel` + `_nvfp4_seg_redo_kernel` (`nvfp4_segment_predicted`, the update's default):
    one read of each item takes its amax AND quantizes it with the group amax of the previous update; the redo
    re-quantizes (second read) only the groups whose amax changed. Same bytes as the two-pass kernels always.
  * `_nvfp4_seg_onepass_kernel` (`nvfp4_segment_fused`): both item passes in ONE launch that reads the weights
    from HBM once - a persistent grid that takes the amax of chunk c (whole groups) before it quantizes chunk c-1
    from L2, programs waiting for each other once per chunk.
  * `_multi_check_copy_kernel`: `_check_copy_kernel` over MANY small tensors in one launch (the norms, routers and
    small attention weights of a bucket), driven by a per-block table built once: a bucket's small pieces no
    longer cost a launch each.
  * `_check_copy_kernel`: copy raw 16/32-bit words into the wire buffer and count non-finite elements in the same
    pass (high-precision segments), or count only (MXFP8 / FP8-block segments, whose kernels do not report it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import max_nan, unpack_pair
from .triton_nvfp4 import _block_amax, _encode_blocks, _global_scales, _load_block_tile, _pair_offsets


@triton.jit
def _seg_amax_kernel(xp_ptr, amax_bits_ptr, bad_ptr, M, NP, stride_xp, RPG, IN_DTYPE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_p = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    rmask = rows < M
    mask = rmask[:, None] & (cols < NP)[None, :]
    u = tl.load(xp_ptr + rows.to(tl.int64)[:, None] * stride_xp + cols[None, :], mask=mask, other=0)
    if IN_DTYPE == 0:
        # bf16: on the magnitude bits, integer order is float order for finite values, and |x| << 16 is the fp32
        # bits of |x|; a non-finite element has all exponent bits set (magnitude >= 0x7F80). A few integer ops
        # per pair instead of unpack + float compares: this pass reads every expert weight, so its instruction
        # count decides whether it runs at memory speed. (With NaN present the amax differs from the float path's
        # NaN-ignoring one, but then `bad` > 0 and the update is aborted - its bytes are never used.)
        mlo = u & 0x7FFF
        mhi = (u >> 16) & 0x7FFF
        a_bits = tl.max(tl.maximum(mlo, mhi), axis=1) << 16  # [BLOCK_M]
        nf = tl.sum(tl.sum((mlo >= 0x7F80).to(tl.int32) + (mhi >= 0x7F80).to(tl.int32), axis=1), axis=0)
    else:
        lo, hi = unpack_pair(u, IN_DTYPE)
        alo = tl.abs(lo)
        ahi = tl.abs(hi)
        a = tl.maximum(tl.max(tl.maximum(alo, ahi), axis=1), 0.0)  # [BLOCK_M], NaN ignored
        a_bits = a.to(tl.int32, bitcast=True)
        # |x| > FLT_MAX is inf; NaN fails every comparison, so `not (|x| <= FLT_MAX)` catches both
        nf = tl.sum(tl.sum((~(alo <= 3.4028234663852886e38)).to(tl.int32)
                           + (~(ahi <= 3.4028234663852886e38)).to(tl.int32), axis=1), axis=0)
    tl.atomic_max(amax_bits_ptr + rows // RPG, a_bits, mask=rmask, sem="relaxed")
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


@triton.jit
def _item_words(j, IB: tl.constexpr):
    """Word offsets [IB, 8] of item j: IB consecutive 16-element blocks (8 pair words each) of a contiguous
    segment. The same offsets address the item's packed E2M1 bytes (8 per block) in the contiguous data output."""
    return j.to(tl.int64) * (IB * 8) + (tl.arange(0, IB)[:, None] * 8 + tl.arange(0, 8)[None, :])


@triton.jit
def _words_amax(u, IN_DTYPE: tl.constexpr):
    """(max|x| as fp32 bits, non-finite count) over all pair words u: the arithmetic of _seg_amax_kernel (bf16 on
    the integer magnitude bits, the NaN-ignoring float max otherwise), so group amaxes are bit for bit seg_amax's."""
    if IN_DTYPE == 0:
        mlo = u & 0x7FFF
        mhi = (u >> 16) & 0x7FFF
        a_bits = tl.max(tl.maximum(mlo, mhi)) << 16
        nf = tl.sum((mlo >= 0x7F80).to(tl.int32) + (mhi >= 0x7F80).to(tl.int32))
    else:
        lo, hi = unpack_pair(u, IN_DTYPE)
        alo = tl.abs(lo)
        ahi = tl.abs(hi)
        a_bits = tl.maximum(tl.max(tl.maximum(alo, ahi)), 0.0).to(tl.int32, bitcast=True)
        nf = tl.sum((~(alo <= 3.4028234663852886e38)).to(tl.int32) + (~(ahi <= 3.4028234663852886e38)).to(tl.int32))
    return a_bits, nf


@triton.jit
def _store_item(lo, hi, amax_b, j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IB: tl.constexpr,
                HAS_ISC: tl.constexpr):
    """NVFP4 1x16 bytes of item j (fp32 pairs lo / hi [IB, 8], block amaxes [IB]) with its group's fp32 G; the item
    that starts a member (IPM items a member) writes the member's S_dec (and the ModelOpt input_scale 1.0 when
    HAS_ISC)."""
    s_enc, s_dec = _global_scales(g)
    sf, packed = _encode_blocks(lo, hi, amax_b, s_enc, s_dec)
    tl.store(data_ptr + _item_words(j, IB), packed)
    tl.store(scale_ptr + j.to(tl.int64) * IB + tl.arange(0, IB), sf)
    if j % IPM == 0:
        tl.store(sdec_ptr + j // IPM, s_dec)
        if HAS_ISC:  # ModelOpt input_scale (unused with per-token activations): 1.0 per member
            tl.store(isc_ptr + j // IPM, 1.0)


@triton.jit
def _quant_item(u, j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IN_DTYPE: tl.constexpr, IB: tl.constexpr,
                HAS_ISC: tl.constexpr):
    """NVFP4 1x16 of item j (pair words u) with its group's fp32 G (see _store_item)."""
    lo, hi = unpack_pair(u, IN_DTYPE)
    _store_item(lo, hi, _block_amax(lo, hi), j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IB, HAS_ISC)


@triton.jit
def _seg_amax_items_kernel(xp_ptr, bits_ptr, bad_ptr, IPG, IN_DTYPE: tl.constexpr, IB: tl.constexpr):
    """Group amax bits (int32 atomic max, zeroed by the caller) + non-finite count, one item per program; an item
    lies inside one group (IPG items a group), so one atomic per item."""
    j = tl.program_id(0)
    a_bits, nf = _words_amax(tl.load(xp_ptr + _item_words(j, IB)), IN_DTYPE)
    tl.atomic_max(bits_ptr + j // IPG, a_bits, sem="relaxed")
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


@triton.jit
def _nvfp4_seg_items_kernel(xp_ptr, data_ptr, scale_ptr, g_ptr, sdec_ptr, isc_ptr, IPG, IPM,
                            IN_DTYPE: tl.constexpr, IB: tl.constexpr, HAS_ISC: tl.constexpr):
    """NVFP4 1x16 of one item per program with its group's G (fp32, from g_ptr)."""
    j = tl.program_id(0)
    u = tl.load(xp_ptr + _item_words(j, IB))
    _quant_item(u, j, tl.load(g_ptr + j // IPG), data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IN_DTYPE, IB, HAS_ISC)


@triton.jit
def _predicted_item(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, bad_ptr, j, IPG, IPM,
                    IN_DTYPE: tl.constexpr, IB: tl.constexpr, HAS_ISC: tl.constexpr):
    """ONE read of item j: its quantization with the group amax of the previous update (prev_ptr, fp32 bits) and,
    from the block amaxes that quantization computes anyway, its amax into the group's bits. The bytes are final
    wherever the group amax did not change; _redo_group redoes the groups where it did.

    The kernel is issue-bound, so nothing is done per element for the amax or the NaN/Inf screen beyond what the
    quantization needs: the block amaxes are taken with the NaN-PROPAGATING max (max.NaN.f32, the same one
    instruction), so a block holding a NaN has amax NaN and one holding +-inf has amax inf, and the one cross-warp
    max of the item is NaN or inf exactly when an element is non-finite. For finite inputs these block amaxes are
    bit for bit _block_amax's (the NaN-ignoring max.f32, then max(., 0): |x| >= +0 already), hence the bytes and
    the item amax those of the two-pass kernels. A non-finite item counts its NaN/Inf elements exactly and takes
    the NaN-ignoring item amax; its bytes are not the reference's, but an update with a non-finite element is
    refused (the count is > 0), so they are never used."""
    words = _item_words(j, IB)
    lo, hi = unpack_pair(tl.load(xp_ptr + words), IN_DTYPE)
    amax_b = tl.reduce(max_nan(tl.abs(lo), tl.abs(hi)), 1, max_nan)
    a_item = tl.reduce(amax_b, 0, max_nan)
    g = tl.load(prev_ptr + j // IPG).to(tl.float32, bitcast=True)
    _store_item(lo, hi, amax_b, j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IB, HAS_ISC)
    if not (a_item < float("inf")):  # NaN or +-inf in the item (rare): read again, so the hot path's registers
        # hold nothing for this branch; exact count, NaN-ignoring amax
        lo, hi = unpack_pair(tl.load(xp_ptr + words), IN_DTYPE)
        a_item = tl.max(_block_amax(lo, hi), axis=0)
        nf = tl.sum(tl.sum(((lo - lo) != 0).to(tl.int32) + ((hi - hi) != 0).to(tl.int32), axis=1), axis=0)
        tl.atomic_add(bad_ptr, nf, sem="relaxed")
    tl.atomic_max(bits_ptr + j // IPG, a_item.to(tl.int32, bitcast=True), sem="relaxed")


@triton.jit
def _nvfp4_seg_predicted_kernel(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, bad_ptr, IPG,
                                IPM, IN_DTYPE: tl.constexpr, IB: tl.constexpr, HAS_ISC: tl.constexpr):
    """_predicted_item of item program_id(0) of one segment."""
    _predicted_item(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, bad_ptr, tl.program_id(0),
                    IPG, IPM, IN_DTYPE, IB, HAS_ISC)


@triton.jit
def _redo_group(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, grp, t, IPG, IPM, S,
                IN_DTYPE: tl.constexpr, IB: tl.constexpr, HAS_ISC: tl.constexpr):
    """When group grp's true amax (bits) differs from the predicted one (prev), re-quantize its items t, t + S, ...
    with the true amax; else return after two int loads."""
    b = tl.load(bits_ptr + grp)
    if b != tl.load(prev_ptr + grp):
        g = b.to(tl.float32, bitcast=True)
        while t < IPG:
            j = grp * IPG + t
            _quant_item(tl.load(xp_ptr + _item_words(j, IB)), j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM,
                        IN_DTYPE, IB, HAS_ISC)
            t += S


@triton.jit
def _nvfp4_seg_redo_kernel(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, IPG, IPM, S,
                           IN_DTYPE: tl.constexpr, IB: tl.constexpr, HAS_ISC: tl.constexpr):
    """Program (group, s): _redo_group (a grid of groups x S, not of items, so an update whose predictions were
    right costs next to nothing here)."""
    _redo_group(xp_ptr, data_ptr, scale_ptr, bits_ptr, prev_ptr, sdec_ptr, isc_ptr, tl.program_id(0),
                tl.program_id(1), IPG, IPM, S, IN_DTYPE, IB, HAS_ISC)


@triton.jit
def _span(c, p, P, IPC, N_ITEMS):
    """Program p's items [lo, hi) of chunk c: a contiguous run of ceil(items / P) (fewer at the end)."""
    j0 = c * IPC
    j1 = tl.minimum(j0 + IPC, N_ITEMS)
    per = (j1 - j0 + P - 1) // P
    lo = tl.minimum(j0 + p * per, j1)
    return lo, tl.minimum(lo + per, j1), j1 - j0


@triton.jit
def _nvfp4_seg_onepass_kernel(xp_ptr, data_ptr, scale_ptr, bits_ptr, sdec_ptr, isc_ptr, bad_ptr, done_ptr,
                              N_ITEMS, IPC, IPG, IPM, N_CHUNKS, IN_DTYPE: tl.constexpr, IB: tl.constexpr,
                              HAS_ISC: tl.constexpr):
    """The amax and the quantize pass of a segment in ONE launch that reads the weights from HBM once.

    The segment's items are cut into chunks of whole groups (IPC items, sized so that two chunks stay in L2);
    program p of P (a persistent grid, every program resident at once) owns a contiguous run of every chunk's items
    (_span) and runs, for c = 0 .. N_CHUNKS:  amax of its run of chunk c -> count it done for c (release, after a
    CTA barrier) -> wait (acquire) until all of chunk c-1's items are done -> quantize its run of chunk c-1, which
    it read one chunk earlier, so it comes from L2. The wait is for work every program finished before waiting
    for chunk c-2, so there is no cycle, and it is normally already satisfied (the programs do equal work). One
    release and one wait per program and chunk; each loop issues the next item's loads (masked off past the run)
    before working on the current one, so they are in flight during the math.
    Under the interpreter the host launches one program, which then does every item in order."""
    p = tl.program_id(0)
    P = tl.num_programs(0)
    c = p * 0
    while c <= N_CHUNKS:
        if c < N_CHUNKS:
            j, hi, _n = _span(c, p, P, IPC, N_ITEMS)
            if j < hi:
                mine = hi - j
                u = tl.load(xp_ptr + _item_words(j, IB))
                while j < hi:
                    jn = j + 1
                    un = tl.load(xp_ptr + _item_words(jn, IB), mask=jn < hi, other=0)  # none past the run
                    a_bits, nf = _words_amax(u, IN_DTYPE)
                    tl.atomic_max(bits_ptr + j // IPG, a_bits, sem="relaxed")
                    if nf > 0:
                        tl.atomic_add(bad_ptr, nf, sem="relaxed")
                    u = un
                    j = jn
                tl.debug_barrier()
                tl.atomic_add(done_ptr + c, mine, sem="release")
        if c > 0:
            j, hi, need = _span(c - 1, p, P, IPC, N_ITEMS)
            if j < hi:
                u = tl.load(xp_ptr + _item_words(j, IB))
                # spin on plain volatile loads (no read-modify-write traffic on the counter), then one acquire RMW
                # orders this program's reads of the group amaxes after the chunk's releases
                got = tl.load(done_ptr + c - 1, volatile=True)
                while got < need:
                    got = tl.load(done_ptr + c - 1, volatile=True)
                tl.atomic_add(done_ptr + c - 1, 0, sem="acquire")
                tl.debug_barrier()
                while j < hi:
                    jn = j + 1
                    un = tl.load(xp_ptr + _item_words(jn, IB), mask=jn < hi, other=0)
                    # volatile: past L1, which may hold a line of group amaxes read before their chunk was done
                    g = tl.load(bits_ptr + j // IPG, volatile=True).to(tl.float32, bitcast=True)
                    _quant_item(u, j, g, data_ptr, scale_ptr, sdec_ptr, isc_ptr, IPM, IN_DTYPE, IB, HAS_ISC)
                    u = un
                    j = jn
        c += 1


@triton.jit
def _nvfp4_seg_kernel(xp_ptr, data_ptr, scale_ptr, g_ptr, sdec_ptr, M, NB, stride_xp, stride_d, stride_s, RPG, RPM,
                      IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NB: tl.constexpr):
    """triton_nvfp4._nvfp4_tensor_kernel (1x16 blocks) with each row's G read from its group (RPG rows a group)
    and S_dec written once per member (RPM rows a member)."""
    stride_xp = tl.multiple_of(stride_xp, 8)  # K/2 pair words with K % 16 == 0
    stride_d = tl.multiple_of(stride_d, 8)
    lo, hi, rows, r64, nb, rmask, bmask = _load_block_tile(xp_ptr, M, NB, stride_xp, IN_DTYPE, BLOCK_M, BLOCK_NB)
    g = tl.load(g_ptr + rows // RPG, mask=rmask, other=0.0)  # [BM]
    s_enc, s_dec = _global_scales(g)
    tl.store(sdec_ptr + rows // RPM, s_dec, mask=rmask & (rows % RPM == 0) & (tl.program_id(1) == 0))
    sf, packed = _encode_blocks(lo, hi, _block_amax(lo, hi), s_enc[:, None], s_dec[:, None])
    tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf, mask=rmask[:, None] & bmask[None, :])
    tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed, mask=rmask[:, None, None] & bmask[None, :, None])


@triton.jit
def _check_copy_kernel(x_ptr, out_ptr, bad_ptr, N, IS_F32: tl.constexpr, DO_COPY: tl.constexpr,
                       BLOCK: tl.constexpr):
    """x: N raw words (int16 for bf16/fp16 viewed as bf16 bits... see wrapper), copied to out if DO_COPY."""
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    u = tl.load(x_ptr + offs, mask=m, other=0)
    if DO_COPY:
        tl.store(out_ptr + offs, u, mask=m)
    if IS_F32:
        e = (u.to(tl.int32, bitcast=True) >> 23) & 0xFF
        bad = e == 0xFF
    else:
        bad = ((u.to(tl.int16, bitcast=True).to(tl.int32) >> 10) & 0x1F) == 0x1F  # fp16 exponent all ones
    nf = tl.sum(bad.to(tl.int32), axis=0)
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


@triton.jit
def _check_copy_bf16_kernel(x_ptr, out_ptr, bad_ptr, N, DO_COPY: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    u = tl.load(x_ptr + offs, mask=m, other=0)
    if DO_COPY:
        tl.store(out_ptr + offs, u, mask=m)
    bad = ((u.to(tl.int32) >> 7) & 0xFF) == 0xFF  # bf16 exponent all ones: inf or NaN
    nf = tl.sum(bad.to(tl.int32), axis=0)
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


@triton.jit
def _multi_check_copy_kernel(base_ptr, out_ptr, table_ptr, bad_ptr, KIND: tl.constexpr, ALIGNED: tl.constexpr,
                             BLOCK: tl.constexpr):
    """Program p copies table row p = (source offset from base_ptr, destination offset in out_ptr, count), all in
    elements, and counts the non-finite ones (KIND 0 bf16, 1 fp16, 2 fp32 words). The sources are separate
    tensors addressed from one base pointer (one address space). ALIGNED: every offset and count is a multiple of
    8 elements (the hint lets the copy use 16-byte accesses)."""
    pid = tl.program_id(0)
    src = tl.load(table_ptr + pid * 3)
    dst = tl.load(table_ptr + pid * 3 + 1)
    n = tl.load(table_ptr + pid * 3 + 2)
    if ALIGNED:
        src = tl.multiple_of(src, 8)
        dst = tl.multiple_of(dst, 8)
        n = tl.multiple_of(n, 8)
    offs = tl.arange(0, BLOCK)
    m = offs < n
    u = tl.load(base_ptr + src + offs, mask=m, other=0)
    tl.store(out_ptr + dst + offs, u, mask=m)
    if KIND == 2:
        bad = ((u.to(tl.int32, bitcast=True) >> 23) & 0xFF) == 0xFF
    elif KIND == 1:
        bad = ((u.to(tl.int16, bitcast=True).to(tl.int32) >> 10) & 0x1F) == 0x1F
    else:
        bad = ((u.to(tl.int32) >> 7) & 0xFF) == 0xFF
    nf = tl.sum(bad.to(tl.int32), axis=0)
    if nf > 0:
        tl.atomic_add(bad_ptr, nf, sem="relaxed")


# ----------------------------------------------------------------------------------------------- host wrappers
def seg_amax(x2, rows_per_group: int, amax_bits, bad, *, elems=8192, num_warps=4):
    """amax_bits (int32 [M / rows_per_group], zeroed by the caller) = per-group max|x| bits; bad (int32 [1])
    += number of non-finite elements. x2: contiguous [M, K] bf16/fp16/fp32 CUDA tensor, K even. elems / num_warps:
    pairs per program and warps (launch shape only: the result does not depend on them)."""
    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    m, k = x2.shape
    if not (m and k):
        return
    xp = pair_view(x2)
    np_ = xp.shape[1]
    bp = min(1024, max(16, 1 << (np_ - 1).bit_length()))
    bm = max(1, elems // bp)
    grid = (triton.cdiv(m, bm), triton.cdiv(np_, bp))
    _seg_amax_kernel[grid](xp, amax_bits, bad, m, np_, xp.stride(0), rows_per_group, IN_DTYPE=in_dtype_code(x2.dtype),
                           BLOCK_M=bm, BLOCK_P=bp, num_warps=num_warps, **LAUNCH_OPTS)


def nvfp4_segment(x2, g, rows_per_group: int, rows_per_member: int, data, scale, sdec, *, block_m=2, block_nb=128,
                  num_warps=2):
    """Per-tensor (or share-scale-group) NVFP4 1x16 of every member of a segment, written into the given outputs:
    data uint8 [M, K/2], scale uint8 [M, K/16], sdec fp32 [M / rows_per_member]; g fp32 [M / rows_per_group].
    block_m / block_nb / num_warps: the launch shape (rows, 16-element blocks per program; the bytes do not depend
    on it)."""
    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    m, k = x2.shape
    nb = k // 16
    if not (m and k):
        return
    xp = pair_view(x2)
    bnb = min(block_nb, max(1, 1 << (nb - 1).bit_length()))
    grid = (triton.cdiv(m, block_m), triton.cdiv(nb, bnb))
    _nvfp4_seg_kernel[grid](xp, data, scale, g, sdec, m, nb, xp.stride(0), data.stride(0), scale.stride(0),
                            rows_per_group, rows_per_member, IN_DTYPE=in_dtype_code(x2.dtype), BLOCK_M=block_m,
                            BLOCK_NB=bnb, num_warps=num_warps, **LAUNCH_OPTS)


def item_blocks_for(rows_per_member: int, k: int, want: int = 256) -> int:
    """The item size (16-element blocks, a power of two <= want, >= 16) of the item kernels for members of
    rows_per_member rows of K elements: it must divide a member's block count (an item never straddles a member,
    hence never a group). 0 when none does (the row-tile kernels take the segment)."""
    nb = rows_per_member * (k // 16)
    ib = want
    while ib >= 16 and nb % ib:
        ib //= 2
    return ib if ib >= 16 else 0


def _item_args(x2, rows_per_group, rows_per_member, outs, ib):
    """Checks shared by the item kernels; returns (pair words, items, items per group, items per member)."""
    from ._common import pair_view

    m, k = x2.shape
    nb = k // 16
    if not ib or (rows_per_member * nb) % ib or rows_per_group % rows_per_member or m % rows_per_group:
        raise ValueError(f"item of {ib} blocks does not tile members of {rows_per_member} x {nb} blocks")
    if not (x2.is_contiguous() and all(o.is_contiguous() for o in outs)):
        raise ValueError("the item kernels need a contiguous segment and contiguous outputs")
    return pair_view(x2), m * nb // ib, rows_per_group * nb // ib, rows_per_member * nb // ib


def nvfp4_segment_items(x2, rows_per_group: int, rows_per_member: int, data, scale, sdec, bad, input_scale=None, *,
                        amax_bits=None, item_blocks=None, amax_item_blocks=None, num_warps=4, amax_num_warps=8):
    """seg_amax + nvfp4_segment by the item kernels: the segment (contiguous [M, K], outputs contiguous) as a flat
    run of items of item_blocks 16-element blocks (default: item_blocks_for(.., 256)), one item per program, no
    padded lanes for any K; the amax pass on items of amax_item_blocks (default: up to 1024 blocks). Same bytes and
    non-finite count as the row-tile kernels. input_scale (fp32 [M / rows_per_member]) is filled with 1.0 in the
    quantize launch when given; amax_bits (int32 [M / rows_per_group], zeroed) receives the group amaxes when given,
    else a zeroed workspace is used."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code

    m, k = x2.shape
    if not (m and k):
        return
    ib = item_blocks or item_blocks_for(rows_per_member, k)
    iba = amax_item_blocks or item_blocks_for(rows_per_member, k, 1024)
    xp, n_items, ipg, ipm = _item_args(x2, rows_per_group, rows_per_member, (data, scale, sdec), ib)
    _, n_amax, ipg_a, _ = _item_args(x2, rows_per_group, rows_per_member, (), iba)
    bits = amax_bits if amax_bits is not None else torch.zeros(m // rows_per_group, dtype=torch.int32,
                                                               device=x2.device)
    code = in_dtype_code(x2.dtype)
    _seg_amax_items_kernel[(n_amax,)](xp, bits, bad, ipg_a, IN_DTYPE=code, IB=iba, num_warps=amax_num_warps,
                                      **LAUNCH_OPTS)
    isc = input_scale if input_scale is not None else sdec
    _nvfp4_seg_items_kernel[(n_items,)](xp, data, scale, bits.view(torch.float32), sdec, isc, ipg, ipm,
                                        IN_DTYPE=code, IB=ib, HAS_ISC=input_scale is not None,
                                        num_warps=num_warps, **LAUNCH_OPTS)


# The predicted kernel's launch shape: items of PREDICTED_ITEM_BLOCKS 16-element blocks (the largest power of two
# <= it that tiles a member: item_blocks_for), PREDICTED_NUM_WARPS warps a program - chosen on the H200 by
# `python benchmarks/weight_update_gpu.py --kernel-sweep` (benchmarks/RESULTS.md); the bytes do not depend on it.
PREDICTED_ITEM_BLOCKS = 256
PREDICTED_NUM_WARPS = 2
# ptx .maxnreg of the predicted kernel (None: the compiler's choice, 126 registers for the bucket kernel at 256 x 2).
# 96 fits 10 programs an SM instead of 8, without spills (offline sm_90 compile: 96 registers, 0 local bytes; 80
# spills 40 bytes), leaving room for the two-lane update's copies beside them. H200, session 20, 1.34B model,
# interleaved rounds: NVFP4 update 1.410 ms at 96, 1.438 at 80, 1.496 ms without (0.83x / 0.81x / 0.88x BF16);
# 30.5B 23.80 / 25.27 / 24.16 ms (benchmarks/RESULTS.md). The benchmark's r<N> modes set it.
PREDICTED_MAXNREG = 96
REDO_PROGRAMS_PER_GROUP = 32  # programs per group of the redo launch (each walks 1/32 of a changed group's items)


def predicted_opts() -> dict:
    """Launch options of the predicted kernel beyond LAUNCH_OPTS, read at launch time (the interpreter drops them,
    as it drops LAUNCH_OPTS)."""
    return {"maxnreg": PREDICTED_MAXNREG} if PREDICTED_MAXNREG else {}


def nvfp4_segment_predicted(x2, rows_per_group: int, rows_per_member: int, data, scale, sdec, bad, prev_bits,
                            input_scale=None, *, amax_bits=None, item_blocks=None, num_warps=None):
    """seg_amax + nvfp4_segment from ONE read of the weights whenever their group amaxes are those of the previous
    update: prev_bits (int32 [M / rows_per_group], kept by the caller across updates; any value that is no amax,
    e.g. -1, on the first) holds the group amaxes (fp32 bits) of the last call. _nvfp4_seg_predicted_kernel reads
    each item once, takes its amax and quantizes it with the predicted group amax; _nvfp4_seg_redo_kernel then
    re-quantizes, with the true amax, exactly the groups whose amax changed, and prev_bits becomes the true amaxes.
    The bytes are always those of the two-pass kernels (the prediction only decides how much is read twice); a
    bf16 weight's max |x| is a bf16 value, which an optimizer step rarely moves. Layout rules, input_scale and
    amax_bits as nvfp4_segment_items."""
    import torch

    m, k = x2.shape
    if not (m and k):
        return
    ib = item_blocks or item_blocks_for(rows_per_member, k, PREDICTED_ITEM_BLOCKS)
    _item_args(x2, rows_per_group, rows_per_member, (data, scale, sdec), ib)
    if prev_bits.shape != (m // rows_per_group,) or prev_bits.dtype != torch.int32:
        raise ValueError(f"prev_bits must be int32 [{m // rows_per_group}] (one per group)")
    bits = amax_bits if amax_bits is not None else torch.zeros(m // rows_per_group, dtype=torch.int32,
                                                               device=x2.device)
    predicted_launches(x2, rows_per_group, rows_per_member, data, scale, sdec, bad, bits, prev_bits, input_scale,
                       item_blocks=ib, num_warps=num_warps)
    prev_bits.copy_(bits)


def predicted_launches(x2, rows_per_group: int, rows_per_member: int, data, scale, sdec, bad, bits, prev_bits,
                       input_scale=None, *, item_blocks: int, num_warps: int | None = None) -> None:
    """The two launches of nvfp4_segment_predicted (quantize with prev_bits while taking the true group amaxes
    into bits - zero on entry -, then the redo of the groups whose amax moved), leaving bits and prev_bits to the
    caller (a weight-update bucket keeps them for several segments and rolls them in one launch)."""
    args = (x2, rows_per_group, rows_per_member, data, scale, sdec, bad, bits, prev_bits, input_scale)
    predicted_kernel_launch(*args, item_blocks=item_blocks, num_warps=num_warps)
    redo_kernel_launch(*args, item_blocks=item_blocks, num_warps=num_warps)


def _predicted_meta(x2, rows_per_group, rows_per_member, data, scale, sdec, input_scale, item_blocks, num_warps):
    from ._common import LAUNCH_OPTS, in_dtype_code

    xp, n_items, ipg, ipm = _item_args(x2, rows_per_group, rows_per_member, (data, scale, sdec), item_blocks)
    meta = dict(IN_DTYPE=in_dtype_code(x2.dtype), IB=item_blocks, HAS_ISC=input_scale is not None,
                num_warps=num_warps or PREDICTED_NUM_WARPS, **LAUNCH_OPTS)
    return xp, n_items, ipg, ipm, (input_scale if input_scale is not None else sdec), meta


def predicted_kernel_launch(x2, rows_per_group, rows_per_member, data, scale, sdec, bad, bits, prev_bits,
                            input_scale=None, *, item_blocks: int, num_warps: int | None = None) -> None:
    """The first of predicted_launches' two launches (quantize with prev_bits, the true amaxes into bits)."""
    xp, n_items, ipg, ipm, isc, meta = _predicted_meta(x2, rows_per_group, rows_per_member, data, scale, sdec,
                                                       input_scale, item_blocks, num_warps)
    _nvfp4_seg_predicted_kernel[(n_items,)](xp, data, scale, bits, prev_bits, sdec, isc, bad, ipg, ipm, **meta,
                                            **predicted_opts())


def redo_kernel_launch(x2, rows_per_group, rows_per_member, data, scale, sdec, bad, bits, prev_bits,
                       input_scale=None, *, item_blocks: int, num_warps: int | None = None) -> None:
    """The second of predicted_launches' two launches (re-quantize the groups whose amax moved), ordered after the
    first by the caller (same stream, or a stream that waits for it)."""
    m = x2.shape[0]
    xp, n_items, ipg, ipm, isc, meta = _predicted_meta(x2, rows_per_group, rows_per_member, data, scale, sdec,
                                                       input_scale, item_blocks, num_warps)
    per_group = min(ipg, REDO_PROGRAMS_PER_GROUP)
    _nvfp4_seg_redo_kernel[(m // rows_per_group, per_group)](xp, data, scale, bits, prev_bits, sdec, isc, ipg, ipm,
                                                             per_group, **meta)


FUSED_CHUNK_BYTES = 24 << 20  # input bytes per chunk (whole groups, at least one): chunks c and c-1 stay in L2


def _resident_per_sm(compiled, num_warps: int, device) -> int:
    """How many programs of a compiled kernel one SM holds at once (registers, shared memory, threads, the
    32-block limit): the one-pass kernel's programs wait for each other, so all of them must be resident."""
    import torch

    props = torch.cuda.get_device_properties(device)
    init = getattr(compiled, "_init_handles", None)
    if init is not None:
        init()
    regs = int(getattr(compiled, "n_regs", 0) or 0)
    shared = int(getattr(compiled.metadata, "shared", 0) or 0)
    threads = 32 * num_warps
    if regs <= 0:
        return 1
    by_regs = props.regs_per_multiprocessor // (-(-regs * 32 // 256) * 256 * num_warps)
    by_threads = props.max_threads_per_multi_processor // threads
    by_smem = props.shared_memory_per_multiprocessor // shared if shared else 32
    return max(1, min(32, by_regs, by_threads, by_smem))


def nvfp4_segment_fused(x2, rows_per_group: int, rows_per_member: int, data, scale, sdec, bad=None, input_scale=None,
                        *, amax_bits=None, chunk_bytes=FUSED_CHUNK_BYTES, item_blocks=None, num_warps=4,
                        programs_per_sm=4):
    """seg_amax + nvfp4_segment in ONE launch that reads the weights from HBM once (_nvfp4_seg_onepass_kernel;
    same bytes and non-finite count). Layout rules and input_scale / amax_bits as nvfp4_segment_items; bad None:
    the count goes to the workspace. chunk_bytes: input bytes per chunk (whole groups, at least one);
    programs_per_sm: persistent programs per SM, capped by what the compiled kernel lets one SM hold (all must be
    resident); item_blocks / num_warps: launch shape. The bytes do not depend on any of these. Returns the group
    amax bits (int32 [M / rows_per_group]: amax_bits, or the workspace's)."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code

    m, k = x2.shape
    n_groups = m // rows_per_group if rows_per_group else 0
    if not (m and k):
        return amax_bits if amax_bits is not None else torch.zeros(n_groups, dtype=torch.int32, device=x2.device)
    ib = item_blocks or item_blocks_for(rows_per_member, k)
    xp, n_items, ipg, ipm = _item_args(x2, rows_per_group, rows_per_member, (data, scale, sdec), ib)
    group_bytes = rows_per_group * k * x2.element_size()
    ipc = max(1, chunk_bytes // group_bytes) * ipg
    n_chunks = -(-n_items // ipc)
    # one zeroed workspace (one memset): [done per chunk, non-finite count, group amax bits]
    ws = torch.zeros(n_chunks + 1 + (0 if amax_bits is not None else n_groups), dtype=torch.int32,
                     device=x2.device)
    bits = amax_bits if amax_bits is not None else ws[n_chunks + 1:]
    isc = input_scale if input_scale is not None else sdec
    args = (xp, data, scale, bits, sdec, isc, bad if bad is not None else ws[n_chunks:n_chunks + 1], ws, n_items,
            ipc, ipg, ipm, n_chunks)
    meta = dict(IN_DTYPE=in_dtype_code(x2.dtype), IB=ib, HAS_ISC=input_scale is not None, num_warps=num_warps,
                **LAUNCH_OPTS)
    if x2.device.type != "cuda":
        programs = 1  # the interpreter runs programs one after another: one program does every item in order
    else:
        key = (x2.device.index, meta["IN_DTYPE"], ib, meta["HAS_ISC"], num_warps)
        per_sm = _RESIDENT.get(key)
        if per_sm is None:
            per_sm = _RESIDENT[key] = _resident_per_sm(
                _nvfp4_seg_onepass_kernel.warmup(*args, grid=(1,), **meta), num_warps, x2.device)
        sms = torch.cuda.get_device_properties(x2.device).multi_processor_count
        programs = sms * max(1, min(programs_per_sm, per_sm))
    _nvfp4_seg_onepass_kernel[(max(1, min(programs, n_items)),)](*args, **meta)
    return bits


# programs of the one-pass kernel one SM holds, per (device, dtype code, item blocks, input_scale, warps): a property
# of the compiled kernel, read once
_RESIDENT: dict = {}

def check_copy(x, out, bad):
    """Count non-finite elements of the contiguous float tensor x into bad (int32 [1]); copy its bytes into out
    (a uint8 buffer of x's byte size) when out is given - one read of x either way."""
    import torch

    from ._common import LAUNCH_OPTS

    n = x.numel()
    if n == 0:
        return
    block = 4096
    if x.dtype == torch.bfloat16:
        w = x.reshape(-1).view(torch.int16)
        o = out.view(torch.int16) if out is not None else w
        _check_copy_bf16_kernel[(triton.cdiv(n, block),)](w, o, bad, n, DO_COPY=out is not None, BLOCK=block,
                                                          num_warps=8, **LAUNCH_OPTS)
        return
    w = x.reshape(-1).view(torch.int32 if x.dtype == torch.float32 else torch.int16)
    o = out.view(w.dtype) if out is not None else w
    _check_copy_kernel[(triton.cdiv(n, block),)](w, o, bad, n, IS_F32=x.dtype == torch.float32,
                                                 DO_COPY=out is not None, BLOCK=block, num_warps=8, **LAUNCH_OPTS)


MULTI_COPY_BLOCK = 4096  # elements per program of multi_check_copy (one table row)


def multi_copy_table(pieces: list, base, device):
    """The per-block table of multi_check_copy for pieces [(source tensor, destination element offset)], all of
    base's dtype and contiguous: (int64 [blocks, 3] tensor on device, aligned flag). Built once (at bind time)."""
    import torch

    es = base.element_size()
    rows = []
    for x, dst in pieces:
        d = x.data_ptr() - base.data_ptr()
        if d % es:
            raise ValueError("source not element-aligned with the base tensor")
        src, n = d // es, x.numel()
        rows += [(src + o, dst + o, min(MULTI_COPY_BLOCK, n - o)) for o in range(0, n, MULTI_COPY_BLOCK)]
    aligned = all(v % 8 == 0 for r in rows for v in r) and base.data_ptr() % 16 == 0
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 3).to(device), aligned


def multi_check_copy(base, out, table, aligned: bool, bad):
    """Copy every table row's elements from the address space of `base` (a tensor of the pieces' dtype) into the
    uint8 buffer `out` and count non-finite elements into bad (int32 [1]), in one launch."""
    import torch

    from ._common import LAUNCH_OPTS

    n = table.shape[0]
    if n == 0:
        return
    kind = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}[base.dtype]
    word = torch.int32 if kind == 2 else torch.int16
    _multi_check_copy_kernel[(n,)](base.view(word), out.view(word), table, bad, KIND=kind, ALIGNED=aligned,
                                   BLOCK=MULTI_COPY_BLOCK, num_warps=4, **LAUNCH_OPTS)


@triton.jit
def _fingerprint_kernel(w_ptr, out_ptr, N, NBLK, STRIDE, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    blk = tl.where(pid * STRIDE < NBLK, pid * STRIDE, NBLK - 1)  # every STRIDE-th block, and the last one
    offs = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    w = tl.load(w_ptr + offs, mask=m, other=0).to(tl.int64)
    # position-weighted sum mod 2^64 (odd multipliers): any single changed or swapped word changes it
    acc = tl.sum(w * (offs * 2654435761 + 1), axis=0)
    tl.atomic_add(out_ptr, acc, sem="relaxed")


FINGERPRINT_BLOCK_WORDS = 8192  # 32 KB per block


def fingerprint(buf, out, stride: int = 1):
    """out (int64 [1], zeroed) += position-weighted sum of the int32 words of the uint8 buffer `buf` (its size a
    multiple of 4): a cheap on-GPU digest of a weight-update bucket, compared by both ends (order-independent
    atomics, so deterministic). stride > 1 samples: every stride-th 32 KB block plus the last block (1/stride of
    the bytes read). A sampled digest still catches a bucket landing in the wrong buffer or at the wrong offset,
    a short or missing transfer and a stale buffer (every weight changes between updates), but not a corrupted
    word outside the sampled blocks; stride 1 covers every word."""
    import torch

    from ._common import LAUNCH_OPTS

    w = buf.view(torch.int32)
    n = w.numel()
    if n:
        nblk = triton.cdiv(n, FINGERPRINT_BLOCK_WORDS)
        grid = triton.cdiv(nblk, stride) + (1 if (nblk - 1) % stride else 0)
        _fingerprint_kernel[(grid,)](w, out, n, nblk, stride, BLOCK=FINGERPRINT_BLOCK_WORDS, num_warps=8,
                                     **LAUNCH_OPTS)
