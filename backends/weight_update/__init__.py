"""Live weight update: trainer weights -> the rollout's quantized tensors, bucketed, over a transport.

The bytes come from `precision_dsl.backends.quantize.checkpoint_tensors`, the same function the checkpoint converter uses, so
for the same weights the update path and `policyc convert` produce byte-identical tensors (tested per format).

API (used by the RL engine)::

    from precision_dsl.backends.weight_update import WeightSender, WeightReceiver, InProcessTransport

    transport = InProcessTransport()        # or TorchDistributedTransport(), SGLangHTTPTransport(url),
                                            # VLLMHTTPTransport(plan, url, broadcast_fn=...)
    report = WeightSender(plan, transport, bucket_bytes=512 << 20).send(state_dict_iter, weight_version="step-7")
    weights = WeightReceiver(plan, transport).receive()   # {hf_name: QuantizedTensor | Tensor}

* `state_dict_iter` yields (name, tensor) pairs named either like the HF checkpoint
  (`model.layers.3.mlp.experts.17.gate_proj.weight`) or like Megatron-core (`decoder.layers.3.mlp.experts.
  linear_fc1.weight17`, fused fc1 = [gate; up], linear_qkv grouped per KV head), full (TP-gathered) tensors with
  GLOBAL expert indices. `gather_megatron_shards(...)` turns per-rank TP/EP shards into that form first.
* Work units: members of an NVFP4 share-scale group are quantized together (one global amax). Atomic groups
  (fused siblings: q/k/v, gate/up, q_a/kv_a; SGLang's loader needs both halves in one load_weights call) always
  travel in one bucket. Buckets are filled up to `bucket_bytes` (a unit larger than that travels alone).
* All or nothing: `prepare` (names, completeness against the plan for EVERY tensor, no extras or duplicates,
  quantization, NaN/Inf before and after every cast -> `NonFiniteWeight`) runs before the transport is opened; a
  failure after that calls `transport.abort` (receivers discard the partial update; the SGLang client closes the
  bracket and reloads the served checkpoint, or marks the version `incomplete:`) and raises WeightUpdateAborted.
  Receivers apply nothing until every tensor of the plan arrived with its planned dtype and shape.
* Every bucket carries a cheap checksum (CRC32 on host buffers, a device-side sum64 on GPU buffers), always on.
* Both ends check the plan content hash first (in-process / torch.distributed: a symmetric handshake; SGLang: the
  served checkpoint's policyc_plan.json) and refuse a mismatch with `PlanMismatch`.
* `check_equal=True` (like Miles' --check-weight-update-equal): the sender ships a sha256 per tensor with the last
  message; the receiver compares what it holds and raises `WeightUpdateMismatch` listing the differing tensors.

Modules (by concern): `buckets` (atomic units, the wire form of a bucket, checksums), `transports` (in-process,
torch.distributed, SGLang HTTP), `vllm_transport` (vLLM 0.33's weight-transfer API), `sender` (WeightSender),
`receiver` (WeightReceiver), `program` (the GPU update program's plumbing on both ends; the program itself is
backends/update_program.py), `names` (Megatron -> HF names, TP/EP shard gathering), `partition` (which slices an
SGLang rollout rank holds), `sharded` (a sharded trainer updating a sharded rollout: gather, quantize, per-rank
partitions, all-or-nothing across ranks), `backend` (`emit`: the weight_update/manifest.json artifact), `errors`.
"""

from precision_dsl.backends.common import PlanMismatch
from precision_dsl.backends.quantize import NonFiniteWeight
from precision_dsl.backends.weight_update.backend import emit
from precision_dsl.backends.weight_update.buckets import atomic_groups, bucket_checksum, pack_bucket, unpack_bucket
from precision_dsl.backends.weight_update.errors import WeightUpdateAborted, WeightUpdateError, WeightUpdateMismatch
from precision_dsl.backends.weight_update.names import RankShard, gather_megatron_shards, megatron_to_hf
from precision_dsl.backends.weight_update.partition import (PartitionError, RolloutRank, Slice, partition_specs,
                                                            partition_tensors, rollout_partition)
from precision_dsl.backends.weight_update.program import SAMPLED_FINGERPRINT_STRIDE, PreparedUpdate, layout_index
from precision_dsl.backends.weight_update.receiver import WeightReceiver
from precision_dsl.backends.weight_update.sender import SendReport, WeightSender
from precision_dsl.backends.weight_update.sharded import ShardedLayout, ShardedReport, ShardedUpdate
from precision_dsl.backends.weight_update.transports import (InProcessTransport, SGLangHTTPTransport,
                                                             TorchDistributedTransport)
from precision_dsl.backends.weight_update.vllm_transport import VLLMHTTPTransport, vllm_named_tensors

__all__ = ["WeightSender", "WeightReceiver", "InProcessTransport", "TorchDistributedTransport",
           "SGLangHTTPTransport", "megatron_to_hf", "gather_megatron_shards", "RankShard", "NonFiniteWeight",
           "PlanMismatch", "WeightUpdateMismatch", "WeightUpdateError", "WeightUpdateAborted", "SendReport",
           "bucket_checksum", "emit", "atomic_groups", "pack_bucket", "unpack_bucket", "layout_index",
           "PreparedUpdate", "SAMPLED_FINGERPRINT_STRIDE", "VLLMHTTPTransport", "vllm_named_tensors", "PartitionError",
           "RolloutRank", "Slice", "partition_specs", "partition_tensors", "rollout_partition", "ShardedLayout",
           "ShardedReport", "ShardedUpdate"]
