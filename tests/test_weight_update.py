"""backends/weight_update/: the live update path produces BYTE-IDENTICAL tensors to the converter (per format,
HF and Megatron naming, TP/EP shards), keeps atomic groups in one bucket, refuses NaN/Inf and plan mismatches,
checks equality, and speaks SGLang 0.5.23's HTTP protocol (against a local stub on 127.0.0.1)."""

from __future__ import annotations

import base64
import functools
import http.server
import json
import pickle
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from precision_dsl.backends import converter
from precision_dsl.backends.common import PlanMismatch
from precision_dsl.backends.quantize import NonFiniteWeight
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.backends.weight_update import (InProcessTransport, RankShard, SGLangHTTPTransport, WeightReceiver, WeightSender,
                                    WeightUpdateError, WeightUpdateMismatch, gather_megatron_shards)
from precision_dsl.arch import load_architecture
from precision_dsl.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
FP8_BLOCK_POLICY = """
policy "fp8b" {
    target hopper
    default bf16
    attn: fp8_block(scales=fp32) backward=quantized
    routed_experts: fp8_block(scales=fp32) backward=quantized
}
"""
FORMATS = ["mxfp8-e2e", "nvfp4-pertoken-hp-backward", "fp8_block", "bf16"]


@functools.lru_cache(maxsize=None)
def arch():
    return load_architecture("tiny-moe")


@functools.lru_cache(maxsize=None)
def plan_for(name):
    if name == "fp8_block":
        import tempfile

        p = Path(tempfile.mkdtemp()) / "fp8b.policy"
        p.write_text(textwrap.dedent(FP8_BLOCK_POLICY))
        return resolve(p, arch(), None)
    return resolve(REPO / "policies" / f"{name}.policy", arch(), None)


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    d = tmp_path_factory.mktemp("wsrc")
    write_synthetic_checkpoint(arch(), d, shards=1, seed=3)
    return d


@pytest.fixture(scope="module")
def converted(src, tmp_path_factory):
    """{policy: (dst dir, {name: tensor})} converter outputs."""
    out = {}
    for name in FORMATS:
        dst = tmp_path_factory.mktemp("conv") / name
        converter.convert(src, plan_for(name), dst)
        tensors = {}
        for f in dst.glob("*.safetensors"):
            with safe_open(str(f), "pt") as h:
                tensors.update({k: h.get_tensor(k) for k in h.keys()})
        out[name] = (dst, tensors)
    return out


def hf_weights(src):
    return load_file(str(src / "model.safetensors"))


def same_bytes(a: dict, b: dict) -> list[str]:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:5]
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape
            or not torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))]


def to_megatron(plan, hf: dict) -> dict:
    """Megatron-core layout built by hand: fc1 = cat([gate, up]), linear_qkv grouped per KV head."""
    cfg = arch().config
    hd, ng = cfg["head_dim"], cfg["num_key_value_heads"]
    qpg = cfg["num_attention_heads"] // ng
    by_meg: dict[str, dict] = {}
    for t in plan.tensors:
        by_meg.setdefault(t.megatron_name, {})[t.megatron_part] = hf[t.hf_name]
    out = {}
    for name, parts in by_meg.items():
        if set(parts) == {None}:
            out[name] = parts[None]
        elif set(parts) == {"gate", "up"}:
            out[name] = torch.cat([parts["gate"], parts["up"]], 0)
        elif set(parts) == {"q", "k", "v"}:
            h = parts["q"].shape[1]
            q = parts["q"].reshape(ng, qpg, hd, h)
            k = parts["k"].reshape(ng, 1, hd, h)
            v = parts["v"].reshape(ng, 1, hd, h)
            out[name] = torch.cat([q, k, v], 1).reshape(-1, h)
        else:
            raise AssertionError(parts.keys())
    return out


def send_in_process(plan, items, **kw):
    tr = InProcessTransport()
    rep = WeightSender(plan, tr, **kw).send(items)
    return rep, WeightReceiver(plan, tr).receive_raw()


@pytest.mark.parametrize("policy", FORMATS)
def test_hf_named_update_is_byte_identical_to_converter(src, converted, policy):
    rep, raw = send_in_process(plan_for(policy), iter(hf_weights(src).items()), bucket_bytes=1 << 18,
                               check_equal=True)
    assert same_bytes(converted[policy][1], raw) == []
    assert rep.buckets > 1


@pytest.mark.parametrize("policy", ["nvfp4-pertoken-dequant-backward", "mxfp8-hp-backward"])
def test_megatron_named_update_is_byte_identical_to_converter(src, tmp_path, policy):
    plan = plan_for(policy)
    dst = tmp_path / "c"
    converter.convert(src, plan, dst)
    ref = load_file(str(dst / "model.safetensors"))
    meg = to_megatron(plan, hf_weights(src))
    assert "decoder.layers.0.self_attention.linear_qkv.weight" in meg
    _, raw = send_in_process(plan, reversed(list(meg.items())), arch_config=arch().config)
    assert same_bytes(ref, raw) == []


def split_for_tp_ep(meg: dict, tp: int, ep: int, num_experts: int) -> list[RankShard]:
    e_local = num_experts // ep
    shards = []
    for tr in range(tp):
        for er in range(ep):
            st = {}
            for n, x in meg.items():
                if ".mlp.experts.linear_fc" in n:
                    e = int(n.rsplit("weight", 1)[1])
                    if e // e_local == er:
                        st[n.rsplit("weight", 1)[0] + f"weight{e % e_local}"] = x
                elif n.endswith(("linear_proj.weight", "linear_fc2.weight")):
                    st[n] = x.chunk(tp, 1)[tr]
                elif n.endswith("linear_fc1.weight"):
                    g, u = x.chunk(2, 0)
                    st[n] = torch.cat([g.chunk(tp, 0)[tr], u.chunk(tp, 0)[tr]], 0)
                elif n.endswith(("linear_qkv.weight", "word_embeddings.weight", "output_layer.weight")):
                    st[n] = x.chunk(tp, 0)[tr]
                else:
                    st[n] = x
            shards.append(RankShard(tp_rank=tr, ep_rank=er, state=st))
    return shards


def test_tp_ep_shards_gather_to_the_full_megatron_weights(src):
    plan = plan_for("nvfp4-pertoken-hp-backward")
    meg = to_megatron(plan, hf_weights(src))
    shards = split_for_tp_ep(meg, tp=2, ep=2, num_experts=arch().config["num_experts"])
    assert any("weight3" in n for n in shards[-1].state) and not any("weight7" in n for n in shards[-1].state)
    full = gather_megatron_shards(shards, tp=2, ep=2, etp=1)
    assert same_bytes(meg, full) == []


def test_buckets_keep_atomic_groups_together(src):
    plan = plan_for("nvfp4-pertoken-hp-backward")
    rep, raw = send_in_process(plan, iter(hf_weights(src).items()), bucket_bytes=40_000)
    by = plan.by_name()
    home: dict = {}
    for i, names in enumerate(rep.bucket_names):
        for n in names:
            t = by.get(n) or by.get(n.rsplit(".", 1)[0] + ".weight")
            key = t.fused_key if t.fused_key else ("one", t.hf_name)
            assert home.setdefault(key, i) == i, f"{key} split across buckets"
    sizes = [sum(raw[n].numel() * raw[n].element_size() for n in names) for names in rep.bucket_names]
    # a bucket exceeds the limit only when it holds a single atomic unit
    for names, size in zip(rep.bucket_names, sizes):
        if size > 40_000:
            units = {(by.get(n) or by[n.rsplit(".", 1)[0] + ".weight"]).fused_key or n for n in names}
            assert len(units) == 1
    assert any(len({n.rsplit(".", 2)[0] for n in names}) > 1 for names in rep.bucket_names)


def test_nan_is_detected_before_anything_is_sent(src):
    w = hf_weights(src)
    w["model.layers.2.mlp.experts.4.down_proj.weight"][3, 7] = float("nan")
    tr = InProcessTransport()
    with pytest.raises(NonFiniteWeight, match="experts.4.down_proj"):
        WeightSender(plan_for("mxfp8-e2e"), tr).send(iter(w.items()))
    assert tr._q.empty()


def test_receiver_refuses_another_plan(src):
    tr = InProcessTransport()
    WeightSender(plan_for("mxfp8-e2e"), tr).send(iter(hf_weights(src).items()))
    with pytest.raises(PlanMismatch):
        WeightReceiver(plan_for("mxfp8-hp-backward"), tr).receive()


@pytest.mark.parametrize("check_equal", [False, True])
def test_bucket_checksum_catches_corruption_in_transit_always(src, check_equal):
    class Corrupting(InProcessTransport):
        def send_bucket(self, meta, tensors, buf):
            buf = buf.clone()
            buf[-1] ^= 1
            super().send_bucket(meta, tensors, buf)

    tr = Corrupting()
    WeightSender(plan_for("mxfp8-e2e"), tr, check_equal=check_equal).send(iter(hf_weights(src).items()))
    with pytest.raises(WeightUpdateMismatch, match="arrived corrupted"):
        WeightReceiver(plan_for("mxfp8-e2e"), tr).receive()


def test_equality_check_catches_what_the_bucket_checksum_cannot(src):
    """A corruption before the checksum is taken (e.g. in the sender's packing) passes the bucket checksum; the
    per-tensor sha256 digests of check_equal still catch it."""
    from precision_dsl.backends.weight_update import bucket_checksum

    class CorruptingBeforeChecksum(InProcessTransport):
        def send_bucket(self, meta, tensors, buf):
            buf = buf.clone()
            buf[-1] ^= 1
            super().send_bucket({**meta, "checksum": bucket_checksum(buf)}, tensors, buf)

    tr = CorruptingBeforeChecksum()
    WeightSender(plan_for("mxfp8-e2e"), tr, check_equal=True).send(iter(hf_weights(src).items()))
    with pytest.raises(WeightUpdateMismatch, match="differ"):
        WeightReceiver(plan_for("mxfp8-e2e"), tr).receive()


def test_receive_returns_plan_formats(src, converted):
    plan = plan_for("nvfp4-pertoken-hp-backward")
    tr = InProcessTransport()
    WeightSender(plan, tr).send(iter(hf_weights(src).items()))
    got = WeightReceiver(plan, tr).receive()
    _, conv = converter.load_converted(converted["nvfp4-pertoken-hp-backward"][0])
    for n, q in got.items():
        if hasattr(q, "fmt"):
            assert q.fmt == plan.by_name()[n].weight and torch.equal(q.data, conv[n].data)


def test_sender_over_another_transport_sends_there_only(src, converted):
    """WeightSender.over(t): the same sender (plan, names, compiled program) sending over t - what gives each live
    update its own transport - leaves the original transport untouched."""
    plan = plan_for("mxfp8-e2e")
    first, second = InProcessTransport(), InProcessTransport()
    sender = WeightSender(plan, first, check_equal=True)
    other = sender.over(second)
    assert other.transport is second and sender.transport is first and other.plan is sender.plan
    rep = other.send(iter(hf_weights(src).items()))
    assert rep.buckets >= 1 and first._q.empty()
    assert same_bytes(converted["mxfp8-e2e"][1], WeightReceiver(plan, second, check_equal=True).receive_raw()) == []


def test_incomplete_atomic_group_and_unknown_names(src):
    w = hf_weights(src)
    w.pop("model.layers.0.self_attn.k_proj.weight")
    with pytest.raises(WeightUpdateError, match="never arrived"):
        WeightSender(plan_for("mxfp8-e2e"), InProcessTransport()).send(iter(w.items()))
    with pytest.raises(WeightUpdateError, match="neither an HF nor a Megatron name"):
        WeightSender(plan_for("mxfp8-e2e"), InProcessTransport()).send(iter([("foo.weight", torch.zeros(2))]))


# ---------------------------------------------------------------------------------------------------------------
# torch.distributed (gloo, 2 processes)
# ---------------------------------------------------------------------------------------------------------------
def _gloo_worker(rank, port, src_dir, out_file, policy_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        from precision_dsl.backends.weight_update import TorchDistributedTransport

        plan = resolve(Path(policy_path), load_architecture("tiny-moe"), None)
        tr = TorchDistributedTransport()
        if rank == 0:
            WeightSender(plan, tr, bucket_bytes=1 << 17, check_equal=True).send(
                iter(load_file(str(Path(src_dir) / "model.safetensors")).items()))
        else:
            raw = WeightReceiver(plan, tr).receive_raw()
            from safetensors.torch import save_file

            save_file({k: v.contiguous() for k, v in raw.items()}, out_file)
    finally:
        dist.destroy_process_group()


def _free_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_torch_distributed_gloo_broadcast_two_processes(src, converted, tmp_path):
    import torch.multiprocessing as mp

    out = tmp_path / "recv.safetensors"
    mp.spawn(_gloo_worker, args=(_free_port(), str(src), str(out),
                                 str(REPO / "policies" / "nvfp4-pertoken-hp-backward.policy")), nprocs=2, join=True)
    assert same_bytes(converted["nvfp4-pertoken-hp-backward"][1], load_file(str(out))) == []


# ---------------------------------------------------------------------------------------------------------------
# SGLang HTTP client against a stub server on 127.0.0.1
# ---------------------------------------------------------------------------------------------------------------
class _Stub:
    def __init__(self, model_path):
        self.calls, self.model_path, self.version = [], str(model_path), "default"
        stub = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, obj):
                body = json.dumps(obj).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self):
                stub.calls.append((self.path, None))
                self._reply({"model_path": stub.model_path, "weight_version": stub.version})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])) or b"{}")
                stub.calls.append((self.path, body))
                if self.path == "/update_weight_version":
                    stub.version = body["new_version"]
                self._reply({"success": True, "message": "ok"})

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()


def test_sglang_http_update_from_tensor_protocol(src, converted):
    dst, ref = converted["mxfp8-e2e"]
    stub = _Stub(dst)
    try:
        tr = SGLangHTTPTransport(stub.url, mode="tensor", tp_size=2)
        WeightSender(plan_for("mxfp8-e2e"), tr, bucket_bytes=1 << 18).send(iter(hf_weights(src).items()),
                                                                           weight_version="v7")
    finally:
        stub.close()
    paths = [p for p, _ in stub.calls]
    assert paths[0] == "/model_info" and paths[1] == "/begin_weight_update"
    assert paths[-3:] == ["/end_weight_update", "/update_weight_version", "/model_info"]
    assert stub.version == "v7" and tr.served_version == "v7"
    updates = [b for p, b in stub.calls if p == "/update_weights_from_tensor"]
    assert len(updates) == paths.count("/update_weights_from_tensor") > 1
    got = {}
    for body in updates:
        # the version is set once, after end_weight_update: never claimed while buckets are missing
        assert len(body["serialized_named_tensors"]) == 2 and body["weight_version"] is None
        assert body["load_format"] is None and body["flush_cache"] is False
        # test-only decode of OUR OWN payload (SGLang's MultiprocessingSerializer format)
        got.update(dict(pickle.loads(base64.b64decode(body["serialized_named_tensors"][0]))))
    assert same_bytes(ref, got) == []
    assert stub.calls[1][1] == {"selector": "target"}


def test_sglang_http_update_from_distributed_protocol(src, converted):
    dst, ref = converted["nvfp4-pertoken-hp-backward"]
    sent = []
    stub = _Stub(dst)
    try:
        tr = SGLangHTTPTransport(stub.url, mode="distributed", broadcast_fn=lambda t: sent.append(t.clone()))
        WeightSender(plan_for("nvfp4-pertoken-hp-backward"), tr).send(iter(hf_weights(src).items()))
    finally:
        stub.close()
    bodies = [b for p, b in stub.calls if p == "/update_weights_from_distributed"]
    names = [n for b in bodies for n in b["names"]]
    assert [t.shape for t in sent] == [torch.Size(s) for b in bodies for s in b["shapes"]]
    assert {d for b in bodies for d in b["dtypes"]} <= {"bfloat16", "uint8", "float8_e4m3fn", "float32"}
    assert same_bytes(ref, dict(zip(names, sent))) == []
    assert bodies[0]["group_name"] == "weight_update_group"


def test_sglang_http_refuses_a_server_with_another_plan(src, converted):
    dst, _ = converted["mxfp8-e2e"]
    stub = _Stub(dst)
    try:
        tr = SGLangHTTPTransport(stub.url)
        with pytest.raises(PlanMismatch):
            WeightSender(plan_for("nvfp4-pertoken-hp-backward"), tr).send(iter(hf_weights(src).items()))
    finally:
        stub.close()
    assert [p for p, _ in stub.calls] == ["/model_info"]  # nothing begun, nothing sent


def test_distributed_transport_sends_a_program_layout_once_and_refuses_a_dangling_reference():
    """The GPU program's bucket layouts go over the wire whole once per transport; later updates of the same
    program send a reference. A receiver that never got the layout refuses the reference by name."""
    from precision_dsl.backends.weight_update import TorchDistributedTransport, WeightUpdateMismatch

    wire: list = []

    class _FakeDist:  # broadcasts of the bucket buffers themselves: not what this test is about
        @staticmethod
        def broadcast(buf, src=0, group=None, async_op=False):
            return None

    def pair():
        tx, rx = TorchDistributedTransport(), TorchDistributedTransport()
        tx._bcast_obj = lambda obj: wire.append(obj)
        rx._bcast_obj = lambda obj: wire.pop(0)
        rx._dist = lambda: _FakeDist
        return tx, rx

    metas = [{"names": ["a.weight"], "offsets": [0], "nbytes": [8], "dtypes": ["bfloat16"], "shapes": [[2, 2]],
              "total": 8}]
    tx, rx = pair()
    for expect_whole in (True, False, False):
        tx.send_layout(metas)
        assert (wire[0][1] is not None) == expect_whole
        kind, meta, buf = rx.recv()
        assert kind == "bucket" and meta == metas[0] and buf.numel() == 8
    tx.send_layout(list(metas))  # another program (another list): sent whole again
    assert wire[0][1] is not None
    wire.clear()
    _, fresh = pair()
    wire.append(("layout", None))
    with pytest.raises(WeightUpdateMismatch, match="never got"):
        fresh.recv()


def test_min_buckets_deepens_the_gpu_program_pipeline_for_a_small_model(tmp_path):
    """A 1.34B-parameter MoE's NVFP4 update fits in 3 buckets of 512 MiB; min_buckets=8 shrinks them (not below
    32 MiB) so quantization can overlap the transfer; every checkpoint tensor is still sent exactly once."""
    import json

    from precision_dsl.arch import load_architecture
    from precision_dsl.backends.weight_update import WeightSender
    from precision_dsl.resolve import resolve

    cfg = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
           "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 32, "num_experts_per_tok": 4,
           "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64,
           "vocab_size": 32768, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
           "tie_word_embeddings": False, "torch_dtype": "bfloat16", "decoder_sparse_step": 1, "mlp_only_layers": [],
           "norm_topk_prob": True, "attention_bias": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    plan = resolve(REPO / "policies" / "nvfp4-pertoken-dequant-backward.policy", load_architecture(str(tmp_path)))
    one = WeightSender(plan, None, min_buckets=1).program()
    deep = WeightSender(plan, None, min_buckets=8).program()
    assert len(one.buckets) == 3 and len(deep.buckets) >= 8
    assert max(b.nbytes for b in deep.buckets) <= -(-one.bytes // 8) and deep.bytes == one.bytes
    names = lambda p: [n for m in p.metas for n in m["names"]]  # noqa: E731
    assert sorted(names(one)) == sorted(names(deep)) and len(names(deep)) == len(set(names(deep)))


def test_sender_takes_the_gpu_program_only_where_the_caller_allows_it(monkeypatch):
    """WeightSender(gpu_program=False) keeps CUDA weights on the per-unit path whatever the transport offers (the
    engine's live update: fresh weight tensors every step); None follows the transport."""
    from types import SimpleNamespace

    from precision_dsl import kernels

    monkeypatch.setattr(kernels, "available", lambda: True)
    plan = resolve(REPO / "policies" / "mxfp8-e2e.policy", load_architecture("tiny-moe"))
    items = [("w", SimpleNamespace(is_cuda=True))]
    assert WeightSender(plan, InProcessTransport())._fast_ok(items)
    assert not WeightSender(plan, InProcessTransport(), gpu_program=False)._fast_ok(items)


def test_live_update_falls_back_to_the_host_only_for_device_failures():
    """The engine's device weight-update path retries on the host for CUDA/Triton/kernel failures only; a
    programming error is not among them (it must surface, not hide behind the host path)."""
    from precision_dsl.engine.weight_path import _device_path_errors
    from precision_dsl.kernels import KernelUnavailable

    caught = _device_path_errors()
    for e in (RuntimeError("CUDA error"), torch.cuda.OutOfMemoryError("oom"), KernelUnavailable("no sm_89"),
              OSError("io")):
        assert isinstance(e, caught), e
    for e in (NameError("x"), AttributeError("y"), TypeError("z"), KeyError("k"), NonFiniteWeight("w", 3)):
        assert not isinstance(e, caught), e
