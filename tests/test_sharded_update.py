"""backends/weight_update/{partition,sharded}.py: a sharded trainer (Megatron TP/EP/expert-TP, one process per rank)
updating a sharded rollout (SGLang TP/EP) over gloo. Every rollout rank receives exactly the converter's bytes cut
by the partition rule; a failure on any rank aborts every rank before anything is applied; a rank with another
plan is refused with PlanMismatch on all ranks; a layout that splits a scale block is refused."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from precision_dsl.backends import converter
from precision_dsl.backends.synthetic import megatron_shard, megatron_weights, write_synthetic_checkpoint
from precision_dsl.backends.weight_update import (PartitionError, RolloutRank, ShardedLayout, partition_specs,
                                                  partition_tensors, rollout_partition)
from precision_dsl.backends.weight_update.partition import Slice
from test_weight_update import arch, plan_for  # tiny-moe and its plans (incl. the fp8_block test policy)

REPO = Path(__file__).resolve().parents[1]
NVFP4 = "nvfp4-pertoken-hp-backward"
MXFP8 = "mxfp8-e2e"
# 2 trainer ranks (TP=2 for dense, EP=2 for experts) + 2 rollout ranks (TP=2, EP=2: moe_tp=1)
EP_LAYOUT = dict(trainer_tp=2, trainer_ep=2, trainer_etp=1, rollout_tp=2, rollout_ep=2)
# equal expert-TP on both sides: trainer etp=2, rollout tp=2, ep=1 (SGLang moe_tp = 2)
ETP_LAYOUT = dict(trainer_tp=2, trainer_ep=1, trainer_etp=2, rollout_tp=2, rollout_ep=1)
# (name, policy, layout, fault (point, rank) or None, rank that resolves another policy or None)
SCENARIOS = [
    ("ep-nvfp4", NVFP4, EP_LAYOUT, None, None),
    ("etp-nvfp4", NVFP4, ETP_LAYOUT, None, None),
    ("ep-mxfp8", MXFP8, EP_LAYOUT, None, None),
    ("fail-trainer-state", NVFP4, EP_LAYOUT, ("state", 1), None),
    ("fail-trainer-bucket", NVFP4, ETP_LAYOUT, ("bucket", 0), None),
    ("fail-rollout-commit", NVFP4, EP_LAYOUT, ("received", 3), None),
    ("fp8-block-cut", "fp8_block", EP_LAYOUT, None, None),
    ("plan-mismatch", NVFP4, EP_LAYOUT, None, 3),
    ("after", MXFP8, ETP_LAYOUT, None, None),  # the group still works after every failure above
]
OK = ("ep-nvfp4", "etp-nvfp4", "ep-mxfp8", "after")


def _worker(rank, port, src_dir, out_dir):
    import torch.distributed as dist

    from precision_dsl.backends.common import PlanMismatch
    from precision_dsl.backends.weight_update import ShardedUpdate, WeightUpdateAborted

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=4)
    log = {}
    try:
        hf = load_file(str(Path(src_dir) / "model.safetensors"))
        for name, policy, lay, fault, odd_rank in SCENARIOS:
            layout = ShardedLayout(**lay)
            plan = plan_for(MXFP8 if rank == odd_rank else policy)

            def inject(point, r, fault=fault):
                if fault == (point, r):
                    raise RuntimeError(f"injected failure at {point} on rank {r}")

            up = ShardedUpdate(plan, layout, arch().config, bucket_bytes=1 << 16, fault=inject)
            try:
                if layout.is_trainer(rank):
                    meg = megatron_weights(plan, arch().config, hf)
                    rep = up.update(lambda: megatron_shard(meg, layout, rank, arch().config["num_experts"]), name)
                    log[name] = f"sent {rep.bytes} {rep.buckets}"
                else:
                    got, rep = up.update()
                    log[name] = f"applied {rep.bytes}"
                    save_file(got, str(Path(out_dir) / f"{name}.{rank}.safetensors"))
            except WeightUpdateAborted as err:
                log[name] = f"aborted: {err}"
            except PlanMismatch as err:
                log[name] = f"PlanMismatch: {err}"
    finally:
        (Path(out_dir) / f"log.{rank}.json").write_text(json.dumps(log))
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    import torch.multiprocessing as mp

    from tests_util_ports import free_port

    src = tmp_path_factory.mktemp("ssrc")
    write_synthetic_checkpoint(arch(), src, shards=1, seed=7)
    out = tmp_path_factory.mktemp("sout")
    ctx = mp.start_processes(_worker, args=(free_port(), str(src), str(out)), nprocs=4, join=False,
                             start_method="spawn")
    deadline = time.time() + 240
    while not ctx.join(timeout=2):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("sharded update hung (deadlock)")
    logs = {r: json.loads((out / f"log.{r}.json").read_text()) for r in range(4)}
    return src, out, logs


@functools.lru_cache(maxsize=None)
def _converted(src: str, policy: str) -> dict:
    import tempfile

    dst = Path(tempfile.mkdtemp()) / policy
    converter.convert(Path(src), plan_for(policy), dst)
    out = {}
    for f in dst.glob("*.safetensors"):
        out.update(load_file(str(f)))
    return out


def _same(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


@pytest.mark.parametrize("name", OK)
def test_every_rollout_rank_receives_exactly_its_partition_of_the_converters_bytes(run, name):
    src, out, logs = run
    _, policy, lay, _, _ = next(s for s in SCENARIOS if s[0] == name)
    layout, plan = ShardedLayout(**lay), plan_for(policy)
    full = _converted(str(src), policy)
    total = 0
    for rank in (2, 3):
        assert logs[rank][name].startswith("applied"), logs[rank][name]
        got = load_file(str(out / f"{name}.{rank}.safetensors"))
        want = partition_tensors(plan, rollout_partition(plan, arch().config, layout.rollout_rank(rank)), full)
        assert _same(want, got) == []
        assert int(logs[rank][name].split()[1]) == sum(x.numel() * x.element_size() for x in want.values())
        total += int(logs[rank][name].split()[1])
    assert logs[0][name] == f"sent {total} " + logs[0][name].split()[2]  # rank 0 sent exactly the partitions
    assert logs[1][name].startswith("sent 0")  # other trainer ranks only contribute their shards


def test_partitions_cover_experts_once_and_keep_whole_scale_groups(run):
    src, out, _ = run
    plan = plan_for(NVFP4)
    ep = [load_file(str(out / f"ep-nvfp4.{r}.safetensors")) for r in (2, 3)]
    experts = [{n.split(".experts.")[1].split(".")[0] for n in g if ".experts." in n} for g in ep]
    assert experts == [{"0", "1", "2", "3"}, {"4", "5", "6", "7"}]  # EP=2: experts split, not their rows
    etp = [load_file(str(out / f"etp-nvfp4.{r}.safetensors")) for r in (2, 3)]
    down, gate = "model.layers.1.mlp.experts.5.down_proj", "model.layers.1.mlp.experts.5.gate_proj"
    full = _converted(str(src), NVFP4)
    # expert-TP=2: each rank holds half the columns of down (half of its packed bytes and 1x16 scales) ...
    assert [tuple(g[f"{down}.weight"].shape) for g in etp] == [(128, 32), (128, 32)]
    assert torch.equal(torch.cat([g[f"{down}.weight_scale"].view(torch.uint8) for g in etp], 1),
                       full[f"{down}.weight_scale"].view(torch.uint8))
    # ... and the expert's gate/up global scale, computed over the WHOLE share-scale group, on both ranks
    for g in etp:
        assert torch.equal(g[f"{gate}.weight_scale_2"], full[f"{gate}.weight_scale_2"])
    assert any(t.share_scale_group for t in plan.tensors)


def test_a_failure_on_any_rank_aborts_every_rank_and_nothing_is_applied(run):
    _, out, logs = run
    for name, where in (("fail-trainer-state", "prepare"), ("fail-trainer-bucket", "commit"),
                        ("fail-rollout-commit", "commit")):
        for rank in range(4):
            assert logs[rank][name].startswith(f"aborted: sharded weight update aborted in {where}"), logs[rank][name]
            assert "injected failure" in logs[rank][name]
        assert not list(out.glob(f"{name}.*.safetensors"))  # no rollout rank applied it
    assert logs[2]["fail-trainer-state"].count("rank 1") >= 1


def test_a_layout_that_splits_a_scale_block_is_refused_on_every_rank(run):
    _, out, logs = run
    for rank in range(4):
        assert logs[rank]["fp8-block-cut"].startswith("aborted: sharded weight update aborted in prepare")
        assert "splits a 128x128 scale block" in logs[rank]["fp8-block-cut"]
    assert not list(out.glob("fp8-block-cut.*"))


def test_a_rank_with_another_plan_is_refused_on_every_rank(run):
    _, out, logs = run
    for rank in range(4):
        assert logs[rank]["plan-mismatch"].startswith("PlanMismatch: sharded weight update"), logs[rank]
        assert plan_for(NVFP4).content_hash() in logs[rank]["plan-mismatch"]
    assert not list(out.glob("plan-mismatch.*"))
    assert logs[2]["after"].startswith("applied")


# ---- the partition rule (pure) ---------------------------------------------------------------------------------------
def test_partition_rule_follows_sglang_sharding():
    plan, cfg = plan_for(NVFP4), arch().config
    p = [rollout_partition(plan, cfg, RolloutRank(4, 2, r)) for r in range(4)]
    k = "model.layers.0.self_attn.k_proj.weight"
    # 2 KV heads on tp=4: each head replicated on 2 consecutive ranks (QKVParallelLinear num_kv_head_replicas)
    assert [(s[k].start, s[k].stop) for s in p] == [(0, 32), (0, 32), (32, 64), (32, 64)]
    o = "model.layers.0.self_attn.o_proj.weight"
    assert [(s[o].dim, s[o].start, s[o].stop) for s in p] == [(1, 0, 32), (1, 32, 64), (1, 64, 96), (1, 96, 128)]
    # vocab 32 padded to 64 and split over 4: ranks 2 and 3 hold only padding
    e = "model.embed_tokens.weight"
    assert [(s[e].start, s[e].stop) for s in p] == [(0, 16), (16, 32), (32, 32), (32, 32)]
    # experts: ep_rank = rank // moe_tp (moe_tp = 2), then moe_tp splits each expert
    gate = "model.layers.0.mlp.experts.{}.gate_proj.weight"
    assert gate.format(3) in p[1] and gate.format(4) not in p[1] and gate.format(4) in p[2]
    assert (p[0][gate.format(0)].start, p[1][gate.format(0)].start) == (0, 64)
    assert p[0]["model.layers.0.mlp.gate.weight"].whole
    specs = partition_specs(plan, p[0])
    assert specs["model.layers.0.mlp.experts.0.down_proj.weight"] == ("U8", (128, 32))
    assert specs["model.layers.0.mlp.experts.0.down_proj.weight_scale"] == ("F8_E4M3", (128, 4))
    assert specs["model.layers.0.mlp.experts.0.down_proj.weight_scale_2"] == ("F32", ())


def test_partition_rule_refuses_cut_blocks_and_impossible_layouts():
    plan, cfg = plan_for("fp8_block"), arch().config
    with pytest.raises(PartitionError, match="128x128 scale block") as e:
        partition_specs(plan, rollout_partition(plan, cfg, RolloutRank(2, 1, 0)))
    assert e.value.hint
    assert partition_specs(plan, rollout_partition(plan, cfg, RolloutRank(1, 1, 0)))  # tp=1 holds whole blocks
    nv = plan_for(NVFP4)
    down = "model.layers.0.mlp.experts.0.down_proj.weight"
    with pytest.raises(PartitionError, match="1x16 scale block"):  # 8 of 128 columns: half an NVFP4 block
        partition_specs(nv, {down: Slice(1, 0, 8)})
    with pytest.raises(PartitionError, match="packed byte"):
        partition_specs(nv, {down: Slice(1, 0, 15)})
    with pytest.raises(PartitionError, match="does not divide"):
        RolloutRank(4, 3, 0)
    with pytest.raises(PartitionError, match="tp=3 does not divide"):
        rollout_partition(nv, cfg, RolloutRank(3, 1, 0))
    with pytest.raises(PartitionError, match="world size"):
        ShardedLayout(trainer_tp=2, trainer_ep=3)


# ---- per-token NVFP4 activation scales over each rank's real partition -------------------------------------------
def test_equal_expert_tp_keeps_the_per_token_contract_unequal_is_refused_and_measurable():
    from precision_dsl.engine.loop import ContractViolation
    from precision_dsl.engine.remote import check_sharded_layout, partition_activation_mismatch

    plan, cfg = plan_for("nvfp4-pertoken-dequant-backward"), arch().config
    x = torch.randn(16, 128, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.05, 6, 128)
    equal = ShardedLayout(**ETP_LAYOUT)  # trainer etp 2, rollout moe_tp 2
    assert not [d for d in check_sharded_layout(plan, arch(), equal) if d.severity == "error"]
    assert partition_activation_mismatch(plan, cfg, equal, x) == 0.0
    unequal = ShardedLayout(trainer_tp=2, trainer_etp=2, rollout_tp=2, rollout_ep=2)  # rollout moe_tp = 1
    with pytest.raises(ContractViolation, match="etp-mismatch"):
        check_sharded_layout(plan, arch(), unequal)
    found = check_sharded_layout(plan, arch(), unequal, force_layout=True)
    assert any(d.code == "etp-mismatch" for d in found)
    assert partition_activation_mismatch(plan, cfg, unequal, x) > 0.0
