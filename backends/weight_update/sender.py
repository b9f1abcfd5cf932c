"""The sending end: trainer weights -> atomic units -> quantized checkpoint tensors -> buckets over a transport (or
the GPU update program), all or nothing."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterable, Iterator, Optional

from precision_dsl.plan import Plan, TensorPlan

from precision_dsl.backends.quantize import NonFiniteWeight, checkpoint_tensors, needs_shared_amax
from precision_dsl.backends.weight_update.buckets import _digest, atomic_groups, pack_bucket
from precision_dsl.backends.weight_update.errors import WeightUpdateAborted, WeightUpdateError
from precision_dsl.backends.weight_update.names import _NameMap
from precision_dsl.backends.weight_update.program import (SAMPLED_FINGERPRINT_STRIDE, PreparedUpdate,
                                                          _first_nonfinite)

if TYPE_CHECKING:
    import torch


@dataclass
class SendReport:
    plan_hash: str
    buckets: int = 0
    tensors: int = 0
    bytes: int = 0
    bucket_names: list[list[str]] = field(default_factory=list)
    digests: dict[str, str] = field(default_factory=dict)


class WeightSender:
    def __init__(self, plan: Plan, transport, bucket_bytes: int = 512 << 20, check_equal: bool = False,
                 arch_config: Optional[dict] = None, min_buckets: int = 8, gpu_program: Optional[bool] = None):
        # gpu_program: None = the GPU update program whenever the transport takes GPU buffers (its `gpu_program`)
        # and the weights are CUDA tensors; False = always the per-unit path (a caller whose weights are fresh
        # tensors each update: the program binds the sender's tensors once and expects them updated in place)
        # min_buckets (GPU update program only): shrink the buckets until the update has at least this many, so
        # quantization overlaps the transfer even for a small model (bucket_bytes stays the upper bound). 8: the
        # 1.34B NVFP4 update over NCCL went 2.11x -> 1.96x a bare broadcast with it (16: 2.24x; same H200-x2 run,
        # benchmarks/results_s9_wu_nccl_min_buckets.json); models of >= 8 full buckets are unaffected
        self.plan, self.transport, self.bucket_bytes = plan, transport, int(bucket_bytes)
        self.min_buckets = max(1, int(min_buckets))
        self.check_equal = check_equal
        self.gpu_program = gpu_program
        self.names = _NameMap(plan, arch_config)
        self._groups = {m: g for g in plan.share_scale_groups for m in g.members}
        self._order = {t.hf_name: i for i, t in enumerate(plan.tensors)}

    def over(self, transport) -> "WeightSender":
        """This sender - its plan, name map and compiled GPU update program (with any binding made from it) - sending
        over another transport: a caller can give every update its own transport while the program is built once."""
        import copy

        other = copy.copy(self)
        other.transport = transport
        return other

    def _atomic_units(self, items: Iterable[tuple[str, torch.Tensor]]
                      ) -> Iterator[list[tuple[TensorPlan, torch.Tensor]]]:
        """Yield complete atomic units (fused siblings + share-scale groups) as soon as all members arrived."""
        by = self.plan.by_name()
        members = atomic_groups(self.plan)
        unit_of_name = {n: k for k, ns in members.items() for n in ns}
        pending: dict[tuple, dict[str, torch.Tensor]] = {}
        seen: set[str] = set()
        for name, x in items:
            for hf, y in self.names.to_hf(name, x):
                if hf in seen:
                    raise WeightUpdateError(f"weight '{hf}' was sent twice in one update")
                seen.add(hf)
                key = unit_of_name[hf]
                pending.setdefault(key, {})[hf] = y
                if set(pending[key]) == members[key]:
                    got = pending.pop(key)
                    yield [(by[n], got[n]) for n in sorted(got, key=lambda n: self._order[n])]
        missing = sorted(n for k in pending for n in members[k] - set(pending[k]))
        if pending:
            raise WeightUpdateError(f"incomplete atomic group(s): {', '.join(missing[:4])} never arrived",
                                    "fused siblings and share-scale groups must all be sent in one update")
        if len(seen) != len(by):  # a lone tensor missing: the rollout would keep a stale copy of it
            absent = [t.hf_name for t in self.plan.tensors if t.hf_name not in seen]
            raise WeightUpdateError(f"incomplete state dict: {len(absent)} of {len(by)} plan tensors never arrived, "
                                    f"e.g. {', '.join(absent[:3])}", "an update must carry every weight of the plan")

    def quantize_all(self, items: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """The quantized checkpoint tensors, one atomic unit at a time (NaN/Inf checked per unit; see send for the
        all-before-send guarantee)."""
        for unit in self._atomic_units(items):
            out: dict[str, torch.Tensor] = {}
            # share-scale groups inside the unit are quantized together; the rest one by one
            groups: dict[str, list] = {}
            for t, x in unit:
                g = self._groups.get(t.hf_name) if needs_shared_amax(t) else None
                groups.setdefault(g.id if g else t.hf_name, []).append((t, x))
            for members in groups.values():
                out.update(checkpoint_tensors(members, backend="weight_update"))
            yield out

    # -- GPU update program (backends/update_program.py) ------------------------------------------------------------
    def program(self):
        """The plan's update compiled into buckets of grouped launches (built once per sender)."""
        if getattr(self, "_program", None) is None:
            from precision_dsl.backends.update_program import UpdateProgram

            members = atomic_groups(self.plan)
            by = self.plan.by_name()
            units = [[by[n] for n in sorted(ns, key=self._order.__getitem__)] for ns in members.values()]
            units.sort(key=lambda u: self._order[u[-1].hf_name])
            prog = UpdateProgram(self.plan, units, self.bucket_bytes)
            if len(prog.buckets) < self.min_buckets:
                # a small model in a few large buckets leaves nothing to overlap: the first bucket's quantization
                # and the last one's transfer run alone. Smaller buckets (not below 32 MiB) deepen the pipeline.
                size = max(32 << 20, -(-prog.bytes // self.min_buckets))
                if size < self.bucket_bytes:
                    prog = UpdateProgram(self.plan, units, size)
            self._program = prog
        return self._program

    def prepare_program(self, items: Iterable[tuple[str, torch.Tensor]]) -> "PreparedUpdate":
        """Bind the trainer's weights once (names mapped, segments stacked - zero-copy where the weights are views
        of grouped buffers) so that every later `send(prepared)` only launches kernels. The binding holds views
        of the weights: valid while the trainer updates them in place (as optimizers do). Refuses, with nothing
        sent, exactly what the per-unit path refuses before sending: duplicates, names outside the plan, missing
        tensors, wrong shapes (NaN/Inf is counted on the GPU during the update; see _send_program). `prepare`
        picks this itself for CUDA weights on a GPU-buffer transport."""
        by = self.plan.by_name()
        hf: dict = {}
        for name, x in list(items):
            for n, y in self.names.to_hf(name, x):
                if n in hf:
                    raise WeightUpdateError(f"weight '{n}' was sent twice in one update")
                if n not in by:
                    raise WeightUpdateError(f"weight '{n}' is not in the plan",
                                            "an update must carry exactly the plan's weights")
                t = by[n]
                if tuple(y.shape) != tuple(t.shape):
                    raise WeightUpdateError(f"tensor '{n}' has shape {tuple(y.shape)}, the plan says {t.shape}")
                hf[n] = y
        if len(hf) != len(by):  # a lone tensor missing: the rollout would keep a stale copy of it
            absent = [t.hf_name for t in self.plan.tensors if t.hf_name not in hf]
            raise WeightUpdateError(f"incomplete state dict: {len(absent)} of {len(by)} plan tensors never arrived, "
                                    f"e.g. {', '.join(absent[:3])}", "an update must carry every weight of the plan")
        return PreparedUpdate(self.program().bind(hf), hf)

    def _fast_ok(self, items: list) -> bool:
        """CUDA weights, a transport that takes GPU buffers, Triton available: the GPU update program."""
        if self.gpu_program is False or not getattr(self.transport, "gpu_program", False):
            return False
        if not items or not all(getattr(x, "is_cuda", False) for _, x in items):
            return False
        from precision_dsl import kernels

        return kernels.available()

    def prepare(self, items: Iterable[tuple[str, torch.Tensor]]):
        """Everything that can refuse an update, with nothing sent: names, completeness against the plan (every
        tensor, no extras, no duplicates), quantization and the finite checks. Per-unit path: a list of quantized
        units (memory: the quantized model, <= the BF16 size, held once). CUDA weights on a GPU-buffer transport:
        a PreparedUpdate binding for the GPU update program (checked the same way; NaN/Inf there is counted on the
        GPU while the buckets move, and the update is aborted on both ends before the closing message)."""
        items = list(items)
        if self._fast_ok(items):
            return self.prepare_program(items)
        return list(self.quantize_all(items))

    def send(self, items, weight_version: Optional[str] = None) -> SendReport:
        """prepare() then send_prepared(): a refused update never opens the transport. `items`: (name, tensor)
        pairs or the result of prepare()."""
        if isinstance(items, PreparedUpdate):
            return self.send_prepared(items, weight_version)
        return self.send_prepared(self.prepare(items), weight_version)

    def _abort(self, err: BaseException, buckets: int, weight_version: Optional[str]):
        served = None
        abort = getattr(self.transport, "abort", None)
        if abort is not None:
            try:
                served = abort(f"{type(err).__name__}: {err}"[:500])
            except Exception:  # the transport is already broken; the original error is the one to report
                pass
        if not isinstance(err, Exception):  # KeyboardInterrupt & co. stay what they are
            raise err
        hint = getattr(err, "hint", "")
        if getattr(self.transport, "torn", False):  # in-place receiver buffers were partly overwritten
            hint = ("the rollout's weights were overwritten in place by this incomplete update: its receiver "
                    "refuses them until a complete update lands; fix the cause and resend" + (f" ({hint})" if hint
                                                                                           else ""))
        raise WeightUpdateAborted(f"weight update {weight_version or ''} aborted after {buckets} "
                                  f"bucket(s): {err}", hint, served_version=served) from err

    def _direct(self) -> bool:
        """The transport hands out the receiver's own bucket buffers (InProcessTransport(persistent=True))."""
        return bool(getattr(self.transport, "direct", False)) and hasattr(self.transport, "gpu_destination")

    def _send_program(self, prep: "PreparedUpdate", weight_version: Optional[str]) -> SendReport:
        prog = self.program()
        plan_hash = self.plan.content_hash()
        if hasattr(self.transport, "weight_version"):
            self.transport.weight_version = weight_version
        self.transport.open(plan_hash)
        try:
            if hasattr(self.transport, "send_layout"):
                self.transport.send_layout(prog.metas)
            # fingerprints: the GPU buckets' checksums (the receiver verifies them). Every word with check_equal;
            # else sampled (1/16 of each bucket): reading all the wire bytes once more on each end was a third of a
            # BF16 update's GPU time on one H200. Direct mode (the program writes into the receiver's own buffers,
            # one memory): a sampled digest would compare the receiver's bytes with themselves, so only
            # check_equal fingerprints - taken right after each bucket is filled, re-read by the receiver after the
            # last one (a bucket overwritten or aliased in between differs)
            direct = self._direct()
            stride = 1 if self.check_equal else SAMPLED_FINGERPRINT_STRIDE
            bad, fps = prog.run(prep.bound, lambda k, meta, buf: self.transport.send_gpu_bucket(meta, buf),
                                check_equal=self.check_equal or not direct, fingerprint_stride=stride,
                                dest=self.transport.gpu_destination if direct else None)
            n_bad = int(bad.item())  # the update's one host synchronisation
            if n_bad:  # every bucket has moved; abort instead of closing: receivers discard them
                raise NonFiniteWeight(_first_nonfinite(self.plan, prep.tensors) or "?", n_bad)
            report = SendReport(plan_hash=plan_hash, buckets=len(prog.buckets), tensors=prog.tensors,
                                bytes=prog.bytes, bucket_names=prog.bucket_names)
            self.transport.close({"plan_hash": plan_hash, "tensors": prog.tensors, "bytes": prog.bytes,
                                  "weight_version": weight_version, "digests": None,
                                  "fingerprints": None if fps is None else fps.tolist(),
                                  "fingerprint_stride": None if fps is None else stride})
        except BaseException as err:
            self._abort(err, len(prog.buckets), weight_version)
        return report

    def send_prepared(self, units, weight_version: Optional[str] = None) -> SendReport:
        """Bucket and send prepared units (or a GPU-program binding). All or nothing: any failure after the
        transport is opened is followed by `transport.abort(reason)` (receivers discard what they got; the SGLang
        client closes the bracket and rolls back) and raised as WeightUpdateAborted naming the version the consumer
        serves afterwards."""
        if isinstance(units, PreparedUpdate):
            return self._send_program(units, weight_version)
        plan_hash = self.plan.content_hash()
        report = SendReport(plan_hash=plan_hash)
        if hasattr(self.transport, "weight_version"):
            self.transport.weight_version = weight_version
        self.transport.open(plan_hash)
        try:
            self._send_units(units, report, plan_hash, weight_version)
        except BaseException as err:
            self._abort(err, report.buckets, weight_version)
        return report

    def _send_units(self, units, report: SendReport, plan_hash: str, weight_version) -> None:
        bucket: dict[str, torch.Tensor] = {}
        size = 0

        def flush():
            nonlocal bucket, size
            if not bucket:
                return
            meta, buf = pack_bucket(bucket)
            self.transport.send_bucket(meta, bucket, buf)
            report.buckets += 1
            report.bucket_names.append(list(bucket))
            bucket, size = {}, 0

        for unit in units:
            nb = sum(t.numel() * t.element_size() for t in unit.values())
            if bucket and size + nb > self.bucket_bytes:
                flush()
            bucket.update(unit)
            size += nb
            report.tensors += len(unit)
            report.bytes += nb
            if self.check_equal:
                report.digests.update({n: _digest(t) for n, t in unit.items()})
        flush()
        self.transport.close({"plan_hash": plan_hash, "tensors": report.tensors, "bytes": report.bytes,
                              "weight_version": weight_version,
                              "digests": report.digests if self.check_equal else None})
