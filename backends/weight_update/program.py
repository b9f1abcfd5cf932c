"""The GPU update program's plumbing on both ends (the program itself: backends/update_program.py): the sender's
binding of the trainer's weights, the receiver's lazy views over GPU-program buckets and its cached layout index."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from precision_dsl.plan import Plan

from precision_dsl.backends.weight_update.buckets import _dtypes
from precision_dsl.backends.weight_update.errors import WeightUpdateAborted


def layout_index(metas: list) -> tuple:
    """([{name: i} per bucket], {name: bucket number}) of GPU-program bucket layouts (dict(zip) / dict.fromkeys
    run at C speed)."""
    idxs = [dict(zip(m["names"], range(len(m["names"])))) for m in metas]
    where: dict = {}
    for k, m in enumerate(metas):
        where.update(dict.fromkeys(m["names"], k))
    return idxs, where


class FrozenLayout(dict):
    """A GPU-program bucket layout as the update program builds it once: a dict whose values are tuples (shapes
    tuples of tuples) and which refuses every change. A receiver that has checked one such object knows, from its
    identity alone, that the next update's layout is the same: with ~65k tensors in a 30B-parameter NVFP4 update,
    comparing the layouts value by value cost ~2 ms of host time per update."""

    def _refuse(self, *args, **kwargs):
        raise TypeError("a GPU-program bucket layout is immutable: build a new one")

    __setitem__ = __delitem__ = update = pop = popitem = clear = setdefault = __ior__ = _refuse

    def __reduce__(self):  # pickling (torch.distributed object collectives) without __setitem__
        return (FrozenLayout, (dict(self),))


def _copy_layout(metas: list) -> list:
    """A copy of bucket layouts that later changes to the sender's objects cannot reach (the in-process transport
    hands over the sender's own dicts; a FrozenLayout cannot change and is kept as is); elements are shared, so
    comparing with the next update's layouts is mostly identity checks."""
    return [m if type(m) is FrozenLayout else
            {k: ([list(x) for x in v] if k == "shapes" else list(v) if isinstance(v, list) else v)
             for k, v in m.items()} for m in metas]


def same_layout(known: list, metas: list) -> bool:
    """The bucket layouts `metas` equal the checked copy `known`: by identity where both are the same FrozenLayout
    objects (they cannot have changed), else value by value."""
    if len(known) == len(metas) and all(type(a) is FrozenLayout and a is b for a, b in zip(known, metas)):
        return True
    return known == metas


class _BucketViews(dict):
    """{name: tensor} over received GPU-program buckets; each view is made when first looked up (a 30B-parameter
    NVFP4 update carries ~75k checkpoint tensors: building them all eagerly costs more than moving the bytes)."""

    def __init__(self, metas: list, bufs: list, index: Optional[tuple] = None):
        super().__init__()
        self._refused: Optional[str] = None
        idxs, self._where = index if index is not None else layout_index(metas)  # _where: name -> bucket number
        self._buckets: list = list(zip(metas, bufs, idxs))  # (meta, buf, {name: i})

    def update_from(self, other: dict) -> None:
        self._where = dict(self._where)  # the index may be shared with the receiver's cached layout
        self._where.update(dict.fromkeys(other, -1))
        super().update(other)

    def spec(self, n) -> tuple[str, tuple]:
        """(dtype name, shape) of `n` without making its view."""
        b = self._where[n]
        if b < 0:
            x = dict.__getitem__(self, n)
            return str(x.dtype).replace("torch.", ""), tuple(x.shape)
        meta, _buf, idx = self._buckets[b]
        i = idx[n]
        return meta["dtypes"][i], tuple(meta["shapes"][i])

    def refuse(self, reason: str) -> None:
        """From now on every lookup raises WeightUpdateAborted: the buffers under these views were overwritten by
        an update that did not complete (WeightReceiver.stale)."""
        self._refused = reason

    def _check(self) -> None:
        if self._refused is not None:
            raise WeightUpdateAborted(f"these weights were {self._refused}",
                                      "the rollout has no valid weights until a complete update lands")

    def _make(self, n):
        meta, buf, idx = self._buckets[self._where[n]]
        i = idx[n]
        off, nb = meta["offsets"][i], meta["nbytes"][i]
        v = buf[off:off + nb].view(_dtypes()[meta["dtypes"][i]]).reshape(meta["shapes"][i])
        dict.__setitem__(self, n, v)
        return v

    def __getitem__(self, n):
        self._check()
        if dict.__contains__(self, n):
            return dict.__getitem__(self, n)
        if n in self._where:
            return self._make(n)
        raise KeyError(n)

    def get(self, n, default=None):
        return self[n] if n in self._where else default

    def __contains__(self, n) -> bool:
        return n in self._where

    def __len__(self) -> int:
        return len(self._where)

    def __iter__(self):
        return iter(self._where)

    def keys(self):
        return self._where.keys()

    def items(self):
        self._check()
        return ((n, self[n]) for n in self._where)

    def values(self):
        self._check()
        return (self[n] for n in self._where)


@dataclass
class PreparedUpdate:
    """Trainer weights bound to a sender's GPU update program (WeightSender.prepare)."""

    bound: object
    tensors: dict


def _first_nonfinite(plan: Plan, tensors: dict) -> Optional[str]:
    import torch

    for t in plan.tensors:
        x = tensors.get(t.hf_name)
        if x is not None and x.is_floating_point() and not bool(torch.isfinite(x).all()):
            return t.hf_name
    return None


SAMPLED_FINGERPRINT_STRIDE = 16  # a GPU-program sender without check_equal digests every 16th 32 KB block
