"""Buckets: the atomic units an update is cut into, and the wire form of a bucket (meta + one flat uint8 buffer,
with its always-on checksum)."""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Optional

from precision_dsl.plan import Plan

from precision_dsl.backends.quantize import needs_shared_amax
from precision_dsl.backends.weight_update.errors import WeightUpdateError, WeightUpdateMismatch

if TYPE_CHECKING:
    import torch


def atomic_groups(plan: Plan) -> dict[tuple, set[str]]:
    """Atomic units of an update: fused-sibling instances (q/k/v, gate/up, q_a/kv_a, one expert's gate/up) merged
    with NVFP4 share-scale groups; every other tensor is a unit of one. A unit always travels in one bucket."""
    group_of = {m: g.id for g in plan.share_scale_groups for m in g.members}
    need: dict[tuple, set[str]] = {}
    share_in_fused: list[tuple[tuple, tuple]] = []  # (share unit, fused unit) of each shared-amax fused tensor
    for t in plan.tensors:
        name, fi = t.hf_name, t.fused_key
        gid = group_of.get(name)
        if gid is not None and needs_shared_amax(t):
            key = ("share", gid)
            if fi is not None:
                share_in_fused.append((key, ("fused",) + fi))
        else:
            key = ("fused",) + fi if fi is not None else ("one", name)
        names = need.get(key)
        if names is None:
            names = need[key] = set()
        names.add(name)
    parent = {k: k for k in need}

    def find(k):
        while parent[k] != k:
            parent[k] = parent[parent[k]]
            k = parent[k]
        return k

    for share, fused in share_in_fused:  # a share-scale group overlapping a fused instance (gate/up) joins it
        if fused in need:
            parent[find(share)] = find(fused)
    members: dict[tuple, set[str]] = {}
    for k, ns in need.items():
        members.setdefault(find(k), set()).update(ns)
    return members


def _dtypes() -> dict:
    import torch

    return {str(d).replace("torch.", ""): d for d in (torch.bfloat16, torch.float16, torch.float32, torch.uint8,
                                                     torch.float8_e4m3fn, torch.float8_e5m2, torch.int64)}


def _digest(t: torch.Tensor) -> str:
    import torch

    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def bucket_checksum(buf: torch.Tensor, algo: Optional[str] = None) -> str:
    """Cheap integrity check of a bucket's bytes, always on (a full sha256 per tensor is `check_equal`).
    Host buffers: CRC32 (zlib, ~1 GB/s per core here; see benchmarks/RESULTS.md). Device buffers: two wrapping int64
    sums over 8-byte words (plain and position-weighted, so reordered words change it), computed where the bytes
    are, with no host copy; the receiver recomputes the algorithm the sender named."""
    import torch

    algo = algo or ("crc32" if buf.device.type == "cpu" else "sum64")
    flat = buf.reshape(-1).view(torch.uint8)
    if algo == "crc32":
        import zlib

        return f"crc32:{zlib.crc32(memoryview(flat.cpu().numpy())):08x}"
    if algo != "sum64":
        raise WeightUpdateError(f"unknown bucket checksum algorithm {algo!r}")
    n = flat.numel()
    pad = (-n) % 8
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad)])
    words = flat.view(torch.int64)
    s1 = s2 = 0
    step = 1 << 23  # 64 MiB of words per chunk bounds the temporaries
    for i in range(0, words.numel(), step):
        w = words[i:i + step]
        idx = torch.arange(i + 1, i + 1 + w.numel(), device=w.device, dtype=torch.int64)
        s1 = (s1 + int(w.sum())) & ((1 << 64) - 1)
        s2 = (s2 + int((w * idx).sum())) & ((1 << 64) - 1)
    return f"sum64:{n:x}:{s1:016x}:{s2:016x}"


def pack_bucket(tensors: dict[str, torch.Tensor]) -> tuple[dict, torch.Tensor]:
    """(meta {names, dtypes, shapes}, one flat uint8 buffer) for a bucket: what a broadcast transport moves."""
    import torch

    names = list(tensors)
    flats = [tensors[n].contiguous().reshape(-1).view(torch.uint8) for n in names]
    # A unit may mix devices (quantized data on the GPU, a constant such as NVFP4 input_scale made on the CPU):
    # the bucket lives where its bulk is.
    dev = next((f.device for f in flats if f.device.type != "cpu"), None)
    if dev is not None:
        flats = [f.to(dev) for f in flats]
    meta = {"names": names, "dtypes": [str(tensors[n].dtype).replace("torch.", "") for n in names],
            "shapes": [list(tensors[n].shape) for n in names], "nbytes": [f.numel() for f in flats]}
    buf = torch.cat(flats) if flats else torch.empty(0, dtype=torch.uint8)
    meta["checksum"] = bucket_checksum(buf)
    return meta, buf


_SAME_POLICYC = "sender and receiver must run the same policyc"


def _is_count(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def check_bucket_meta(meta, size: int) -> None:
    """Refuse, naming the tensor, a received bucket whose meta disagrees with its `size` bytes: every tensor's byte
    count must be its shape x dtype and lie inside the buffer - packed buckets (pack_bucket) hold their tensors
    back to back and exactly fill it, GPU-program buckets ("offsets" layout) at their offsets within its "total".
    Viewing a byte slice as a dtype and reshaping it would otherwise fail later with a bare RuntimeError (an odd
    byte count viewed as BF16, a shape the bytes do not fill), or read the bytes of a neighbour."""
    if not isinstance(meta, dict):
        raise WeightUpdateMismatch(f"bucket metadata is a {type(meta).__name__}, not a mapping", _SAME_POLICYC)
    packed = "offsets" not in meta
    keys = ("names", "dtypes", "shapes", "nbytes") + (() if packed else ("offsets",))
    cols = [meta.get(k) for k in keys]
    if not all(isinstance(c, (list, tuple)) for c in cols) or len({len(c) for c in cols}) != 1:
        got = ", ".join(f"{k}: {len(c) if isinstance(c, (list, tuple)) else type(c).__name__}"
                        for k, c in zip(keys, cols))
        raise WeightUpdateMismatch(f"bucket metadata lists do not line up ({got})", _SAME_POLICYC)
    if not packed and (meta.get("total") != size or size % 4):  # its fingerprint reads whole int32 words
        raise WeightUpdateMismatch(f"GPU-program bucket of {size} bytes declares {meta.get('total')!r}",
                                   _SAME_POLICYC)
    itemsize = {k: v.itemsize for k, v in _dtypes().items()}
    end = 0
    # type(x) is int: a bool is no count; plain loops, as a 30B-parameter layout has ~75k tensors
    for i, (n, dt, shape, nb) in enumerate(zip(*cols[:4])):
        off = end if packed else cols[4][i]
        if type(n) is not str:
            raise WeightUpdateMismatch(f"bucket tensor {i} has the name {n!r}, not a string", _SAME_POLICYC)
        want = itemsize.get(dt) if isinstance(dt, str) else None
        if want is None:
            raise WeightUpdateError(f"bucket tensor '{n}' has unsupported dtype {dt!r}")
        ok = type(shape) in (list, tuple) and type(nb) is int and type(off) is int and nb >= 0 and off >= 0
        for d in shape if ok else ():
            if type(d) is not int or d < 0:
                ok = False
                break
            want *= d
        if not ok:
            raise WeightUpdateMismatch(f"bucket tensor '{n}' has a malformed layout (shape {shape!r}, offset "
                                       f"{off!r}, {nb!r} bytes)", _SAME_POLICYC)
        if nb != want:
            raise WeightUpdateMismatch(f"bucket tensor '{n}' is declared {dt} {shape} ({want} bytes) but carries "
                                       f"{nb} bytes", _SAME_POLICYC)
        if off + nb > size:
            raise WeightUpdateMismatch(f"bucket tensor '{n}' (bytes {off}..{off + nb}) runs past the end of its "
                                       f"{size}-byte bucket", _SAME_POLICYC)
        end = off + nb
    if packed and end != size:
        raise WeightUpdateError(f"bucket declares {end} bytes but carries {size}")


def declared_size(meta) -> int:
    """The bytes a bucket's meta says its buffer holds (a GPU-program layout's "total", else the sum of "nbytes"):
    what a broadcast receiver allocates before the bytes arrive."""
    try:
        n = meta["total"] if "offsets" in meta else sum(meta["nbytes"])
    except (TypeError, KeyError):
        n = None
    if not _is_count(n):
        raise WeightUpdateMismatch(f"bucket metadata declares no byte count: {str(meta)[:200]}", _SAME_POLICYC)
    return n


def unpack_bucket(meta: dict, buf: torch.Tensor) -> dict[str, torch.Tensor]:
    # GPU-program buckets ("offsets" layout) carry no per-bucket checksum in their meta (they are filled on the
    # GPU after the layout is sent): WeightReceiver checks them against the on-GPU fingerprints of the closing
    # message instead, and they never come through here.
    check_bucket_meta(meta, buf.numel())
    want = meta.get("checksum")
    if not isinstance(want, str):
        raise WeightUpdateMismatch("bucket carries no checksum", _SAME_POLICYC)
    got = bucket_checksum(buf, want.split(":", 1)[0])
    if got != want:
        raise WeightUpdateMismatch(f"bucket of {len(meta.get('names', []))} tensors (first "
                                   f"'{(meta.get('names') or ['?'])[0]}') arrived corrupted: checksum {got}, "
                                   f"sender computed {want}")
    dtypes = _dtypes()
    out, off = {}, 0
    for n, dt, shape, nb in zip(meta["names"], meta["dtypes"], meta["shapes"], meta["nbytes"]):
        out[n] = buf[off:off + nb].clone().view(dtypes[dt]).reshape(shape)
        off += nb
    return out
