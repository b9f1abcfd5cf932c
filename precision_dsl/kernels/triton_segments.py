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
    written once per member.
  * `_nvfp4_seg_fused_kernel`: both of the above in ONE launch and (mostly) one HBM read of the weights: a
    persistent work queue whose amax tiles of an L2-sized chunk of groups are dequeued before that chunk's quantize
    tiles, so the quantize tiles re-read the chunk from L2 (see `nvfp4_segment_fused`).
  * `_multi_check_copy_kernel`: `_check_copy_kernel` over MANY small tensors in one launch (the norms, routers and
    small attention weights of a bucket), driven by a per-block table built once: a bucket's small pieces no
    longer cost a launch each.
  * `_check_copy_kernel`: copy raw 16/32-bit words into the wire buffer and count non-finite elements in the same
    pass (high-precision segments), or count only (MXFP8 / FP8-block segments, whose kernels do not report it).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._common import unpack_pair
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
def _tile_amax(u, IN_DTYPE: tl.constexpr):
    """(per-row amax fp32 bits [BM], non-finite count) of a [BM, BNB, 8] tile of pair words: the arithmetic of
    _seg_amax_kernel (the bf16 integer-magnitude path, the NaN-ignoring float path otherwise), so that the fused
    kernel's group amaxes are bit for bit seg_amax's."""
    if IN_DTYPE == 0:
        mlo = u & 0x7FFF
        mhi = (u >> 16) & 0x7FFF
        a_bits = tl.max(tl.max(tl.maximum(mlo, mhi), axis=2), axis=1) << 16
        nf = tl.sum(tl.sum(tl.sum((mlo >= 0x7F80).to(tl.int32) + (mhi >= 0x7F80).to(tl.int32), axis=2), axis=1),
                    axis=0)
    else:
        lo, hi = unpack_pair(u, IN_DTYPE)
        alo = tl.abs(lo)
        ahi = tl.abs(hi)
        a = tl.maximum(tl.max(tl.max(tl.maximum(alo, ahi), axis=2), axis=1), 0.0)
        a_bits = a.to(tl.int32, bitcast=True)
        nf = tl.sum(tl.sum(tl.sum((~(alo <= 3.4028234663852886e38)).to(tl.int32)
                                  + (~(ahi <= 3.4028234663852886e38)).to(tl.int32), axis=2), axis=1), axis=0)
    return a_bits, nf


@triton.jit
def _nvfp4_seg_fused_kernel(xp_ptr, data_ptr, scale_ptr, bits_ptr, sdec_ptr, isc_ptr, bad_ptr, ctr_ptr, done_ptr,
                            M, NB, stride_xp, stride_d, stride_s, RPG, RPM, CHUNK_ROWS, N_CHUNKS, TM, TN,
                            IN_DTYPE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_NB: tl.constexpr,
                            HAS_ISC: tl.constexpr):
    """seg_amax + nvfp4_segment in one persistent launch. Work items are tiles of BLOCK_M rows x BLOCK_NB blocks,
    T = TM * TN of them per chunk (CHUNK_ROWS rows = whole groups, sized to stay in L2), queued as
        [amax c0][amax c1][quant c0][amax c2][quant c1] ... [amax c(n-1)][quant c(n-2)][quant c(n-1)]
    and taken in that order by an atomic counter. An amax tile max-es its rows' group amax bits, then counts itself
    done for its chunk (release, after a CTA barrier so every thread's atomic is ordered before it); a quantize tile
    waits (acquire) until its chunk's T amax tiles are done, then quantizes like _nvfp4_seg_kernel. No deadlock:
    every amax tile of chunk c was dequeued - by a running program, and amax tiles never wait - before any
    quantize tile of c. Under the interpreter the programs run one after another, the first taking every item in
    queue order, so the wait is always already satisfied there."""
    stride_xp = tl.multiple_of(stride_xp, 8)  # K/2 pair words with K % 16 == 0
    stride_d = tl.multiple_of(stride_d, 8)
    T = TM * TN
    last = 2 * N_CHUNKS - 1
    n_items = 2 * N_CHUNKS * T
    item = tl.atomic_add(ctr_ptr, 1, sem="relaxed")
    while item < n_items:
        b = item // T
        t = item % T
        is_q = (b == last) | ((b % 2 == 0) & (b > 0))
        c = tl.where(b == last, N_CHUNKS - 1, tl.where(b % 2 == 1, (b + 1) // 2, b // 2 - 1))
        c = tl.maximum(c, 0)  # b == 0: amax of chunk 0
        tm = t // TN
        tn = t % TN
        in_chunk = tm * BLOCK_M + tl.arange(0, BLOCK_M)
        rows = c * CHUNK_ROWS + in_chunk
        rmask = (rows < M) & (in_chunk < CHUNK_ROWS)
        nb = tn * BLOCK_NB + tl.arange(0, BLOCK_NB)
        bmask = nb < NB
        r64 = rows.to(tl.int64)
        u = tl.load(xp_ptr + _pair_offsets(r64, stride_xp, nb), mask=rmask[:, None, None] & bmask[None, :, None],
                    other=0)
        if is_q:
            # spin on plain volatile loads (no read-modify-write traffic on the counter the amax tiles are still
            # incrementing), then one acquire RMW orders the group-amax reads after the chunk's release
            cnt = tl.load(done_ptr + c, volatile=True)
            while cnt < T:
                cnt = tl.load(done_ptr + c, volatile=True)
            tl.atomic_add(done_ptr + c, 0, sem="acquire")
            # volatile: past L1, which may hold a line of group amaxes read before a later chunk was complete
            g = tl.load(bits_ptr + rows // RPG, mask=rmask, other=0, volatile=True).to(tl.float32, bitcast=True)
            lo, hi = unpack_pair(u, IN_DTYPE)
            s_enc, s_dec = _global_scales(g)
            first = rmask & (rows % RPM == 0) & (tn == 0)
            tl.store(sdec_ptr + rows // RPM, s_dec, mask=first)
            if HAS_ISC:  # ModelOpt input_scale (unused with per-token activations): 1.0 per member
                tl.store(isc_ptr + rows // RPM, tl.full(s_dec.shape, 1.0, tl.float32), mask=first)
            sf, packed = _encode_blocks(lo, hi, _block_amax(lo, hi), s_enc[:, None], s_dec[:, None])
            tl.store(scale_ptr + r64[:, None] * stride_s + nb[None, :], sf, mask=rmask[:, None] & bmask[None, :])
            tl.store(data_ptr + _pair_offsets(r64, stride_d, nb), packed,
                     mask=rmask[:, None, None] & bmask[None, :, None])
        else:
            a_bits, nf = _tile_amax(u, IN_DTYPE)
            tl.atomic_max(bits_ptr + rows // RPG, a_bits, mask=rmask, sem="relaxed")
            if nf > 0:
                tl.atomic_add(bad_ptr, nf, sem="relaxed")
            tl.debug_barrier()
            tl.atomic_add(done_ptr + c, 1, sem="release")
        item = tl.atomic_add(ctr_ptr, 1, sem="relaxed")


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


FUSED_CHUNK_BYTES = 16 << 20  # input bytes per chunk: two chunks in flight (amax of c+1, quantize of c) fit in L2


def _programs_for(device, programs_per_sm: int) -> int:
    import torch

    if device.type != "cuda":
        return 3  # the interpreter: a few programs, run one after another
    return torch.cuda.get_device_properties(device).multi_processor_count * programs_per_sm


def nvfp4_segment_fused(x2, rows_per_group: int, rows_per_member: int, data, scale, sdec, bad, input_scale=None, *,
                        amax_bits=None, chunk_bytes=FUSED_CHUNK_BYTES, block_m=4, block_nb=128, num_warps=4,
                        programs_per_sm=4):
    """seg_amax + nvfp4_segment in one launch (same bytes, same non-finite count into bad): the weights are read
    from HBM once, their second (quantize) read hitting L2 (see _nvfp4_seg_fused_kernel). input_scale (fp32
    [M / rows_per_member]) is filled with 1.0 in the same launch when given. amax_bits (int32 [M / rows_per_group],
    zeroed) receives the group amaxes when given (tests), else a workspace is used. chunk_bytes: input bytes per
    chunk (whole groups, at least one); block_m / block_nb / num_warps / programs_per_sm: the launch shape (the
    bytes do not depend on it)."""
    import torch

    from ._common import LAUNCH_OPTS, in_dtype_code, pair_view

    m, k = x2.shape
    nb = k // 16
    if not (m and k):
        return
    xp = pair_view(x2)
    n_groups = m // rows_per_group
    group_bytes = rows_per_group * k * x2.element_size()
    chunk_rows = max(1, chunk_bytes // group_bytes) * rows_per_group
    n_chunks = triton.cdiv(m, chunk_rows)
    bnb = min(block_nb, max(1, 1 << (nb - 1).bit_length()))
    tm, tn = triton.cdiv(min(chunk_rows, m), block_m), triton.cdiv(nb, bnb)
    # one zeroed workspace (one memset): [work counter, done per chunk, group amax bits]
    ws = torch.zeros(1 + n_chunks + (0 if amax_bits is not None else n_groups), dtype=torch.int32, device=x2.device)
    bits = amax_bits if amax_bits is not None else ws[1 + n_chunks:]
    grid = (max(1, min(2 * n_chunks * tm * tn, _programs_for(x2.device, programs_per_sm))),)
    isc = input_scale if input_scale is not None else sdec
    _nvfp4_seg_fused_kernel[grid](xp, data, scale, bits, sdec, isc, bad, ws, ws[1:], m, nb, xp.stride(0),
                                  data.stride(0), scale.stride(0), rows_per_group, rows_per_member, chunk_rows,
                                  n_chunks, tm, tn, IN_DTYPE=in_dtype_code(x2.dtype), BLOCK_M=block_m,
                                  BLOCK_NB=bnb, HAS_ISC=input_scale is not None, num_warps=num_warps, **LAUNCH_OPTS)


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
