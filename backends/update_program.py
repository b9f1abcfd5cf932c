"""The GPU weight-update program: the plan's update compiled once into buckets of grouped kernel launches.

`WeightSender` uses it when the trainer's weights are CUDA tensors and the transport can take GPU buffers
(in-process or torch.distributed/NCCL). Built once per (plan, bucket size), it fixes:

* segments: runs of atomic units (fused siblings / share-scale groups, see weight_update.atomic_groups) of one layer
  with the same weight format and K, stacked along rows - e.g. all 128 experts' gate/up of a layer (interleaved
  gate_e, up_e as in Megatron's fc1) - quantized by ONE kernel launch (precision_dsl/kernels/triton_segments.py,
  triton_mxfp8, triton_fp8_block) straight into the wire buffer, or copied into it (high precision);
* the wire layout of every bucket: each output tensor's (name, dtype, shape, byte range), 256-byte aligned;
* which segments fall back to the per-unit path (`quantize.checkpoint_tensors`, then copied into place): formats
  without a segment kernel (NVFP4 per-row weight scales, 2-D tiles), unequal member shapes under NVFP4, dtype
  conversions of high-precision tensors.

Direct mode (trainer and rollout on one GPU, `InProcessTransport(persistent=True)`): the transport hands out the
receiver's own buffer of every bucket (`gpu_destination`) and the program quantizes / packs straight into it - no
pool buffer and no second copy (for BF16 the pack copy is the only copy); the receiver's weights are overwritten in
place, so an update aborted part-way leaves them torn and the receiver refuses them until a complete update lands
(weight_update.receiver.WeightReceiver.stale). NVFP4 segments are quantized over the segment as a flat run of
16-element-block items (no padded lanes for any K; the row-tile kernels padded K = 768 rows to 1024 lanes). By
default ("predicted", `triton_segments.nvfp4_segment_predicted`) one read of the weights quantizes them with the
group amaxes of the previous update, kept per segment, while taking the true ones, and a redo launch re-quantizes
only the groups whose amax moved - the bytes are always the two-pass ones, the weights are read twice only where a
step moved a group's max |bf16(w)| (benchmarks/amax_stability.py; every group on the first update). "items" is the
two-pass pair (amax, then quantize), "fused" a one-launch kernel that reads the weights once and is slower on the
H200 (its cross-program waits cost more than the second read), "tiles" the row-tile pair (benchmarks/RESULTS.md).
Rowwise MXFP8 segments take the flat 1x32 kernel (`triton_mxfp8.quantize_rows_flat`). A bucket's small high-precision pieces (norms, routers, small attention
weights) are copied and checked by one launch per dtype (`HpGroup`, tables built at bind time) instead of one each.

In direct mode the update runs in two lanes when it quantizes anything: the copies of the high-precision pieces
(bound by HBM) on the current stream, every bucket's quantize launches (bound by instructions) on a high-priority
side stream, joined before the sends - the receiver reads no bucket before the update closes, and each bucket has its
own buffer. On the 30B-shaped model the copies then fill the ~3.5 ms of gaps between the quantize launches (24.6 vs
27.8 ms for NVFP4 on an H200, benchmarks/RESULTS.md session 19). From the second update on, such an update replays
as ONE CUDA graph with its lanes as streams forked and joined inside it (`UpdateProgram._capture_whole`): no launch
gap between buckets, one host launch, and the NVFP4 bucket launches' redo / roll tails on a third stream so the next
bucket's quantize launch follows the last one directly; in that graph the copy lane has the high priority.

Per update (`run`), the host only launches kernels: no per-tensor Python when the inputs were bound once
(`bind`, zero-copy when the members of a segment are consecutive views of one buffer, as in Megatron's grouped
expert weights; otherwise one gather per segment), no host synchronisation until the single check of the on-GPU
non-finite counter at the end. Buckets are double-buffered: bucket k+1 is quantized while the transport moves
bucket k (the transport returns a handle the producer waits on - on the GPU, not the host - before it reuses a
buffer). Bytes are exactly those of `checkpoint_tensors` for each tensor (tests/test_weight_update_gpu.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from precision_dsl.plan import Plan, TensorPlan
from precision_dsl.format_specs import NVFP4_SPEC
from precision_dsl.precision import FormatKind
from precision_dsl.backends.quantize import needs_shared_amax, output_specs
from precision_dsl.backends.safetensors_io import DTYPE_SIZES

_ALIGN = 256

# How an NVFP4 segment (1x16 blocks, one second-level scale per member or share-scale group) is quantized:
#   "predicted": triton_segments.nvfp4_segment_predicted - ONE read of the weights quantizes them with the group
#            amaxes of the previous update (kept per segment in the Bound) while taking the true ones, and a redo
#            launch re-quantizes only the groups whose amax changed: the bytes are always the two-pass ones;
#   "items": triton_segments.nvfp4_segment_items - an amax launch and a quantize launch over the segment as a flat
#            run of 16-element-block items (no padded lanes for any K, input_scale filled in the same launch);
#   "fused": triton_segments.nvfp4_segment_fused - both passes in one launch that reads the weights from HBM once;
#   "tiles": seg_amax + nvfp4_segment on row tiles (any member shape; what the others fall back to).
NVFP4_KERNELS = ("predicted", "items", "fused", "tiles")
NVFP4_KERNEL = "predicted"
_TORCH_DT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}


def _lane_of(seg) -> str:
    """The lane of direct mode that fills a segment (UpdateProgram.run): "copy" for high-precision copies, "quant"
    for everything else."""
    return "copy" if seg.kind == "hp" else "quant"


def _align(n: int) -> int:
    return -(-n // _ALIGN) * _ALIGN


@dataclass
class Region:
    """One output tensor inside a bucket buffer."""

    name: str
    dtype: str  # safetensors dtype
    shape: tuple
    offset: int
    nbytes: int


@dataclass
class Segment:
    kind: str  # hp | nvfp4 | mxfp8 | fp8_block | ref
    members: list  # TensorPlan, stacking order
    units: list  # list of lists of TensorPlan (the atomic units, for the ref path)
    regions: dict = field(default_factory=dict)  # (member index, suffix) -> Region
    k: int = 0
    rows_per_member: int = 0
    rows_per_group: int = 0
    block: tuple = (0, 0)  # (offset, nbytes) of the whole segment's regions in the bucket


@dataclass
class Bucket:
    segments: list
    regions: list  # wire order
    nbytes: int

    def meta(self):
        from precision_dsl.backends.weight_update.program import FrozenLayout

        return FrozenLayout(names=tuple(r.name for r in self.regions),
                            dtypes=tuple(_TORCH_DT[r.dtype] for r in self.regions),
                            shapes=tuple(tuple(r.shape) for r in self.regions),
                            offsets=tuple(r.offset for r in self.regions), nbytes=tuple(r.nbytes for r in self.regions),
                            total=self.nbytes)


# The weight layouts the fused segment kernels write, by kind (the kind's name is the segment kind); anything
# else goes through the reference path ("ref").
_FUSED_LAYOUTS = {
    FormatKind.NVFP4: lambda w: w.block == (1, 16) and NVFP4_SPEC.one_weight_scale_per_tensor(w.global_scale),
    FormatKind.MXFP8: lambda w: w.block == (1, 32) and w.element == "e4m3",
    FormatKind.FP8_BLOCK: lambda w: w.block == (128, 128) and w.element == "e4m3",
}


def _kind(t: TensorPlan) -> str:
    w = t.precision.weight
    if not (t.is_linear and w.is_quantized):
        return "hp"
    fits = _FUSED_LAYOUTS.get(w.kind)
    return w.kind.value if fits is not None and fits(w) else "ref"


def _unit_kind(unit: list) -> str:
    kinds = {_kind(t) for t in unit}
    if len(kinds) != 1:
        return "ref"
    kind = kinds.pop()
    if kind == "hp":
        return kind
    if any(len(t.shape) != 2 for t in unit):
        return "ref"
    ks = {t.shape[-1] for t in unit}
    ns = {t.shape[0] for t in unit}
    if len(ks) != 1 or len({t.precision.weight for t in unit}) != 1:
        return "ref"
    if kind == "nvfp4" and (len(ns) != 1 or next(iter(ks)) % 16):
        return "ref"
    if kind == "nvfp4" and len(unit) > 1 and not all(needs_shared_amax(t) for t in unit):
        return "ref"  # members of one unit with separate per-tensor scales: fine per tensor, keep it simple
    if kind == "mxfp8" and next(iter(ks)) % 32:
        return "ref"
    if kind == "fp8_block" and any(n % 128 for n in ns):
        return "ref"  # 128-row blocks must not straddle two stacked tensors
    return kind


def _merge_key(unit: list, kind: str) -> tuple:
    t = unit[0]
    roles = tuple(x.role for x in unit)
    if kind == "hp":
        return (kind, t.mtp, t.layer, t.precision.weight.kind, roles)
    return (kind, t.mtp, t.layer, roles, t.precision.weight, t.shape[-1], len(unit),
            tuple(x.shape[0] for x in unit) if kind == "nvfp4" else None)


def _grouped_order(units: list) -> list:
    """Units of one layer that can share a launch made adjacent (stable): e.g. every expert's [gate, up] unit,
    then every expert's [down], instead of the checkpoint's per-expert interleaving."""
    layers: dict = {}
    keys: dict = {}

    def sort_key(unit):
        t = unit[0]
        lk = (t.mtp, t.layer)
        kind = _unit_kind(unit)
        mk = _merge_key(unit, kind) if kind != "ref" else ("ref", id(unit))
        return layers.setdefault(lk, len(layers)), keys.setdefault((lk, mk), len(keys))

    return sorted(units, key=sort_key)


class UpdateProgram:
    def __init__(self, plan: Plan, units: list, bucket_bytes: int):
        """units: the atomic units (lists of TensorPlan in plan order), in send order."""
        self.plan = plan
        units = _grouped_order(units)
        self.buckets: list[Bucket] = []
        sizes = {}
        for unit in units:
            for t in unit:
                sizes[t.hf_name] = sum(_align(DTYPE_SIZES[dt] * math.prod(sh)) for _, dt, sh in output_specs(t))
        cur: list = []
        cur_size = 0
        for unit in units:
            nb = sum(sizes[t.hf_name] for t in unit)
            if cur and cur_size + nb > bucket_bytes:
                self.buckets.append(self._bucket(cur))
                cur, cur_size = [], 0
            cur.append(unit)
            cur_size += nb
        if cur:
            self.buckets.append(self._bucket(cur))
        self.metas = [b.meta() for b in self.buckets]  # static: built once, sent as is every update
        self.bucket_names = [list(m["names"]) for m in self.metas]
        self.max_bucket = max((b.nbytes for b in self.buckets), default=0)
        self.tensors = sum(len(b.regions) for b in self.buckets)
        self.bytes = sum(r.nbytes for b in self.buckets for r in b.regions)
        # anything besides copies (a BF16 update is copies only: one lane, nothing to run beside it)
        self.quantizes = any(_lane_of(seg) == "quant" for b in self.buckets for seg in b.segments)
        # a bucket with a per-unit segment stays eager (its reference code may synchronise with the host)
        self.eager_buckets = any(seg.kind == "ref" for b in self.buckets for seg in b.segments)

    # -- static layout ---------------------------------------------------------------------------------------------
    def _bucket(self, units: list) -> Bucket:
        segs: list[Segment] = []
        key_prev = None
        for unit in units:
            kind = _unit_kind(unit)
            key = _merge_key(unit, kind) if kind != "ref" else None
            if key is not None and key == key_prev:
                segs[-1].members.extend(unit)
                segs[-1].units.append(unit)
            else:
                segs.append(Segment(kind=kind, members=list(unit), units=[unit]))
            key_prev = key
        regions: list[Region] = []
        off = 0
        for seg in segs:
            start = off
            off = self._layout(seg, regions, off)
            seg.block = (start, off - start)
        return Bucket(segments=segs, regions=regions, nbytes=off)

    def _layout(self, seg: Segment, regions: list, off: int) -> int:
        """Assign byte ranges. Quantized segments: all members' data first, then all scales, ... (each kind of
        output contiguous over the stacked rows, which is what one kernel launch writes)."""
        specs = [output_specs(t) for t in seg.members]
        if seg.kind in ("nvfp4", "mxfp8", "fp8_block"):
            seg.k = seg.members[0].shape[1]
            seg.rows_per_member = seg.members[0].shape[0]
            seg.rows_per_group = seg.rows_per_member * (len(seg.units[0]) if needs_shared_amax(seg.members[0])
                                                        else 1)
            for j in range(len(specs[0])):  # output j of every member, back to back
                start = off
                for i, sp in enumerate(specs):
                    name, dt, sh = sp[j]
                    nb = DTYPE_SIZES[dt] * math.prod(sh)
                    r = Region(name, dt, tuple(sh), off, nb)
                    seg.regions[(i, j)] = r
                    regions.append(r)
                    off += nb
                off = start + _align(off - start)
            return off
        if seg.kind == "hp":  # one dtype per segment: members back to back, so one copy can fill the segment
            start = off
            for i, sp in enumerate(specs):
                name, dt, sh = sp[0]
                nb = DTYPE_SIZES[dt] * math.prod(sh)
                r = Region(name, dt, tuple(sh), off, nb)
                seg.regions[(i, 0)] = r
                regions.append(r)
                off += nb
            return start + _align(off - start)
        for i, sp in enumerate(specs):  # ref: member by member, every output aligned
            for j, (name, dt, sh) in enumerate(sp):
                nb = DTYPE_SIZES[dt] * math.prod(sh)
                r = Region(name, dt, tuple(sh), off, nb)
                seg.regions[(i, j)] = r
                regions.append(r)
                off += _align(nb)
        return off

    # -- binding ---------------------------------------------------------------------------------------------------
    def bind(self, tensors: dict, group_small: bool = True, nvfp4_kernel: str = NVFP4_KERNEL,
             bucket_launches: bool = True) -> "Bound":
        """tensors: {hf_name: CUDA tensor}. Per segment, a 2-D [rows, K] (quantized) or flat (hp) view of the
        stacked members: zero-copy when they are consecutive views of one buffer, else a gather each run.
        group_small: a bucket's small high-precision pieces share one launch; nvfp4_kernel: how NVFP4 segments
        are quantized, one of NVFP4_KERNELS (segments the item kernels cannot tile take "tiles"); bucket_launches:
        a bucket's predicted-NVFP4 segments share one launch (and one redo), and so do its rowwise MXFP8 inputs
        (kernels/triton_bucket.py), instead of a launch (NVFP4: four) per segment."""
        if nvfp4_kernel not in NVFP4_KERNELS:
            raise ValueError(f"nvfp4_kernel must be one of {NVFP4_KERNELS}, not {nvfp4_kernel!r}")
        return Bound(self, tensors, group_small, nvfp4_kernel, bucket_launches)

    # -- one update ------------------------------------------------------------------------------------------------
    def run(self, bound: "Bound", send, check_equal: bool = False, fingerprint_stride: int = 1, dest=None):
        """Fill and hand every bucket to `send(k, meta, buf) -> handle` (handle: None, or an object whose
        .wait() makes the current stream wait until the buffer may be reused). Returns (bad count tensor,
        fingerprints tensor or None) - both still on the GPU.

        dest (direct mode, trainer and rollout on one GPU): `dest(k, nbytes, device)` -> the receiver-owned buffer
        of bucket k, or None; when every bucket has one, each bucket is quantized / packed straight into it (no
        pool buffer, no second copy: for BF16 the pack copy is the only copy) and `send` only passes the message.
        Otherwise buckets are filled into two pool buffers that `send` copies out.

        From the second run on, the launches (a few hundred for a large MoE: per layer the expert segments plus the
        small norms/router/attention pieces) are replayed from CUDA graphs: the inputs, the bucket buffers and the
        counters have fixed addresses, so a graph is the whole program and the host cost no longer scales with the
        number of segments (a change of the bucket buffers - new receiver buffers - captures again). In direct
        mode without fingerprints the whole update is ONE graph (`_capture_whole`: its lanes are streams forked
        and joined inside it, so no launch gap between buckets, and the host launches once); otherwise one graph
        per bucket and lane. Buckets with a per-unit (`ref`) segment, whose reference code may synchronise with the
        host, stay eager (and keep the whole update off the one graph)."""
        import torch

        from precision_dsl.kernels import triton_segments as ks

        dev = bound.device
        if bound.bad is None:
            bound.bad = torch.zeros(1, dtype=torch.int32, device=dev)
        targets = [dest(k, b.nbytes, dev) for k, b in enumerate(self.buckets)] if dest is not None else None
        if targets is not None and any(t is None for t in targets):
            targets = None
        if targets is None:
            if bound.pool is None or bound.pool[0].numel() < self.max_bucket:
                bound.pool = [torch.empty(self.max_bucket, dtype=torch.uint8, device=dev) for _ in range(2)]
            targets = [bound.pool[k % 2][:b.nbytes] for k, b in enumerate(self.buckets)]
        else:
            bound.pool = None  # direct: the receiver's buffers are the only bucket memory
        bad = bound.bad
        # one graph of the whole update (direct mode, nothing fingerprinted, no bucket eager): its first node zeroes
        # the non-finite counter
        whole = (bound.whole_graph and bound.use_graphs and bound.pool is None and not check_equal
                 and dev.type == "cuda" and bound.runs >= 1 and not self.eager_buckets)
        if not whole:
            bad.zero_()
        fps = torch.zeros(len(self.buckets), dtype=torch.int64, device=dev) if check_equal else None
        handles = bound.handles  # kept across updates: the last transfers of update s guard update s+1
        # Two lanes (direct mode, nothing fingerprinted per bucket, something quantized): every bucket writes its own
        # receiver buffer and the receiver reads none before the update closes, so the copies of the high-precision
        # pieces (bound by HBM) run on the current stream while the quantize launches (bound by instructions: the
        # predicted NVFP4 kernel moves ~2.9 TB/s on an H200) run on a high-priority stream, joined at the end.
        lanes = bound.pool is None and fps is None and dev.type == "cuda" and bound.lanes and self.quantizes
        key = tuple(t.data_ptr() for t in targets)
        if bound.graph_key != key:
            bound.graphs = None
        # the whole-update graph: bucket after bucket within a lane with no launch gap between graphs, the redo /
        # roll tails of the NVFP4 bucket launches on a third stream beside the next bucket's quantize launch
        if whole:
            for h in handles:  # a previous update's transfers out of pool buffers (a mode switch)
                if h is not None:
                    h.wait()
            wkey = key + (lanes, bound.high_lane)  # (a pool-buffer or fingerprinted update in between keeps the graph)
            if bound.whole is None or bound.whole_key != wkey:
                bound.whole = None  # its memory goes before the new capture takes its own
                bound.whole = self._capture_whole(bound, targets, lanes)
                bound.whole_key = wkey
            bound.whole.replay()
            for k, b in enumerate(self.buckets):  # direct mode: each send only passes the message
                handles[k % 2] = send(k, self.metas[k], targets[k])
            bound.runs += 1
            return bad, fps
        if bound.graphs is None and bound.runs >= 1 and bound.use_graphs and dev.type == "cuda":
            bound.graphs = self._capture(bound, targets)
            bound.graph_key = key
        graphs = bound.graphs or [None] * len(self.buckets)
        if lanes:
            for h in handles:  # a previous update's transfers out of pool buffers (a mode switch)
                if h is not None:
                    h.wait()
            cur = torch.cuda.current_stream(dev)
            qs, _ = self._streams(bound, dev)
            qs.wait_stream(cur)  # after bad.zero_() and whatever wrote the trainer's weights
            with torch.cuda.stream(qs):
                for k, b in enumerate(self.buckets):
                    self._lane(k, b, bound, targets[k], bad, dev, "quant", graphs[k])
            for k, b in enumerate(self.buckets):
                self._lane(k, b, bound, targets[k], bad, dev, "copy", graphs[k])
            cur.wait_stream(qs)
            for k, b in enumerate(self.buckets):  # direct mode: each send only passes the message
                handles[k % 2] = send(k, self.metas[k], targets[k])
            bound.runs += 1
            return bad, fps
        for k, b in enumerate(self.buckets):
            slot = k % 2
            if handles[slot] is not None:
                handles[slot].wait()
            buf = targets[k]
            self._lane(k, b, bound, buf, bad, dev, "copy", graphs[k])
            self._lane(k, b, bound, buf, bad, dev, "quant", graphs[k])
            if fps is not None:
                ks.fingerprint(buf, fps[k:k + 1], fingerprint_stride)
            handles[slot] = send(k, self.metas[k], buf)
        bound.runs += 1
        return bad, fps

    def _lane(self, k, b, bound, buf, bad, dev, lane: str, graphs) -> None:
        """Run one lane of bucket k: from its CUDA graph when captured, else eagerly."""
        if graphs is not None:
            g = graphs[lane]
            if g is not None:
                g.replay()
            return
        self._fill_bucket(k, b, bound, buf, bad, dev, lane)

    def _fill_bucket(self, k, b, bound, buf, bad, dev, lane: str, tail=None) -> None:
        """Fill one lane of bucket k's regions of buf (_lane_of: "copy" = its high-precision segments, "quant" =
        every other segment, with the gathers and bucket launches); the two lanes write disjoint regions. tail: a
        stream for the NVFP4 bucket launches' redo / roll launches (the caller joins it)."""
        import torch

        group = bound.hp_groups[k]
        if lane == "copy" and group is not None:  # the bucket's small high-precision pieces: one launch per dtype
            group.launch(buf, bad)
        launches, covered = bound.bucket_launches[k]
        if lane == "quant":
            for si in covered:  # staged members of segments a bucket launch quantizes: gathered first
                if bound.gather[k][si] is not None and bound.inputs[k][si] is not None:
                    torch.cat(bound.gather[k][si], dim=0, out=bound.inputs[k][si])
            for launch in launches:
                if tail is not None and hasattr(launch, "prev_bits"):
                    launch.launch(buf, bad, tail=tail)
                else:
                    launch.launch(buf, bad)
        for si, seg in enumerate(b.segments):
            if (group is not None and si in group.segments) or si in covered or _lane_of(seg) != lane:
                continue
            x = bound.inputs[k][si]
            gather = bound.gather[k][si]
            if gather is not None and x is None:  # MXFP8 members quantized in place (see Bound)
                from precision_dsl.kernels import triton_mxfp8

                for i, xi in enumerate(gather):
                    d, sc = seg.regions[(i, 0)], seg.regions[(i, 1)]
                    triton_mxfp8.quantize_rows_flat(xi, buf[d.offset:d.offset + d.nbytes].view(-1, seg.k),
                                                    buf[sc.offset:sc.offset + sc.nbytes].view(-1, seg.k // 32),
                                                    bad=bad)
                continue
            if gather is not None:  # members not laid out back to back: one copy into the staging rows
                torch.cat(gather, dim=0, out=x)
            self._fill(seg, x, buf, bad, dev, bound.nvfp4_kernel, bound.seg_state.setdefault((k, si), {}))

    @staticmethod
    def _streams(bound: "Bound", dev):
        import torch

        if bound.quant_stream is None:
            bound.quant_stream = torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1])
        if bound.tail_stream is None:
            bound.tail_stream = torch.cuda.Stream(dev)
        return bound.quant_stream, bound.tail_stream

    @staticmethod
    def _lane_streams(bound: "Bound", dev, cur) -> tuple:
        """(quantize lane's stream, copy lane's stream) of the whole-update graph by bound.high_lane: "quant" (the
        quantize launches on the high-priority stream, the copies on the capturing one), "copy" (the reverse) or
        "none" (both at the default priority)."""
        import torch

        if bound.high_lane == "quant":
            return UpdateProgram._streams(bound, dev)[0], cur
        if bound.high_lane == "copy":
            if bound.copy_stream is None:
                bound.copy_stream = torch.cuda.Stream(dev, priority=torch.cuda.Stream.priority_range()[1])
            return cur, bound.copy_stream
        if bound.high_lane != "none":
            raise ValueError(f"high_lane must be 'quant', 'copy' or 'none', not {bound.high_lane!r}")
        if bound.plain_stream is None:
            bound.plain_stream = torch.cuda.Stream(dev)
        return bound.plain_stream, cur

    def _capture_whole(self, bound: "Bound", targets: list, lanes: bool):
        """One CUDA graph of every bucket's launches. lanes: the quantize launches and the high-precision copies
        each on their own stream (`_lane_streams`: which one has the high priority), the NVFP4 bucket launches'
        redo / roll tails on the tail stream (each after its own bucket's quantize launch, beside the next
        bucket's), all forked from and joined into the capturing stream; else every launch on one stream, bucket
        after bucket (each lane's launches as eager)."""
        import torch

        dev = bound.device
        torch.cuda.synchronize(dev)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            cur = torch.cuda.current_stream(dev)
            bound.bad.zero_()
            if lanes:
                _, ts = self._streams(bound, dev)
                qs, cs = self._lane_streams(bound, dev, cur)
                for st in {qs, cs, ts} - {cur}:
                    st.wait_stream(cur)
                with torch.cuda.stream(qs):
                    for k, b in enumerate(self.buckets):
                        self._fill_bucket(k, b, bound, targets[k], bound.bad, dev, "quant", tail=ts)
                with torch.cuda.stream(cs):
                    for k, b in enumerate(self.buckets):
                        self._fill_bucket(k, b, bound, targets[k], bound.bad, dev, "copy")
                for st in {qs, cs, ts} - {cur}:
                    cur.wait_stream(st)
            else:
                for k, b in enumerate(self.buckets):
                    self._fill_bucket(k, b, bound, targets[k], bound.bad, dev, "copy")
                    self._fill_bucket(k, b, bound, targets[k], bound.bad, dev, "quant")
        torch.cuda.synchronize(dev)
        return g

    def _capture(self, bound: "Bound", targets: list) -> list:
        """Per bucket {lane: CUDA graph, or None for a lane without work}; None for a bucket that stays eager."""
        import torch

        torch.cuda.synchronize(bound.device)
        graphs = []
        for k, b in enumerate(self.buckets):
            if any(seg.kind == "ref" for seg in b.segments):
                graphs.append(None)
                continue
            lanes = {}
            for lane in ("copy", "quant"):
                if not any(_lane_of(seg) == lane for seg in b.segments):
                    lanes[lane] = None  # an empty capture is not a graph
                    continue
                g = lanes[lane] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    self._fill_bucket(k, b, bound, targets[k], bound.bad, bound.device, lane)
            graphs.append(lanes)
        torch.cuda.synchronize(bound.device)
        return graphs

    def _fill(self, seg: Segment, x, buf, bad, dev, nvfp4_kernel: str, state: dict) -> None:
        """Fill one segment's regions of bucket buffer `buf` from its bound input x. state: the segment's dict kept
        across updates (the predicted NVFP4 kernel's group amaxes of the last update)."""
        import torch

        from precision_dsl.formats import fp8_block_pow2
        from precision_dsl.kernels import triton_fp8_block, triton_mxfp8
        from precision_dsl.kernels import triton_segments as ks

        def region(i, j):
            r = seg.regions[(i, j)]
            return buf[r.offset:r.offset + r.nbytes]

        def stacked(j, cols_bytes):
            first = seg.regions[(0, j)]
            last = seg.regions[(len(seg.members) - 1, j)]
            span = buf[first.offset:last.offset + last.nbytes]
            return span.view(-1, cols_bytes) if cols_bytes else span

        if seg.kind == "hp":
            if not isinstance(x, list):  # zero-copy flat view of all members: one pass
                ks.check_copy(x, stacked(0, 0), bad)
                return
            for i, t in enumerate(seg.members):
                want = getattr(torch, _TORCH_DT[seg.regions[(i, 0)].dtype])
                xi = x[i] if x[i].dtype == want else x[i].to(want)
                ks.check_copy(xi, region(i, 0), bad)
            return
        if seg.kind == "ref":
            from precision_dsl.backends.quantize import checkpoint_tensors

            i0 = 0
            for unit in seg.units:
                xs = [x[i0 + i] for i in range(len(unit))]
                for xi in xs:
                    if xi.is_floating_point():
                        ks.check_copy(xi, None, bad)
                out = checkpoint_tensors(list(zip(unit, xs)), backend="weight_update", check_finite=False)
                # finite after the cast too (a finite value can overflow the target dtype); counted on the GPU: no
                # host sync
                for y in out.values():
                    if y.is_floating_point():
                        bad.add_((~torch.isfinite(y.float())).sum().to(torch.int32))
                for i, t in enumerate(unit):
                    for j, (name, _, _) in enumerate(output_specs(t)):
                        region(i0 + i, j).copy_(out[name].reshape(-1).view(torch.uint8))
                i0 += len(unit)
            return
        k = seg.k
        rows = x.shape[0]
        if seg.kind == "nvfp4":
            data = stacked(0, k // 2)
            scale = stacked(1, k // 16)
            sdec = stacked(2, 0).view(torch.float32)
            isc = stacked(3, 0).view(torch.float32)  # ModelOpt input_scale (unused with per-token activations)
            if nvfp4_kernel != "tiles" and ks.item_blocks_for(seg.rows_per_member, k) and x.is_contiguous():
                if nvfp4_kernel == "predicted":
                    prev = state.get("prev_bits")
                    if prev is None:  # -1 is no amax: the first update quantizes every group twice
                        prev = state["prev_bits"] = torch.full((rows // seg.rows_per_group,), -1,
                                                               dtype=torch.int32, device=dev)
                    ks.nvfp4_segment_predicted(x, seg.rows_per_group, seg.rows_per_member, data, scale, sdec, bad,
                                               prev, isc)
                    return
                run = ks.nvfp4_segment_fused if nvfp4_kernel == "fused" else ks.nvfp4_segment_items
                run(x, seg.rows_per_group, seg.rows_per_member, data, scale, sdec, bad, isc)
                return
            n_groups = rows // seg.rows_per_group
            bits = torch.zeros(n_groups, dtype=torch.int32, device=dev)
            ks.seg_amax(x, seg.rows_per_group, bits, bad)
            ks.nvfp4_segment(x, bits.view(torch.float32), seg.rows_per_group, seg.rows_per_member, data, scale, sdec)
            isc.fill_(1.0)
            return
        # the quantize kernels count NaN/Inf in the same read of x (no separate checking pass over the weights)
        if seg.kind == "mxfp8":
            if x.is_contiguous():  # flat 32-element blocks: no 2-D tile, no padded lanes
                triton_mxfp8.quantize_rows_flat(x, stacked(0, k), stacked(1, k // 32), bad=bad)
                return
            triton_mxfp8.quantize_rowcol(x, "e4m3", True, False, out_row=(stacked(0, k), stacked(1, k // 32)),
                                         bad=bad)
            return
        if seg.kind == "fp8_block":
            w = seg.members[0].precision.weight
            sinv = stacked(1, 0).view(torch.float32).view(-1, -(-k // 128))
            triton_fp8_block.quantize(x, "e4m3", square=True, pow2=fp8_block_pow2(w),
                                      out=(stacked(0, k), sinv), bad=bad)
            return
        raise AssertionError(seg.kind)


# High-precision pieces of at most this many elements are copied by the bucket's one grouped launch (norms, routers,
# small attention weights: each alone is a launch far too short to fill the GPU); larger ones keep their own
# vectorised copy.
SMALL_HP_ELEMS = 1 << 20


class HpGroup:
    """A bucket's small high-precision pieces, copied + checked by one launch per dtype (triton_segments.
    multi_check_copy) over tables built once at bind time."""

    def __init__(self, launches: list, segments: set):
        self.launches = launches  # [(base tensor, table, aligned)]
        self.segments = segments  # indices of the bucket's segments it fills

    def launch(self, buf, bad) -> None:
        from precision_dsl.kernels import triton_segments as ks

        for base, table, aligned in self.launches:
            ks.multi_check_copy(base, buf, table, aligned, bad)


def _hp_group(seg_list: list, inputs: list, small: int):
    """The HpGroup of one bucket (segments + their bound inputs), or None when it would not remove launches."""
    import torch

    from precision_dsl.kernels import triton_segments as ks

    by_dtype: dict = {}
    replaced: dict = {}
    for si, (seg, x) in enumerate(zip(seg_list, inputs)):
        if seg.kind != "hp":
            continue
        want = getattr(torch, _TORCH_DT[seg.regions[(0, 0)].dtype])
        if want not in (torch.bfloat16, torch.float16, torch.float32):
            continue
        es = torch.empty((), dtype=want).element_size()
        if not isinstance(x, list):  # one zero-copy flat view: one piece at the segment's start
            pieces = [(x, seg.regions[(0, 0)].offset)] if x.numel() <= small else None
        elif all(xi.dtype == want and xi.is_contiguous() and xi.numel() <= small for xi in x):
            pieces = [(xi.reshape(-1), seg.regions[(i, 0)].offset) for i, xi in enumerate(x)]
        else:
            pieces = None  # a dtype conversion or a large member: the segment keeps its own launches
        if not pieces or any(off % es for _, off in pieces):
            continue
        by_dtype.setdefault(want, []).extend((p, off // es) for p, off in pieces)
        replaced.setdefault(want, {})[si] = len(pieces)
    launches, segments = [], set()
    for dt, pieces in by_dtype.items():
        if sum(replaced[dt].values()) < 2:
            continue  # a single launch either way
        base = pieces[0][0]
        try:
            table, aligned = ks.multi_copy_table(pieces, base, base.device)
        except ValueError:
            continue
        launches.append((base, table, aligned))
        segments.update(replaced[dt])
    return HpGroup(launches, segments) if launches else None


class Bound:
    """The trainer's tensors arranged per bucket and segment (see UpdateProgram.bind)."""

    def __init__(self, prog: UpdateProgram, tensors: dict, group_small: bool = True,
                 nvfp4_kernel: str = NVFP4_KERNEL, bucket_launches: bool = True):
        import torch

        self.pool = None
        self.bad = None
        # per-bucket CUDA graphs ({lane: graph}), captured on the second run (the first compiles the kernels)
        self.graphs = None
        self.graph_key = None  # the bucket buffers' addresses the graphs were captured with
        self.use_graphs = True
        self.lanes = True  # direct mode: copies and quantize launches on two streams (UpdateProgram.run)
        self.quant_stream = None  # the quantize lane's high-priority stream
        self.tail_stream = None  # the whole-update graph's lane of NVFP4 redo / roll launches
        # the whole-update graph's high-priority lane (UpdateProgram._lane_streams): the copies, so that the
        # HBM-bound copy kernels take SM slots as the quantize programs retire instead of running alone at the end.
        # H200, 1.34B model, session 21: graph GPU time NVFP4 1092 vs 1126 us with the quantize lane high, MXFP8
        # 1145 vs 1180 us (benchmarks/RESULTS.md)
        self.high_lane = "copy"
        self.copy_stream = None
        self.plain_stream = None
        # the whole update as one CUDA graph (UpdateProgram._capture_whole) where it can be; False: per-bucket graphs
        self.whole_graph = True
        self.whole = None
        self.whole_key = None
        self.nvfp4_kernel = nvfp4_kernel  # how NVFP4 segments are quantized (UpdateProgram.bind)
        self.seg_state: dict = {}  # (bucket, segment) -> state kept across updates (predicted NVFP4 amaxes)
        self.runs = 0
        self.handles: list = [None, None]
        self.inputs: list[list] = []
        self.gather: list[list] = []
        self.gathers = 0
        dev = None
        for b in prog.buckets:
            per_seg = []
            per_gather = []
            self.gather.append(per_gather)
            for seg in b.segments:
                xs = [tensors[t.hf_name] for t in seg.members]
                for t, x in zip(seg.members, xs):
                    if tuple(x.shape) != tuple(t.shape):
                        raise ValueError(f"tensor '{t.hf_name}' has shape {tuple(x.shape)}, the plan says {t.shape}")
                dev = dev or xs[0].device
                if seg.kind == "hp":
                    want = getattr(torch, _TORCH_DT[seg.regions[(0, 0)].dtype])
                    flat = _stack_flat(xs, want)
                    per_seg.append(xs if flat is None else flat)
                    per_gather.append(None)
                    continue
                if seg.kind == "ref":
                    per_seg.append(xs)
                    per_gather.append(None)
                    continue
                if seg.kind == "mxfp8" and not _back_to_back(xs) and _same_contiguous(xs):
                    # rowwise 1x32 blocks never span rows: each member (e.g. separate q/k/v projections) is
                    # quantized on its own straight into its regions - no staging buffer, no copy per update
                    per_seg.append(None)
                    per_gather.append([x.reshape(-1, seg.k) for x in xs])
                    continue
                view, members = _stack_rows(xs, seg.k, torch)
                per_seg.append(view)
                per_gather.append(members)
                self.gathers += members is not None
            self.inputs.append(per_seg)
        self.device = dev
        # per bucket: its small high-precision pieces in one launch, or None (group_small=False: a launch each)
        self.hp_groups = [_hp_group(b.segments, ins, SMALL_HP_ELEMS) if group_small else None
                          for b, ins in zip(prog.buckets, self.inputs)]
        # per bucket: (bucket launches, indices of the segments they quantize)
        self.bucket_launches = [_bucket_launches(b.segments, ins, gat, nvfp4_kernel, dev) if bucket_launches
                                else ([], set()) for b, ins, gat in zip(prog.buckets, self.inputs, self.gather)]
        for k, (launches, _) in enumerate(self.bucket_launches):
            for i, launch in enumerate(launches):
                if hasattr(launch, "prev_bits"):  # kept group amaxes (UpdateProgram._fill's per-segment state)
                    self.seg_state[(k, "bucket", i)] = {"prev_bits": launch.prev_bits}


def _bucket_launches(seg_list: list, inputs: list, gathers: list, nvfp4_kernel: str, dev):
    """The bucket launches of one bucket (kernels/triton_bucket.py) and the segments they quantize: every NVFP4
    segment the predicted item kernel takes, every rowwise MXFP8 input that is contiguous (a stacked segment, a
    staging buffer, or each in-place member); one launch per input dtype (and NVFP4 item size:
    triton_segments.item_blocks_for(.., PREDICTED_ITEM_BLOCKS))."""
    from precision_dsl.kernels import triton_bucket as kb
    from precision_dsl.kernels import triton_segments as ks

    nv: dict = {}
    mx: dict = {}
    covered: set = set()
    for si, (seg, x, gather) in enumerate(zip(seg_list, inputs, gathers)):
        ib = ks.item_blocks_for(seg.rows_per_member, seg.k, ks.PREDICTED_ITEM_BLOCKS) if seg.kind == "nvfp4" else 0
        if ib and nvfp4_kernel == "predicted" and x is not None and x.is_contiguous():
            r = [seg.regions[(0, j)].offset for j in range(4)]
            nv.setdefault((x.dtype, ib), []).append((x, seg.rows_per_group, seg.rows_per_member, *r))
            covered.add(si)
        elif seg.kind == "mxfp8" and x is None and gather is not None:  # in-place members, each its own input
            for i, xi in enumerate(gather):
                mx.setdefault(xi.dtype, []).append((xi, seg.regions[(i, 0)].offset, seg.regions[(i, 1)].offset))
            covered.add(si)
        elif seg.kind == "mxfp8" and x is not None and x.is_contiguous():
            mx.setdefault(x.dtype, []).append((x, seg.regions[(0, 0)].offset, seg.regions[(0, 1)].offset))
            covered.add(si)
    launches = [kb.NVFP4BucketLaunch(e, ib, dev) for (_, ib), e in nv.items()]
    launches += [kb.MXFP8BucketLaunch(e, dev) for e in mx.values()]
    return launches, covered


def _same_contiguous(xs: list) -> bool:
    """Contiguous tensors of one dtype on one device (each readable in place by a flat kernel)."""
    x0 = xs[0]
    return all(x.is_contiguous() and x.dtype == x0.dtype and x.device == x0.device for x in xs)


def _back_to_back(xs: list) -> bool:
    x0 = xs[0]
    if not _same_contiguous(xs):
        return False
    if x0.untyped_storage().data_ptr() != xs[-1].untyped_storage().data_ptr():
        return False
    ptr = x0.data_ptr()
    for x in xs:
        if x.data_ptr() != ptr:
            return False
        ptr += x.numel() * x.element_size()
    return True


def _stack_flat(xs: list, dtype):
    """Flat zero-copy view of high-precision tensors stored back to back in the storage dtype, else None."""
    import torch

    if xs[0].dtype != dtype or not _back_to_back(xs):
        return None
    return torch.as_strided(xs[0], (sum(x.numel() for x in xs),), (1,))


def _stack_rows(xs: list, k: int, torch):
    """(view, None): a zero-copy [sum rows, K] view when every tensor starts where the previous one ends in one
    storage (Megatron's grouped-expert buffers); else (staging buffer, [2-D members]) for a gather per run."""
    x0 = xs[0]
    rows = sum(x.shape[0] for x in xs)
    if _back_to_back(xs):
        return torch.as_strided(x0, (rows, k), (k, 1)), None
    dtype = x0.dtype if all(x.dtype == x0.dtype for x in xs) else torch.float32  # cat(out=) casts per run
    return torch.empty((rows, k), dtype=dtype, device=x0.device), [x.reshape(-1, k) for x in xs]
