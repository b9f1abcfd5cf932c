"""Bucket launches for the live weight update: every quantized segment of one bucket in ONE kernel launch.

A weight-update bucket holds several segments (a layer's expert gate/up, its down_proj, its q/k/v/o projections),
each a separate input tensor quantized into its own regions of the bucket buffer. One launch per segment costs, on
top of the kernel, a launch gap and a wave tail (the last partial wave of programs, during which most SMs idle)
each; on a 1.34B model whose segments are 2-67 MB that is a third of the update. Here the programs of all of a
bucket's segments form one grid: program p reads its segment's row from a per-program row map (one int8 load),
then that row of a small table built once at bind time (the segments' first program and input / output
offsets), then runs exactly the per-item code of the one-segment kernels (`triton_segments._predicted_item` /
`_redo_group`, `triton_mxfp8._mxfp8_row_item`) on that segment's pointers, so the bytes are those of the one-segment
kernels by construction (and tested against them).

Inputs are addressed from one base tensor (the first segment's input; the others as element offsets from it, one
address space), outputs as byte offsets into the bucket buffer, so the table does not depend on which buffer a
launch fills (a receiver's new buffers need no new table).

  * `NVFP4BucketLaunch`: the predicted NVFP4 kernel (one read quantizes with the previous update's group amaxes
    while taking the true ones; see triton_segments.nvfp4_segment_predicted) over all of a bucket's NVFP4 item
    segments, then one redo launch over all their groups, then one launch that keeps the true amaxes as the next
    prediction and zeroes the accumulators (`_roll_kernel`: no memset and no copy per segment).
  * `MXFP8BucketLaunch`: the flat rowwise 1x32 MXFP8 kernel over all of a bucket's contiguous MXFP8 inputs (stacked
    segments and the separate q/k/v members alike).
Inputs of SOLO_BYTES or more keep a launch of their own with the one-segment kernels (still without a memset or
copy per segment: their group amaxes live in the bucket's arrays and roll with them).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .triton_mxfp8 import _mxfp8_row_item
from .triton_segments import _predicted_item, _redo_group

MAX_SEGMENTS = 64  # table rows of one launch (the redo's binary search: log2 of it loads); more -> more launches
_BIG = 1 << 62  # every column of the padding rows: past every key


@triton.jit
def _row_of(table_ptr, key, COL: tl.constexpr, W: tl.constexpr, LOG_ROWS: tl.constexpr):
    """The table row whose column COL (ascending from 0 in row 0; the table padded to 2^LOG_ROWS rows with _BIG
    in every column) is the last one <= key: a binary search of LOG_ROWS scalar loads (none for one row), so a
    program spends a few uniform instructions, not a cross-warp reduction, on finding its segment."""
    row = key * 0
    for step in tl.static_range(LOG_ROWS):
        cand = row + (1 << (LOG_ROWS - 1 - step))
        row = tl.where(tl.load(table_ptr + cand * W + COL) <= key, cand, row)
    return row


# NVFP4 table columns (int64): first item, first group, input offset (pair words from the base), data, scale (bytes
# into the bucket), S_dec, input_scale (fp32 words into the bucket), items per group, items per member


@triton.jit
def _nv_row(table_ptr, row, ALIGNED: tl.constexpr):
    base = table_ptr + row * 9
    x_off = tl.load(base + 2)  # offsets int64 (inputs are separate allocations); counts int32 (cheap division)
    d_off = tl.load(base + 3)
    s_off = tl.load(base + 4)
    if ALIGNED:  # every input and output starts on 16 bytes (checked when the table is built): vector accesses
        x_off = tl.multiple_of(x_off, 4)
        d_off = tl.multiple_of(d_off, 16)
        s_off = tl.multiple_of(s_off, 16)
    return (tl.load(base).to(tl.int32), tl.load(base + 1).to(tl.int32), x_off, d_off, s_off, tl.load(base + 5),
            tl.load(base + 6), tl.load(base + 7).to(tl.int32), tl.load(base + 8).to(tl.int32))


@triton.jit
def _nvfp4_bucket_predicted_kernel(xp_ptr, buf_ptr, buf32_ptr, bits_ptr, prev_ptr, bad_ptr, table_ptr, rowmap_ptr,
                                   IN_DTYPE: tl.constexpr, IB: tl.constexpr, ALIGNED: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(rowmap_ptr + p).to(tl.int32)  # one load, then the row's columns in parallel
    first, g0, x_off, d_off, s_off, sd_off, is_off, ipg, ipm = _nv_row(table_ptr, row, ALIGNED)
    _predicted_item(xp_ptr + x_off, buf_ptr + d_off, buf_ptr + s_off, bits_ptr + g0, prev_ptr + g0,
                    buf32_ptr + sd_off, buf32_ptr + is_off, bad_ptr, p - first, ipg, ipm, IN_DTYPE, IB, True)


@triton.jit
def _nvfp4_bucket_redo_kernel(xp_ptr, buf_ptr, buf32_ptr, bits_ptr, prev_ptr, table_ptr, S,
                              IN_DTYPE: tl.constexpr, IB: tl.constexpr, ALIGNED: tl.constexpr,
                              LOG_ROWS: tl.constexpr):
    grp = tl.program_id(0)
    row = _row_of(table_ptr, grp, 1, 9, LOG_ROWS)
    _first, g0, x_off, d_off, s_off, sd_off, is_off, ipg, ipm = _nv_row(table_ptr, row, ALIGNED)
    _redo_group(xp_ptr + x_off, buf_ptr + d_off, buf_ptr + s_off, bits_ptr + g0, prev_ptr + g0, buf32_ptr + sd_off,
                buf32_ptr + is_off, grp - g0, tl.program_id(1), ipg, ipm, S, IN_DTYPE, IB, True)


@triton.jit
def _roll_kernel(bits_ptr, prev_ptr, N, BLOCK: tl.constexpr):
    """prev = bits (the true group amaxes become the next update's prediction), bits = 0 (the next update's
    atomic-max accumulators): after the redo launch, which is the last reader of both."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    tl.store(prev_ptr + offs, tl.load(bits_ptr + offs, mask=m), mask=m)
    tl.store(bits_ptr + offs, tl.zeros([BLOCK], tl.int32), mask=m)


# MXFP8 table columns (int64): first item, input offset (elements from the base), data, scale (bytes into the
# bucket), 32-element blocks


@triton.jit
def _mxfp8_bucket_kernel(x_ptr, buf_ptr, bad_ptr, table_ptr, rowmap_ptr, FMAX_RCP: tl.constexpr, E5M2: tl.constexpr,
                         IB: tl.constexpr, EVEN: tl.constexpr, ALIGNED: tl.constexpr, AMAX_SCREEN: tl.constexpr):
    p = tl.program_id(0)
    row = tl.load(rowmap_ptr + p).to(tl.int32)
    base = table_ptr + row * 5
    x_off = tl.load(base + 1)
    d_off = tl.load(base + 2)
    s_off = tl.load(base + 3)
    if ALIGNED:
        x_off = tl.multiple_of(x_off, 8)
        d_off = tl.multiple_of(d_off, 16)
        s_off = tl.multiple_of(s_off, 16)
    _mxfp8_row_item(x_ptr + x_off, buf_ptr + d_off, buf_ptr + s_off, bad_ptr, p - tl.load(base).to(tl.int32),
                    tl.load(base + 4), FMAX_RCP, E5M2, IB, EVEN, True, AMAX_SCREEN)


# ----------------------------------------------------------------------------------------------- host side
def _offset_from(base, x, unit: int) -> int:
    """Offset of x's first byte from base's, in units of `unit` bytes (both in one address space)."""
    d = x.data_ptr() - base.data_ptr()
    if d % unit:
        raise ValueError(f"input not {unit}-byte aligned with the bucket launch's base tensor")
    return d // unit


def _chunks(entries: list, n: int) -> list:
    return [entries[i:i + n] for i in range(0, len(entries), n)]


def _rowmap(counts: list, device):
    """int8 [sum(counts)]: the table row of every item of a launch (row r has counts[r] items), so program p finds
    its row with ONE load instead of a binary search's chain of dependent loads (at most MAX_SEGMENTS < 128 rows)."""
    import torch

    return torch.repeat_interleave(torch.arange(len(counts), dtype=torch.int8), torch.tensor(counts)).to(device)


def _padded_table(rows: list, device):
    """(int64 table padded to a power of two rows - the padding's columns all _BIG, past every key -, log2 rows)."""
    import torch

    log = (len(rows) - 1).bit_length()
    pad = [(_BIG,) * len(rows[0])] * ((1 << log) - len(rows))
    return torch.tensor(rows + pad, dtype=torch.int64, device=device), log


# Inputs of at least this many bytes keep a launch of their own (the one-segment kernels, their pointers as launch
# arguments): their launch gap and wave tail are a few % of their run time, while the table lookup that starts
# every program of a bucket launch (a chain of dependent scalar loads) cost the 30B model's 400-800 MB expert
# segments 5-8% (benchmarks/RESULTS.md, session 17). The 1.34B model's segments (2-67 MB) are all grouped.
SOLO_BYTES = 256 << 20


class NVFP4BucketLaunch:
    """The predicted NVFP4 kernel over several segments of one bucket: entries [(x2 contiguous [M, K] of one
    dtype, rows_per_group, rows_per_member, data_off, scale_off, sdec_off, isc_off)] - offsets in bytes into the
    bucket buffer - all tiled by items of `item_blocks` 16-element blocks (triton_segments.item_blocks_for).
    Segments of at least solo_bytes take the one-segment kernels (triton_segments.predicted_launches), the others
    share one launch (and one redo launch) per MAX_SEGMENTS; one roll launch ends the bucket. Keeps the group
    amaxes across updates (`prev_bits`, -1 = none: every group is redone on the first launch)."""

    def __init__(self, entries: list, item_blocks: int, device, max_segments: int = MAX_SEGMENTS,
                 solo_bytes: int = SOLO_BYTES):
        import torch

        from ._common import in_dtype_code, pair_view

        if not entries:
            raise ValueError("a bucket launch needs at least one segment")
        x0 = entries[0][0]
        self.code = in_dtype_code(x0.dtype)
        self.ib = item_blocks
        self.base = pair_view(x0.reshape(-1, x0.shape[-1]))
        word = self.base.element_size()
        for x2, rpg, rpm, _d, _s, sd_off, is_off in entries:
            m, k = x2.shape
            nb = k // 16
            if x2.dtype != x0.dtype or not x2.is_contiguous() or (rpm * nb) % item_blocks or rpg % rpm \
                    or m % rpg or sd_off % 4 or is_off % 4:
                raise ValueError(f"segment [{m}, {k}] does not fit a bucket launch of {item_blocks}-block items")
        # group numbering: the grouped entries' groups first and back to back (a launch's redo grid spans the
        # groups of its table rows and nothing else), then the solo entries'
        is_solo = [e[0].numel() * e[0].element_size() >= solo_bytes for e in entries]
        self.first_group = [0] * len(entries)  # entry i's groups: bits / prev_bits[first_group[i]:][:M_i / rpg_i]
        groups = 0
        for i in sorted(range(len(entries)), key=lambda i: is_solo[i]):  # stable: grouped, then solo, each in order
            self.first_group[i] = groups
            groups += entries[i][0].shape[0] // entries[i][1]
        self.solo = [(e, self.first_group[i]) for i, e in enumerate(entries) if is_solo[i]]
        grouped = [(e, self.first_group[i]) for i, e in enumerate(entries) if not is_solo[i]]
        self.groups = groups
        self.tables = []  # (table, log2 rows, row of each item, first group, groups) per launch of <= max_segments
        for part in _chunks(grouped, min(max_segments, MAX_SEGMENTS)):
            rows, counts, items, g_first = [], [], 0, part[0][1]
            for (x2, rpg, rpm, d_off, s_off, sd_off, is_off), g in part:
                m, k = x2.shape
                nb = k // 16
                rows.append((items, g - g_first, _offset_from(x0, x2, word), d_off, s_off, sd_off // 4, is_off // 4,
                             rpg * nb // item_blocks, rpm * nb // item_blocks))
                counts.append(m * nb // item_blocks)
                items += counts[-1]
            if items >= 1 << 31:
                raise ValueError("a bucket launch of 2^31 items or more")
            last = part[-1]
            self.tables.append((*_padded_table(rows, device), _rowmap(counts, device), g_first,
                                last[1] + last[0][0].shape[0] // last[0][1] - g_first))
        self.aligned = all(e[0][0].data_ptr() % 16 == 0 and e[0][3] % 16 == 0 and e[0][4] % 16 == 0
                           for e in grouped)
        self.bits = torch.zeros(groups, dtype=torch.int32, device=device)  # accumulators, zero between launches
        self.prev_bits = torch.full((groups,), -1, dtype=torch.int32, device=device)
        self._armed = False  # launches enqueued whose roll (re-zeroing bits) was not

    def launch(self, buf, bad, *, num_warps: int | None = None, tail=None) -> None:
        """Quantize every entry into the bucket buffer `buf` (uint8), NaN/Inf counted into bad (int32 [1]);
        num_warps: default triton_segments.PREDICTED_NUM_WARPS (launch shape only). tail: a CUDA stream for the
        redo and roll launches, ordered after the predicted launches (the caller joins it back), so that the next
        bucket's predicted launch need not wait for them; None: all on the current stream."""
        import contextlib

        import torch

        from ._common import LAUNCH_OPTS
        from .triton_segments import (PREDICTED_NUM_WARPS, REDO_PROGRAMS_PER_GROUP, predicted_kernel_launch,
                                      predicted_opts, redo_kernel_launch)

        num_warps = num_warps or PREDICTED_NUM_WARPS  # read at launch time (the benchmark's @shape modes set it)

        if self._armed:  # an earlier launch was cut off between its kernels: accumulators may hold its maxima
            self.bits.zero_()
        self._armed = True
        buf32 = buf.view(torch.float32)
        solo = []
        for (x2, rpg, rpm, d_off, s_off, sd_off, is_off), g0 in self.solo:
            m, k = x2.shape
            n = m // rpg
            solo.append((x2, rpg, rpm, buf[d_off:d_off + m * k // 2].view(m, k // 2),
                         buf[s_off:s_off + m * k // 16].view(m, k // 16), buf32[sd_off // 4:sd_off // 4 + m // rpm],
                         bad, self.bits[g0:g0 + n], self.prev_bits[g0:g0 + n],
                         buf32[is_off // 4:is_off // 4 + m // rpm]))
        meta = dict(IN_DTYPE=self.code, IB=self.ib, ALIGNED=self.aligned, num_warps=num_warps, **LAUNCH_OPTS)
        # every predicted launch, then every redo: each redo reads only its own launch's groups
        for args in solo:
            predicted_kernel_launch(*args, item_blocks=self.ib, num_warps=num_warps)
        for table, log, rowmap, g0, n_groups in self.tables:
            _nvfp4_bucket_predicted_kernel[(rowmap.numel(),)](self.base, buf, buf32, self.bits[g0:],
                                                              self.prev_bits[g0:], bad, table, rowmap,
                                                              **meta, **predicted_opts())
        ctx = contextlib.nullcontext()
        if tail is not None:
            tail.wait_stream(torch.cuda.current_stream(buf.device))
            ctx = torch.cuda.stream(tail)
        with ctx:
            for args in solo:
                redo_kernel_launch(*args, item_blocks=self.ib, num_warps=num_warps)
            for table, log, rowmap, g0, n_groups in self.tables:
                _nvfp4_bucket_redo_kernel[(n_groups, REDO_PROGRAMS_PER_GROUP)](
                    self.base, buf, buf32, self.bits[g0:], self.prev_bits[g0:], table, REDO_PROGRAMS_PER_GROUP,
                    LOG_ROWS=log, **meta)
            _roll_kernel[(triton.cdiv(self.groups, 1024),)](self.bits, self.prev_bits, self.groups, BLOCK=1024,
                                                            num_warps=4)
        self._armed = False


MXFP8_ITEM_BLOCKS = 64  # 32-element blocks per program (as triton_mxfp8.quantize_rows_flat)


class MXFP8BucketLaunch:
    """Rowwise MXFP8 (1x32, E8M0) of several contiguous inputs of one dtype into one bucket buffer: entries
    [(x2 contiguous [M, K], data_off, scale_off)], offsets in bytes into the bucket buffer; inputs of at least
    solo_bytes take triton_mxfp8.quantize_rows_flat alone, the others one launch per MAX_SEGMENTS."""

    def __init__(self, entries: list, device, element: str = "e4m3", item_blocks: int = MXFP8_ITEM_BLOCKS,
                 max_segments: int = MAX_SEGMENTS, solo_bytes: int = SOLO_BYTES):
        import torch

        if not entries:
            raise ValueError("a bucket launch needs at least one input")
        x0 = entries[0][0]
        self.base = x0.reshape(-1)
        self.element, self.ib = element, item_blocks
        es = x0.element_size()
        for x2, _d, _s in entries:
            if x2.dtype != x0.dtype or not x2.is_contiguous() or x2.shape[-1] % 32:
                raise ValueError(f"input {list(x2.shape)} does not fit an MXFP8 bucket launch")
        self.solo = [e for e in entries if e[0].numel() * es >= solo_bytes]
        grouped = [e for e in entries if e[0].numel() * es < solo_bytes]
        self.tables = []
        self.even = True
        for part in _chunks(grouped, min(max_segments, MAX_SEGMENTS)):
            rows, counts, items = [], [], 0
            for x2, d_off, s_off in part:
                n_blocks = x2.numel() // 32
                self.even &= n_blocks % item_blocks == 0
                rows.append((items, _offset_from(x0, x2, es), d_off, s_off, n_blocks))
                counts.append(triton.cdiv(n_blocks, item_blocks))
                items += counts[-1]
            if items >= 1 << 31:
                raise ValueError("a bucket launch of 2^31 items or more")
            # (table, row of each item): no padding, nothing searches it
            self.tables.append((torch.tensor(rows, dtype=torch.int64, device=device), _rowmap(counts, device)))
        self.aligned = all(e[0].data_ptr() % 16 == 0 and e[1] % 16 == 0 and e[2] % 16 == 0 for e in grouped)

    def launch(self, buf, bad, *, num_warps: int = 4) -> None:
        from ._common import LAUNCH_OPTS
        from . import triton_mxfp8

        for x2, d_off, s_off in self.solo:
            m, k = x2.shape
            triton_mxfp8.quantize_rows_flat(x2, buf[d_off:d_off + m * k].view(m, k),
                                            buf[s_off:s_off + m * k // 32].view(m, k // 32), self.element, bad=bad,
                                            num_warps=num_warps)
        for table, rowmap in self.tables:
            _mxfp8_bucket_kernel[(rowmap.numel(),)](self.base, buf, bad, table, rowmap,
                                                    FMAX_RCP=triton_mxfp8.FMAX_RCP[self.element],
                                                    E5M2=self.element == "e5m2", IB=self.ib, EVEN=self.even,
                                                    ALIGNED=self.aligned, AMAX_SCREEN=triton_mxfp8.ROW_AMAX_SCREEN,
                                                    num_warps=num_warps, **LAUNCH_OPTS)
