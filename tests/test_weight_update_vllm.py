"""The live weight update into vLLM 0.33 (backends/weight_update/vllm_transport.py), judged by vLLM's own loader.

A stub of vLLM's RL HTTP routes (127.0.0.1) hands each /update_weights message to vLLM 0.33's own
NCCLWeightTransferEngine (its `parse_update_info` and `receive_weights`; the tensors the sender broadcasts reach it
through an in-process channel, tests/oracles/vllm_loader.py) and so to the real `load_weights` of the vLLM model class,
built on CPU from the served checkpoint's config and the engine args the vLLM backend emits for the plan. Every vLLM
parameter must then hold exactly the bytes `policyc convert` writes for that plan (fused qkv / gate_up /
fused_qkv_a stacking, w13 / w2 experts, per-expert w13_weight_scale_2 / w13_input_scale).

Cases: Qwen3-MoE tiny-moe and DeepSeek-V3 reduced to 3 layers of 256 hidden (MLA, dense + MoE + shared experts, an
MTP layer vLLM does not build), for bf16, fp8-blockwise-hopper, the NVFP4 per-token policies, and MXFP8 (the
backend refuses it until the converter writes vLLM's naming; vLLM's ModelOpt MXFP8 loader is checked with the
transport's naming on a hand-written config). NeMo-RL style re-quantization on reload: vLLM's own online quantizers,
run on CPU, against the formats/ references, and the transport's refusal by name.
"""

from __future__ import annotations

import functools
import http.server
import json
import queue
import threading
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from oracles import vllm_loader
from oracles.vllm_oracle import oracle
from oracles._sandbox import env
from precision_dsl.arch.loader import architecture_from_config
from precision_dsl.backends import converter
from precision_dsl.backends import vllm as vllm_backend
from precision_dsl.backends.common import PlanMismatch, Problems, is_quantized
from precision_dsl.backends.synthetic import write_synthetic_checkpoint
from precision_dsl.backends.weight_update import VLLMHTTPTransport, WeightSender, WeightUpdateAborted, \
    WeightUpdateError, vllm_named_tensors
from precision_dsl.backends.weight_update.vllm_transport import REQUANTIZE_REFUSED, serve_refusals
from precision_dsl.precision import FormatKind
from precision_dsl.resolve import resolve

REPO = Path(__file__).resolve().parents[1]
# DeepSeek-V3's layout at toy size: 1 dense + 2 MoE layers, q-LoRA MLA, 8 routed + 1 shared expert, one MTP layer;
# 128-multiples where vLLM's block FP8 needs them (fused_qkv_a_proj's q_a shard, the MoE intermediate size).
DEEPSEEK_MINI = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=128, n_routed_experts=8,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1, num_hidden_layers=3,
                     first_k_dense_replace=1, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=128,
                     kv_lora_rank=128, qk_nope_head_dim=64, qk_rope_head_dim=64, v_head_dim=64, vocab_size=256,
                     num_nextn_predict_layers=1, max_position_embeddings=4096)


pytestmark = pytest.mark.usefixtures("vllm_033")  # conftest: vLLM 0.33.0 for the module, torn down after


@functools.lru_cache(maxsize=None)
def config_of(model: str) -> str:
    raw = json.loads((REPO / "precision_dsl" / "models" / model.replace("-mini", "") / "config.json").read_text())
    raw.pop("quantization_config", None)  # a BF16 source checkpoint
    if model == "deepseek-v3-mini":
        raw.update(DEEPSEEK_MINI)
    return json.dumps(raw)


@functools.lru_cache(maxsize=None)
def arch_of(model: str):
    return architecture_from_config(json.loads(config_of(model)), model)


@functools.lru_cache(maxsize=None)
def plan_of(policy: str, model: str):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), None)


@functools.lru_cache(maxsize=None)
def source(model: str, root: Path) -> Path:
    return write_synthetic_checkpoint(arch_of(model), root / f"src-{model}", shards=1, seed=5)


def converted(policy: str, model: str, root: Path) -> tuple[Path, dict]:
    dst = root / f"conv-{policy}-{model}"
    if not dst.exists():
        converter.convert(source(model, root), plan_of(policy, model), dst)
    tensors = {}
    for f in dst.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            tensors.update({k: h.get_tensor(k) for k in h.keys()})
    return dst, tensors


def hf_weights(model: str, root: Path) -> dict:
    with safe_open(str(source(model, root) / "model.safetensors"), "pt") as h:
        return {k: h.get_tensor(k) for k in h.keys()}


def engine_args(plan) -> list[str]:
    problems = Problems()
    cfg = vllm_backend.serve_config(plan, problems)
    assert cfg is not None, [str(p) for p in problems.folded()]
    return cfg.engine_args


# ---- a stub of vLLM's RL routes whose worker is vLLM's own NCCL engine + model ------------------------------------
class VllmStub:
    """vllm/entrypoints/rl/online/api_router.py's routes + /v1/models + /collective_rpc; /update_weights is received
    by vLLM's NCCLWeightTransferEngine (tests/oracles/vllm_loader.py `receive`) from the broadcast channel."""

    def __init__(self, model_path: Path, vm=None, fail_update_at=None):
        self.model_path, self.vm, self.fail_update_at = str(model_path), vm, fail_update_at
        self.calls: list[tuple[str, dict]] = []
        self.version = "initial"
        self.channel: "queue.Queue" = queue.Queue()
        self.updates = 0
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _reply(self, code, obj):
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                stub.calls.append((self.path, {}))
                if self.path == "/v1/models":
                    return self._reply(200, {"object": "list", "data": [{"id": "m", "root": stub.model_path}]})
                if self.path == "/weight_info":
                    return self._reply(200, {"weight_version": stub.version})
                self._reply(404, {"detail": "Not Found"})

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                stub.calls.append((self.path, body))
                code, obj = stub.post(self.path, body)
                self._reply(code, obj)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def post(self, path: str, body: dict):
        if path == "/update_weights":
            self.updates += 1
            info = body["update_info"]
            tensors = [self.channel.get(timeout=60) for _ in info["names"]]  # the NCCL broadcasts, in order
            if self.updates == self.fail_update_at:
                return 500, {"error": "worker failed"}
            if self.vm is not None:
                self.vm.receive(info, tensors)
            return 200, {"message": "Weights updated"}
        if path == "/finish_weight_update":
            if "weight_version" in body:
                self.version = body["weight_version"]
            return 200, {"message": "Weight update finished"}
        if path == "/update_weight_version":
            self.version = body["new_version"]
            return 200, {"success": True, "new_version": self.version}
        if path in ("/start_weight_update", "/collective_rpc", "/init_weight_transfer_engine"):
            return 200, {}
        return 404, {"detail": "Not Found"}

    def broadcast(self, tensor):
        self.channel.put(tensor.detach().clone())

    def paths(self) -> list[str]:
        return [p for p, _ in self.calls if p not in ("/v1/models", "/weight_info")]

    def close(self):
        self.server.shutdown()


# ---- the bytes vLLM's parameters hold after a live update ----------------------------------------------------------
CASES = [("bf16", "tiny-moe"), ("nvfp4-pertoken-hp-backward", "tiny-moe"), ("bf16", "deepseek-v3-mini"),
         ("fp8-blockwise-hopper", "deepseek-v3-mini"), ("miles-nvfp4", "deepseek-v3-mini"),
         ("mxfp8-e2e", "deepseek-v3-mini")]


@pytest.mark.parametrize("policy,model", CASES)
def test_update_lands_as_the_converters_bytes_in_every_vllm_parameter(policy, model, tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    plan = plan_of(policy, model)
    dst, ckpt = converted(policy, model, root)
    vm = vllm_loader.build(vllm_loader.model_dir(tmp_path_factory.mktemp("cfg"), json.loads(config_of(model))),
                           engine_args(plan), target=plan.target)
    stub = VllmStub(dst, vm)
    try:
        tr = VLLMHTTPTransport(plan, stub.url, broadcast_fn=stub.broadcast)
        rep = WeightSender(plan, tr, bucket_bytes=1 << 17).send(iter(hf_weights(model, root).items()),
                                                              weight_version="step-1")
    finally:
        stub.close()
    assert rep.buckets > 1
    paths = stub.paths()
    assert paths[0] == "/start_weight_update" and paths[-1] == "/finish_weight_update"
    served_buckets = [b for b in rep.bucket_names if set(b) - tr.names.unbuilt]  # MTP-only buckets are not sent
    assert set(paths[1:-1]) == {"/update_weights"} and len(paths) - 2 == len(served_buckets)
    assert tr.served_version == "step-1" and tr.previous_version == "initial"
    for _, body in stub.calls:
        if "update_info" in body:
            assert set(body["update_info"]) == {"names", "dtype_names", "shapes"}  # vLLM's NCCL message
    expected = dict(vllm_named_tensors(plan, ckpt))
    assert vllm_loader.mismatches(vm, expected) == []
    some = next(n for n in vm.params() if ".experts.routed_experts.w13_weight" in n)
    vm.params()[some].data.reshape(-1).view(torch.uint8)[7] ^= 1  # the check sees a single flipped bit
    assert vllm_loader.mismatches(vm, expected) == [f"{some}: 1 byte(s) differ"]
    if model == "deepseek-v3-mini":  # the MTP layer (vLLM builds none without --speculative-config) is not sent
        sent = {n for _, b in stub.calls if "update_info" in b for n in b["update_info"]["names"]}
        assert not any(n.startswith("model.layers.3.") for n in sent)
        assert any(n.startswith("model.layers.3.") for n in ckpt)
    if "nvfp4" in policy:  # gate and up of each expert share one weight_scale_2: vLLM serves both with [:, 0]
        s2 = vm.params()[[n for n in vm.params() if n.endswith("w13_weight_scale_2")][0]].data
        assert s2.shape[-1] == 2 and torch.equal(s2[:, 0], s2[:, 1])


def test_mxfp8_vllm_naming_loads_into_vllms_modelopt_mxfp8(tmp_path_factory):
    """vLLM's ModelOpt MXFP8 (quant_method mxfp8, `ignored_layers`) loads the converter's MXFP8 bytes under the
    transport's names (weight_scale); under the converter's SGLang naming (weight_scale_inv) it cannot."""
    root = tmp_path_factory.getbasetemp()
    plan = plan_of("mxfp8-e2e", "tiny-moe")
    _, ckpt = converted("mxfp8-e2e", "tiny-moe", root)
    ignored = sorted({vllm_backend.vllm_module(t, plan.model_type).prefix for t in plan.tensors
                      if vllm_backend.vllm_module(t, plan.model_type) is not None and not is_quantized(t)})
    qcfg = {"quant_method": "mxfp8", "ignored_layers": ignored}
    cfg_dir = vllm_loader.model_dir(tmp_path_factory.mktemp("mx"), json.loads(config_of("tiny-moe")), qcfg)
    vm = vllm_loader.build(cfg_dir, [])
    vm.load_weights(vllm_named_tensors(plan, ckpt))
    assert vllm_loader.mismatches(vm, dict(vllm_named_tensors(plan, ckpt))) == []
    assert any(n.endswith("w13_weight_scale") for n in vm.params())
    sglang_named = [(n, x) for n, x in ckpt.items() if n == "model.layers.0.self_attn.q_proj.weight_scale_inv"]
    assert sglang_named
    with pytest.raises(AttributeError, match="QKVParallelLinear"):  # vLLM's loader has no such parameter
        vllm_loader.build(cfg_dir, []).load_weights(sglang_named)


def test_mxfp8_is_refused_by_name_until_vllm_serves_it(tmp_path_factory):
    plan = plan_of("mxfp8-e2e", "tiny-moe")
    refusals = serve_refusals(plan)
    problems = Problems()
    if vllm_backend.serve_config(plan, problems) is not None:
        assert refusals == []  # the vLLM backend serves MXFP8: the transport sends it (the test above's names)
        return
    assert refusals and "MXFP8" in str(refusals[0])
    stub = VllmStub(tmp_path_factory.mktemp("none"))
    try:
        with pytest.raises(WeightUpdateError, match="cannot receive this plan's update.*MXFP8"):
            WeightSender(plan, VLLMHTTPTransport(plan, stub.url, broadcast_fn=stub.broadcast)).send(
                iter(hf_weights("tiny-moe", tmp_path_factory.getbasetemp()).items()))
    finally:
        stub.close()
    assert stub.paths() == []  # refused before the bracket opens


# ---- the handshake, all or nothing -----------------------------------------------------------------------------------
def test_plan_hash_handshake_refuses_another_plans_checkpoint(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    dst, _ = converted("nvfp4-pertoken-hp-backward", "tiny-moe", root)
    plan = plan_of("bf16", "tiny-moe")
    for path, match in ((dst, "plan content hash mismatch"), (tmp_path_factory.mktemp("bare"), "got <none>")):
        stub = VllmStub(path)
        try:
            with pytest.raises(PlanMismatch, match=match):
                WeightSender(plan, VLLMHTTPTransport(plan, stub.url, broadcast_fn=stub.broadcast)).send(
                    iter(hf_weights("tiny-moe", root).items()))
        finally:
            stub.close()
        assert stub.paths() == []
    with pytest.raises(PlanMismatch, match="vLLM weight update transport") as info:
        VLLMHTTPTransport(plan, "http://127.0.0.1:1", broadcast_fn=print).open(
            plan_of("nvfp4-pertoken-hp-backward", "tiny-moe").content_hash())
    assert "sender's plan" in info.value.hint


@pytest.mark.parametrize("rollback", ["disk", "none"])
def test_failure_mid_update_finishes_the_bracket_and_rolls_back(tmp_path_factory, rollback):
    root = tmp_path_factory.getbasetemp()
    plan = plan_of("bf16", "tiny-moe")
    dst, _ = converted("bf16", "tiny-moe", root)
    stub = VllmStub(dst, fail_update_at=2)
    try:
        tr = VLLMHTTPTransport(plan, stub.url, broadcast_fn=stub.broadcast, rollback=rollback)
        with pytest.raises(WeightUpdateAborted, match="HTTP 500") as info:
            WeightSender(plan, tr, bucket_bytes=1 << 16).send(iter(hf_weights("tiny-moe", root).items()),
                                                              weight_version="step-2")
    finally:
        stub.close()
    paths = stub.paths()
    assert paths[:3] == ["/start_weight_update", "/update_weights", "/update_weights"]
    assert "/finish_weight_update" in paths  # vLLM has no abort: the layerwise reload is finished
    if rollback == "disk":
        rpc = [b for p, b in stub.calls if p == "/collective_rpc"]
        assert rpc == [{"method": "reload_weights", "kwargs": {"weights_path": str(dst)}}]
        assert info.value.served_version == f"checkpoint:{dst}"
    else:
        assert "/collective_rpc" not in paths and info.value.served_version == "incomplete:step-2"


def test_nccl_engine_init_must_be_unpacked():
    plan = plan_of("bf16", "tiny-moe")
    with pytest.raises(WeightUpdateError, match="packed=false"):
        VLLMHTTPTransport(plan, "http://127.0.0.1:1", broadcast_fn=print).init_transfer_engine(
            {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "packed": True})
    with pytest.raises(ValueError, match="broadcast_fn"):
        VLLMHTTPTransport(plan, "http://127.0.0.1:1")


# ---- NeMo-RL style: BF16 sent, vLLM re-quantizes on reload --------------------------------------------------------
def _vllm(fn_path: str):
    module, _, name = fn_path.rpartition(".")
    import importlib

    return getattr(importlib.import_module(module), name)


def test_vllm_online_quantizers_against_the_plans_formats():
    """vLLM 0.33's own online weight quantizers, run on CPU, against formats/ (the plan's bytes)."""
    from precision_dsl.formats import fp8_block, mxfp8

    o = oracle(vllm_loader.VERSION)
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(256, 512, generator=g) * 0.05).to(torch.bfloat16)
    # every positive finite bf16 as a block amax (with a negative neighbour): MXFP8's scale rule over its whole domain
    vals = torch.arange(1, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    blocks = torch.zeros((vals.numel(), 32), dtype=torch.bfloat16)
    blocks[:, 0], blocks[:, 1] = vals, -vals * 0.5
    with o.sandbox, env(o._env()):
        q, s = _vllm("vllm.utils.deep_gemm.per_block_cast_to_fp8")(w, block_size=[128, 128], use_ue8m0=False)
        mx_torch = _vllm("vllm.model_executor.layers.quantization.utils.mxfp8_utils._mxfp8_e4m3_quantize_torch")
        mq, ms = mx_torch(blocks)
        online_nvfp4 = _vllm("vllm.model_executor.layers.quantization.online.nvfp4.scaled_fp4_quant")
        kernel = _vllm("vllm._custom_ops.scaled_fp4_quant")
        with pytest.raises(AttributeError, match="scaled_fp4_quant"):  # a CUDA op: no pure-torch path
            online_nvfp4(w, torch.tensor(1.0))
    ref = fp8_block.quantize(w, block=(128, 128), pow2=False)
    assert torch.equal(q.view(torch.uint8), ref.data.view(torch.uint8))  # same FP8 values ...
    assert not torch.equal(s, ref.scale)  # ... but weight_scale_inv amax/448 is not TE's 1/RN(448/amax)
    mref = mxfp8.quantize(blocks)
    assert torch.equal(ms, mref.scale) and torch.equal(mq.view(torch.uint8), mref.data.view(torch.uint8))
    assert online_nvfp4 is kernel
    assert set(REQUANTIZE_REFUSED) == {FormatKind.FP8_BLOCK, FormatKind.MXFP8, FormatKind.NVFP4}
    assert "FlashInfer" in REQUANTIZE_REFUSED[FormatKind.MXFP8]  # the SM100 path is FlashInfer's kernel, not this
    with o.sandbox, env(o._env()):
        import inspect

        impl = inspect.getsource(_vllm("vllm.model_executor.layers.quantization.utils.mxfp8_utils."
                                       "_mxfp8_e4m3_quantize_impl"))
    assert "flashinfer_mxfp8_quantize" in impl and "has_device_capability(100)" in impl


@pytest.mark.parametrize("policy,model", [("fp8-blockwise-hopper", "deepseek-v3-mini"),
                                          ("nvfp4-pertoken-hp-backward", "tiny-moe")])
def test_requantize_on_reload_is_refused_by_name(policy, model, tmp_path_factory):
    plan = plan_of(policy, model)
    assert serve_refusals(plan) == []
    refusals = serve_refusals(plan, requantize_on_reload=True)
    kind = next(t.weight.kind for t in plan.tensors if is_quantized(t))
    assert len(refusals) == 1 and REQUANTIZE_REFUSED[kind] in str(refusals[0])
    assert refusals[0].tensor == next(t.hf_name for t in plan.tensors if is_quantized(t))
    stub = VllmStub(tmp_path_factory.mktemp("rq"))
    try:
        with pytest.raises(WeightUpdateError, match="requantize_on_reload") as info:
            VLLMHTTPTransport(plan, stub.url, broadcast_fn=stub.broadcast, requantize_on_reload=True,
                              allow_unverified=True).open(plan.content_hash())
    finally:
        stub.close()
    assert info.value.hint and stub.paths() == []
    assert serve_refusals(plan_of("bf16", model), requantize_on_reload=True) == []
