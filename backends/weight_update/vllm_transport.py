"""The live weight update into a running vLLM 0.33 server: its weight-transfer API, the converter's bytes.

vLLM 0.33 (`vllm serve ... --weight-transfer-config '{"backend": "nccl"}'` (or "ipc") with VLLM_SERVER_DEV_MODE=1,
which mounts the RL routes of vllm/entrypoints/rl/online/api_router.py and /collective_rpc of
vllm/entrypoints/serve/dev/rpc/api_router.py):

  POST /init_weight_transfer_engine {init_info}     once, by the caller (the NCCL rendezvous: master_address,
                                                    master_port, rank_offset, world_size, packed=false)
  POST /start_weight_update                         the worker engine starts a layerwise reload
                                                    (vllm/distributed/weight_transfer/nccl_engine.py
                                                    start_weight_update -> initialize_layerwise_reload)
  POST /update_weights {update_info: {names, dtype_names, shapes[, ipc_handles_pickled]}}   per bucket; NCCL: the
                                                    worker receives each tensor by broadcast from rank 0 while the
                                                    request is open; IPC: the tensors' CUDA IPC handles ride along
  POST /finish_weight_update {weight_version}       finalize_layerwise_reload, then the version is set
  GET  /weight_info -> {weight_version}             GET /v1/models -> data[0].root: the served checkpoint path

What the worker does with the tensors: `model.load_weights([(name, tensor)])` (nccl_engine.py receive_weights,
ipc_engine.py receive_weights), so names are the HF checkpoint's and tensors are in checkpoint format - exactly what
`policyc convert` writes for the plan, which is what is sent: `checkpoint_tensors` bytes (backends/quantize.py),
renamed where vLLM's loader names a tensor differently (`quantize.output_specs(t, rollout="vllm")`). vLLM checks no dtype (vllm/model_executor/
parameter.py weight loaders assert shapes only: BF16 sent into an FP8 parameter is cast silently), so the plan-hash
handshake below is the only guard that the served checkpoint's parameters are the plan's formats.

Plan-hash handshake: the served checkpoint (`/v1/models` root) must hold the sender's plan (`policyc_plan.json`, the
converter's); otherwise PlanMismatch. The vLLM backend's own reading of the plan (backends/vllm.py serve_config) must
accept it: a tensor vLLM does not serve as planned is refused by name before anything is sent.

All or nothing: vLLM 0.33 has no transactional update - layers load in place as their elements arrive and
`finalize_layerwise_reload` processes partially loaded layers. On a failure after /start_weight_update, `abort`
finishes the bracket, then reloads the verified checkpoint from disk (`/collective_rpc` reload_weights, vllm/v1/
worker/gpu_worker.py -> model_loader/reload/inplace.py reload_weights) and labels it `checkpoint:<path>`, or (no
verified path / rollback="none" / the reload failed) labels the served weights `incomplete:<version>`.

Re-quantization on reload (`requantize_on_reload=True`: serve a BF16 checkpoint with online quantization and send
BF16, NeMo-RL style): vLLM's online quantizers are not the plan's formats (REQUANTIZE_REFUSED, tested against the
formats/ references in tests/test_weight_update_vllm.py), so a plan that quantizes a served tensor is refused by
name; only an all-BF16 plan may be sent that way.
"""

from __future__ import annotations

import base64
import threading
from typing import TYPE_CHECKING, Callable, Optional

from precision_dsl.plan import Plan
from precision_dsl.precision import FormatKind

from precision_dsl.backends.common import PLAN_FILE, PlanMismatch, Problems, UnsupportedByBackend, is_quantized
from precision_dsl.backends.weight_update.errors import WeightUpdateError
from precision_dsl.backends.weight_update.transports import json_call, verify_served_plan

if TYPE_CHECKING:
    import torch

BACKEND = "vllm weight update"
VLLM_VERSION = "0.33.0"  # the release whose weight-transfer API this speaks (vllm/entrypoints/rl/online/api_router.py)
ENGINES = ("nccl", "ipc")

# Why vLLM 0.33's online quantization (vllm/model_executor/layers/quantization/online/) does not give the plan's
# bytes, per weight kind (tests/test_weight_update_vllm.py runs vLLM's own quantizer against formats/ on CPU).
REQUANTIZE_REFUSED = {
    FormatKind.FP8_BLOCK: "vLLM's online fp8_per_block (online/fp8.py -> vllm/utils/deep_gemm.py "
                          "per_block_cast_to_fp8) stores weight_scale_inv = amax/448 and multiplies by its "
                          "reciprocal; the plan's FP8-block (TransformerEngine) stores 1/RN(448/amax)",
    FormatKind.MXFP8: "vLLM's online mxfp8 (online/mxfp8.py -> utils/mxfp8_utils.py mxfp8_e4m3_quantize) runs "
                      "FlashInfer's mxfp8_quantize kernel on SM100 with FlashInfer installed (the MXFP8 target), "
                      "not verified equal to the plan's MXFP8; only its torch fallback "
                      "(_mxfp8_e4m3_quantize_torch, taken without SM100 + FlashInfer) gives the plan's bytes",
    FormatKind.NVFP4: "vLLM's online nvfp4_per_token (online/nvfp4.py _quantize_moe_weight_to_nvfp4) quantizes "
                      "with the CUDA kernel vllm._custom_ops.scaled_fp4_quant, not verified equal to the plan's "
                      "NVFP4 (it is not pure torch and cannot be run on a CPU)",
}


class VllmNames:
    """Checkpoint tensor name -> (the vLLM name, whether vLLM builds it) for a plan, computed once."""

    def __init__(self, plan: Plan):
        from precision_dsl.backends.quantize import plan_output_specs

        self.renamed: dict[str, str] = {}
        self.unbuilt: set[str] = set()  # MTP tensors: vLLM builds no MTP layer without --speculative-config
        # The converter's names for each engine come from one table (quantize.ROLLOUT_SUFFIXES): the buckets carry
        # the default engine's names, vLLM's loader takes the `rollout="vllm"` ones (same bytes, same order).
        for t, specs, vllm_specs in zip(plan.tensors, plan_output_specs(plan), plan_output_specs(plan, "vllm")):
            for (n, _dt, _sh), (v, _vdt, _vsh) in zip(specs, vllm_specs):
                if t.mtp is not None:
                    self.unbuilt.add(n)
                elif v != n:
                    self.renamed[n] = v

    def pairs(self, tensors: dict) -> list[tuple[str, "torch.Tensor"]]:
        """The (vLLM name, tensor) pairs of a bucket, in its order, without the tensors vLLM does not build."""
        return [(self.renamed.get(n, n), x) for n, x in tensors.items() if n not in self.unbuilt]


def vllm_named_tensors(plan: Plan, tensors: dict) -> list[tuple[str, "torch.Tensor"]]:
    """The (name, tensor) pairs vLLM's `load_weights` takes for the plan's checkpoint tensors `tensors`."""
    return VllmNames(plan).pairs(tensors)


def update_info(pairs: list) -> dict:
    """vLLM's per-bucket update message (vllm/distributed/weight_transfer/nccl_engine.py
    NCCLWeightTransferUpdateInfo: names, dtype_names as torch attribute names, shapes)."""
    return {"names": [n for n, _ in pairs], "dtype_names": [str(x.dtype).replace("torch.", "") for _, x in pairs],
            "shapes": [list(x.shape) for _, x in pairs]}


def serve_refusals(plan: Plan, requantize_on_reload: bool = False) -> list[UnsupportedByBackend]:
    """Every reason vLLM 0.33 cannot receive `plan`'s update as planned: the vLLM backend's refusals (what it cannot
    serve), and with `requantize_on_reload` each quantized served tensor kind vLLM's online quantizer does not
    reproduce."""
    from precision_dsl.backends.vllm import serve_config, vllm_module

    problems = Problems()
    serve_config(plan, problems)
    out = list(problems.folded())
    if requantize_on_reload:
        seen: set = set()
        for t in plan.tensors:
            if not is_quantized(t) or vllm_module(t, plan.model_type) is None or t.weight.kind in seen:
                continue
            seen.add(t.weight.kind)
            out.append(UnsupportedByBackend(
                BACKEND, t.hf_name, f"requantize_on_reload with {t.weight.short()} weights: "
                f"{REQUANTIZE_REFUSED.get(t.weight.kind, 'no verified online quantizer')}",
                hint="serve the `policyc convert` checkpoint (pre-quantized) and send its tensors "
                     "(requantize_on_reload=False)"))
    return out


def _default_ipc_handles(pairs: list) -> list[dict]:
    """CUDA IPC handles in vLLM's per-parameter form {physical GPU uuid: torch reduce_tensor args}
    (vllm/distributed/weight_transfer/ipc_engine.py IPCWeightTransferUpdateInfo.ipc_handles)."""
    import torch
    from torch.multiprocessing.reductions import reduce_tensor

    out = []
    for name, x in pairs:
        if not x.is_cuda:
            raise WeightUpdateError(f"engine='ipc' needs CUDA tensors; '{name}' is on {x.device}",
                                    "use engine='nccl' for a server on another host")
        uuid = str(torch.cuda.get_device_properties(x.device).uuid)
        out.append({uuid: reduce_tensor(x)[1]})
    return out


class VLLMHTTPTransport:
    """Client of a running vLLM 0.33 server (see the module docstring).

    engine="nccl": each bucket's POST /update_weights runs while `broadcast_fn(tensor)` broadcasts its tensors from
    rank 0 of the update group, in `names` order (vLLM's non-packed receive: the caller initialises the engine with
    packed=false, `init_transfer_engine`). engine="ipc": the tensors' CUDA IPC handles (`ipc_handles_fn(pairs)`,
    default torch's reduce_tensor per tensor) travel pickled in the request (vLLM unpickles them only with
    VLLM_ALLOW_INSECURE_SERIALIZATION=1: point it only at a server you run, on this host)."""

    gpu_program = False  # buckets are the converter's named tensors (send_bucket), never GPU-program layouts

    def __init__(self, plan: Plan, base_url: str, engine: str = "nccl", broadcast_fn: Optional[Callable] = None,
                 ipc_handles_fn: Optional[Callable] = None, allow_unverified: bool = False, timeout: float = 600.0,
                 rollback: str = "disk", requantize_on_reload: bool = False):
        if engine not in ENGINES:
            raise ValueError(f"engine must be one of {ENGINES}")
        if engine == "nccl" and broadcast_fn is None:
            raise ValueError("engine='nccl' needs broadcast_fn(tensor) (a broadcast from rank 0 of the update group)")
        if rollback not in ("disk", "none"):
            raise ValueError("rollback must be 'disk' (reload the served checkpoint on failure) or 'none'")
        self.plan, self.base_url, self.engine = plan, base_url.rstrip("/"), engine
        self.broadcast_fn, self.ipc_handles_fn = broadcast_fn, ipc_handles_fn or _default_ipc_handles
        self.allow_unverified, self.timeout, self.rollback = allow_unverified, timeout, rollback
        self.requantize_on_reload = requantize_on_reload
        self.names = VllmNames(plan)
        self.weight_version: Optional[str] = None
        self.previous_version: Optional[str] = None
        self.served_version: Optional[str] = None
        self._model_path: Optional[str] = None
        self._begun = False
        self._keep: list = []  # IPC: the exported tensors stay alive until the bracket is closed
        self._refusals: Optional[list] = None

    # -- HTTP ------------------------------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: Optional[dict] = None) -> dict:
        return json_call("vLLM", self.base_url, method, path, body, self.timeout,
                         not_found_hint="start vLLM with VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config "
                                        "(the RL routes)")

    def init_transfer_engine(self, init_info: dict) -> None:
        """POST /init_weight_transfer_engine (once per server; engine="nccl" needs `"packed": false`)."""
        if self.engine == "nccl" and init_info.get("packed"):
            raise WeightUpdateError("engine='nccl' broadcasts tensor by tensor: init the engine with packed=false")
        self._call("POST", "/init_weight_transfer_engine", {"init_info": dict(init_info)})

    def weight_info(self) -> Optional[str]:
        v = self._call("GET", "/weight_info").get("weight_version")
        return None if v is None else str(v)

    def served_model_path(self) -> Optional[str]:
        """The checkpoint the server serves (vllm/entrypoints/openai/models/serving.py: ModelCard.root)."""
        data = self._call("GET", "/v1/models").get("data")
        roots = {str(c.get("root")) for c in data if isinstance(c, dict) and c.get("root")} if isinstance(
            data, list) else set()
        if len(roots) > 1:
            raise WeightUpdateError(f"vLLM at {self.base_url} serves several checkpoints: {sorted(roots)[:3]}")
        return next(iter(roots), None)

    # -- sender side -----------------------------------------------------------------------------------------------
    def _check_plan(self, plan_hash: str) -> None:
        if plan_hash != self.plan.content_hash():
            raise PlanMismatch("vLLM weight update transport", self.plan.content_hash(), plan_hash,
                               hint="create the transport with the sender's plan")
        if self._refusals is None:  # the plan's reading by vLLM's rules does not change between updates
            self._refusals = serve_refusals(self.plan, self.requantize_on_reload)
        refusals = self._refusals
        if refusals:
            first = refusals[0]
            more = f" (and {len(refusals) - 1} more)" if len(refusals) > 1 else ""
            raise WeightUpdateError(f"vLLM {VLLM_VERSION} cannot receive this plan's update: {first}{more}",
                                    first.hint)

    def open(self, plan_hash: str) -> None:
        self._check_plan(plan_hash)
        path = self.served_model_path()
        verified = verify_served_plan(f"vLLM server {self.base_url}", path, plan_hash, self.allow_unverified,
                                      f"the served checkpoint ({path or 'no /v1/models root'}) has no readable "
                                      f"{PLAN_FILE}; serve a `policyc convert --rollout vllm` output or pass "
                                      "allow_unverified=True")
        if verified is not None:
            self._model_path = verified
        self.previous_version = self.weight_info()
        self._call("POST", "/start_weight_update")
        self._begun = True

    def send_bucket(self, meta: dict, tensors: dict, buf) -> None:
        pairs = self.names.pairs(tensors)
        if not pairs:
            return
        info = update_info(pairs)
        if self.engine == "ipc":
            import pickle

            info["ipc_handles_pickled"] = base64.b64encode(pickle.dumps(self.ipc_handles_fn(pairs))).decode()
            self._keep.extend(x for _, x in pairs)
            self._call("POST", "/update_weights", {"update_info": info})
            return
        errors: list[BaseException] = []

        def post():
            try:
                self._call("POST", "/update_weights", {"update_info": info})
            except BaseException as err:  # surfaced after the broadcasts
                errors.append(err)

        th = threading.Thread(target=post, daemon=True)
        th.start()
        for _, x in pairs:
            self.broadcast_fn(x)
        th.join()
        if errors:
            raise errors[0]

    def close(self, summary: dict) -> None:
        body = {} if self.weight_version is None else {"weight_version": str(self.weight_version)}
        self._call("POST", "/finish_weight_update", body)
        self._begun = False
        self._keep = []
        self.served_version = self.weight_info()
        if self.weight_version is not None and self.served_version != str(self.weight_version):
            raise WeightUpdateError(f"vLLM reports weight_version {self.served_version!r} after the update to "
                                    f"{self.weight_version!r}")

    def abort(self, reason: str) -> Optional[str]:
        """After a failure between start and the end of close: finish the bracket (vLLM has no abort; layers loaded so
        far are processed), then reload the verified checkpoint from disk and label it `checkpoint:<path>`, or
        label the served weights `incomplete:<version>`. Returns the version vLLM reports afterwards (best effort;
        never raises)."""
        if self._begun:
            try:
                self._call("POST", "/finish_weight_update", {})
            except WeightUpdateError:
                pass
            self._begun = False
        self._keep = []
        label = None
        if self.rollback == "disk" and self._model_path is not None:
            label = f"checkpoint:{self._model_path}"
            try:
                self._call("POST", "/collective_rpc", {"method": "reload_weights",
                                                       "kwargs": {"weights_path": self._model_path}})
            except WeightUpdateError:
                label = None
        try:
            self._call("POST", "/update_weight_version", {"new_version": label or f"incomplete:{self.weight_version}"})
        except WeightUpdateError:
            pass
        try:
            self.served_version = self.weight_info()
        except WeightUpdateError:
            self.served_version = None
        return self.served_version
