"""The receiving end: buckets -> the plan's checkpoint tensors, applied only when the update is complete and intact
(checksums / fingerprints, completeness, dtypes and shapes against the plan, optional per-tensor digests)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from precision_dsl.plan import Plan

from precision_dsl.backends.quantize import read_quantized
from precision_dsl.backends.weight_update.buckets import _digest, check_bucket_meta, unpack_bucket
from precision_dsl.backends.weight_update.errors import WeightUpdateAborted, WeightUpdateError, WeightUpdateMismatch
from precision_dsl.backends.weight_update.program import _BucketViews, _copy_layout, layout_index, same_layout
from precision_dsl.backends.weight_update.transports import InProcessTransport

if TYPE_CHECKING:
    import torch


class WeightReceiver:
    """Receiving end for InProcessTransport / TorchDistributedTransport."""

    def __init__(self, plan: Plan, transport, check_equal: bool = True):
        self.plan, self.transport, self.check_equal = plan, transport, check_equal
        self.raw: dict[str, torch.Tensor] = {}
        self.summary: Optional[dict] = None
        # (bucket metas, their index) of the last GPU-program layout that passed _check_complete: a rollout keeps
        # one receiver, and the program sends the same layout every update, so its per-tensor check (~75k
        # checkpoint tensors for a 30B NVFP4 model) is done once, not on every update
        self._layout: Optional[tuple] = None
        # Set (the reason) when an update that overwrote this receiver's kept buffers in place (a persistent /
        # direct InProcessTransport: the colocated rollout's weights ARE those buffers) did not complete: the
        # buffers hold part new, part old weights. The dict returned last refuses every lookup from then on, and
        # stays refused; the next complete update clears it.
        self.stale: Optional[str] = None

    def _torn(self, reason: str, served) -> None:
        """The kept buffers hold part of an update that did not land: `served` (the weights handed out last) and
        every later lookup are refused until a complete update lands."""
        self.stale = reason
        if isinstance(served, _BucketViews):
            served.refuse(reason)
        self.raw = {}

    def receive_raw(self, timeout: Optional[float] = 600) -> dict[str, torch.Tensor]:
        """Checkpoint-named tensors (X.weight, X.weight_scale_inv, ...) exactly as sent. Raises WeightUpdateAborted
        when the sender aborted; if that update had already overwritten this receiver's kept buffers (see
        `stale`), the weights returned by the previous call are refused too (their lookups raise) until a complete
        update lands."""
        self.transport.handshake(self.plan.content_hash())
        served = self.raw
        self.raw = {}
        bufs: list = []
        metas: list = []
        in_place = bool(getattr(self.transport, "persistent", False))
        while True:
            kind, meta, buf = self.transport.recv(timeout=timeout) if isinstance(self.transport, InProcessTransport) \
                else self.transport.recv()
            if kind == "abort":
                if meta.get("torn"):
                    self._torn(f"torn by an aborted update ({meta.get('reason')})", served)
                    raise WeightUpdateAborted(
                        f"the sender aborted the update: {meta.get('reason')}; this receiver's weights were "
                        "overwritten in place and are refused until a complete update lands",
                        "fix the cause and send a complete update; until then the rollout has no valid weights")
                self.raw = {}
                raise WeightUpdateAborted(f"the sender aborted the update: {meta.get('reason')}")
            if kind == "close":
                self.summary = meta
                break
            if "offsets" in meta:  # GPU program layout: views made on first access, not per tensor here
                bufs.append(buf)
                metas.append(meta)
                continue
            try:
                self.raw.update(unpack_bucket(meta, buf))
            except WeightUpdateError:
                self._drain(timeout)  # keep the stream in step: the next update starts at its own 'open'
                self.raw = {}
                raise
        program_only = bool(metas) and not self.raw  # every tensor came in GPU-program buckets
        # the same layout as an update already checked (list equality: identity first, then by value)
        known = program_only and self._layout is not None and same_layout(self._layout[0], metas)
        try:
            self._check_layouts(metas, bufs, known)
            if metas:
                index = self._layout[1] if known else layout_index(metas)
                lazy = _BucketViews(metas, bufs, index)
                if self.raw:
                    lazy.update_from(self.raw)
                self.raw = lazy
            if bufs:
                self._check_fingerprints(bufs)
            if self.summary.get("tensors") != len(self.raw):
                raise WeightUpdateMismatch(f"received {len(self.raw)} tensors, "
                                           f"the sender sent {self.summary.get('tensors')}")
            if not known:
                self._check_complete()
        except WeightUpdateError as err:
            self.raw = {}
            if in_place and bufs:  # the refused bytes already sit in the kept buffers
                self._torn(f"overwritten by a refused update ({err})", served)
            raise
        if program_only and not known:
            self._layout = (_copy_layout(metas), index)
        self.stale = None  # a complete, checked update landed
        digests = self.summary.get("digests")
        if self.check_equal and digests:
            bad = sorted(n for n, d in digests.items() if n not in self.raw or _digest(self.raw[n]) != d)
            if bad:
                raise WeightUpdateMismatch(f"{len(bad)} tensor(s) differ between sender and receiver, e.g. {bad[0]}")
        return self.raw

    @staticmethod
    def _check_layouts(metas: list, bufs: list, known: bool) -> None:
        """GPU-program buckets: every layout against its buffer before any tensor view exists (the views are made
        when the rollout first reads a tensor, too late to refuse the update). A layout equal to one already
        checked needs only its buffers' sizes."""
        for m, b in zip(metas, bufs):
            if not known:
                check_bucket_meta(m, b.numel())
            elif b.numel() != m["total"]:
                raise WeightUpdateMismatch(f"GPU-program bucket of {b.numel()} bytes, its layout says {m['total']}",
                                           "sender and receiver must run the same policyc")

    def _drain(self, timeout) -> None:
        while True:
            kind, _meta, _buf = self.transport.recv(timeout=timeout) if isinstance(self.transport,
                                                                                 InProcessTransport) \
                else self.transport.recv()
            if kind in ("close", "abort"):
                return

    def _check_fingerprints(self, bufs: list) -> None:
        """GPU-program buckets: the on-GPU fingerprints the sender computed after filling each bucket (always sent)
        must match the bytes that arrived - their per-bucket checksum."""
        import torch

        from precision_dsl.kernels import triton_segments

        fps = self.summary.get("fingerprints")
        if fps is None and self.summary.get("direct"):
            # written in place into these very buffers (one memory): nothing moved that a digest could check
            if self.check_equal:
                raise WeightUpdateMismatch("the sender wrote into this receiver's buffers without fingerprints, "
                                           "this receiver checks every byte (check_equal=True)",
                                           "create the WeightSender with check_equal=True too, or the receiver "
                                           "with check_equal=False")
            return
        stride = self.summary.get("fingerprint_stride", 1)
        if not isinstance(fps, list) or not isinstance(stride, int) or stride < 1:
            raise WeightUpdateMismatch("GPU-program buckets arrived without fingerprints",
                                       "sender and receiver must run the same policyc")
        if self.check_equal and stride != 1:
            raise WeightUpdateMismatch(f"the sender fingerprinted 1/{stride} of each bucket, this receiver checks "
                                       "every byte (check_equal=True)", "create the WeightSender with "
                                       "check_equal=True too, or the receiver with check_equal=False")
        mine = torch.zeros(len(bufs), dtype=torch.int64, device=bufs[0].device)
        for k, b in enumerate(bufs):
            triton_segments.fingerprint(b, mine[k:k + 1], stride)
        bad = [k for k, (x, y) in enumerate(zip(mine.tolist(), fps)) if x != y]
        if bad or len(bufs) != len(fps):
            raise WeightUpdateMismatch(f"bucket(s) {bad or 'count'} differ between sender and receiver "
                                       "(on-GPU fingerprints)")

    def _check_complete(self) -> None:
        """Exactly the plan's checkpoint tensors, with the plan's dtypes and shapes: nothing missing, nothing
        extra, so an update is applied whole or not at all."""
        from precision_dsl.backends.quantize import output_specs
        from precision_dsl.backends.safetensors_io import _TORCH_DT

        want = {n: (dt, tuple(sh)) for t in self.plan.tensors for n, dt, sh in output_specs(t)}
        missing = sorted(set(want) - set(self.raw))
        extra = sorted(set(self.raw) - set(want))
        if missing or extra:
            raise WeightUpdateMismatch(f"update does not match the plan: {len(missing)} tensor(s) missing (e.g. "
                                       f"{missing[:1]}), {len(extra)} unexpected (e.g. {extra[:1]})")
        spec = getattr(self.raw, "spec", None)  # lazy GPU-program views: dtype/shape from the bucket layout
        for n, (dt, sh) in want.items():
            if spec is not None:
                got_dt, got_sh = spec(n)
            else:
                x = self.raw[n]
                got_dt, got_sh = str(x.dtype).replace("torch.", ""), tuple(x.shape)
            if got_dt != _TORCH_DT[dt] or got_sh != sh:
                raise WeightUpdateMismatch(f"tensor '{n}' arrived as {got_dt} {got_sh}, the plan says {dt} {sh}")

    def receive(self, timeout: Optional[float] = 600) -> dict:
        """{hf_name: QuantizedTensor | Tensor} for every plan tensor."""
        raw = self.receive_raw(timeout)
        from precision_dsl.backends.quantize import output_specs

        out = {}
        for t in self.plan.tensors:
            names = [n for n, _, _ in output_specs(t)]
            missing = [n for n in names if n not in raw]
            if missing:
                raise WeightUpdateMismatch(f"tensor '{missing[0]}' of plan tensor '{t.hf_name}' was not received")
            out[t.hf_name] = read_quantized(t, {n: raw[n] for n in names})
        return out
