"""The weight_update backend: `emit(plan)` -> weight_update/manifest.json, what the live update of a plan sends."""

from __future__ import annotations

import math

from precision_dsl.plan import Plan
from precision_dsl.backends.registry import Backend, EmitOptions, register_backend

from precision_dsl.backends.weight_update.buckets import atomic_groups


def emit(plan: Plan, bucket_bytes: int = 512 << 20, rollout: str = "sglang"):
    """weight_update/manifest.json: per Megatron parameter, the HF tensors it becomes and the exact rollout tensors
    (name, dtype, shape) the update sends to rollout engine `rollout` (its names: quantize.output_specs); the atomic
    groups; the bucket count at `bucket_bytes`."""
    from precision_dsl.backends.common import Artifact, dump_json, plan_stamp
    from precision_dsl.backends.quantize import check_all_supported, plan_output_specs
    from precision_dsl.backends.safetensors_io import DTYPE_SIZES

    check_all_supported(plan, "weight_update")
    params: dict[str, dict] = {}
    sizes: dict[str, int] = {}
    # output bytes by what output_specs reads (weight format object, linear?, shape): a few dozen distinct among 46k
    size_of: dict[tuple, int] = {}
    prod = math.prod
    for t, specs in zip(plan.tensors, plan_output_specs(plan, rollout)):
        layout = (id(t.precision.weight), t.is_linear, t.shape)  # the plan keeps the formats alive
        nbytes = size_of.get(layout)
        if nbytes is None:
            nbytes = size_of[layout] = sum([DTYPE_SIZES[dt] * prod(sh) for _, dt, sh in specs])
        sizes[t.hf_name] = nbytes
        entry = params.get(t.megatron_name or t.hf_name)
        if entry is None:  # specs are (name, dtype, shape) tuples: JSON writes them as the [name, dtype, [dims]] lists
            params[t.megatron_name or t.hf_name] = {"hf": [t.hf_name], "outputs": list(specs)}
        else:
            entry["hf"].append(t.hf_name)
            entry["outputs"].extend(specs)
    atoms = atomic_groups(plan)
    groups = [sorted(ns) for ns in atoms.values() if len(ns) > 1]
    order = {t.hf_name: i for i, t in enumerate(plan.tensors)}
    buckets, size = 0, 0
    for ns in sorted(atoms.values(), key=lambda ns: max([order[n] for n in ns])):
        nb = sum([sizes[n] for n in ns])
        if size and size + nb > bucket_bytes:
            buckets, size = buckets + 1, 0
        size += nb
    buckets += 1 if size else 0
    manifest = {"policyc": plan_stamp(plan), "bucket_bytes": bucket_bytes, "buckets": buckets,
                "atomic_groups": sorted(groups), "params": params}
    return [Artifact("weight_update/manifest.json", dump_json(manifest, compact=True),
                     "Megatron param -> rollout tensors (name, dtype, shape), atomic groups, buckets")]


@register_backend
class WeightUpdateBackend(Backend):
    name = "weight_update"
    role = "update"
    description = "the live weight update: per Megatron parameter the rollout tensors it sends, atomic groups, buckets"

    def artifacts(self, plan: Plan, options: EmitOptions) -> list:
        return emit(plan, bucket_bytes=options.bucket_bytes, rollout=options.rollout)

    def derive_formats(self, artifacts, arch) -> dict[str, str]:
        """The rollout's weight formats from the tensors weight_update/manifest.json says the update sends (read
        like the converter's checkpoint: the receiver loads the same tensors)."""
        from precision_dsl.backends.converter import derive_formats_of_outputs

        return derive_formats_of_outputs(artifacts, "weight_update/manifest.json",
                                         lambda doc: [p["outputs"] for p in (doc.get("params") or {}).values()], arch)
