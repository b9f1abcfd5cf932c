"""SGLang 0.5.23 rollout backend: server args, env vars, and the checkpoint `quantization_config` (with the
exemption list in SGLang module prefixes) that makes the server run exactly the plan.

Facts used (read from the SGLang 0.5.23 wheel, python/sglang/srt/layers/quantization/):
  * The quant method is read from the checkpoint (config.json `quantization_config`, else hf_quant_config.json).
    `--quantization` must equal it (`_verify_quantization`), so we pass exactly the checkpoint's method.
  * mxfp8 -> `Fp8Config(use_mxfp8)`: keys quant_method/activation_scheme/fmt/weight_block_size [1,32]/scale_fmt,
    exemptions in `modules_to_not_convert` matched by `is_layer_skipped` (dotted-path match; fused modules checked
    shard by shard and they must agree; a FusedMoE `model.layers.N.mlp.experts` is skipped by any entry containing
    "experts" with that prefix as a substring -> per-expert precision is impossible).
  * fp8 128x128 block (DeepSeek) -> `Fp8Config`, same exemption key.
  * NVFP4 -> ModelOpt `modelopt_fp4`: `ignore` (config.json) / `quantization.exclude_modules` (hf_quant_config.json),
    glob patterns matched against the full prefix or any single dotted part; a FusedMoE is excluded by its
    container prefix, a fused qkv/gate_up by its fused name -> we list both the HF names and the SGLang fused
    prefixes (Miles' convert_hf_to_nvfp4.py does the same).
  * mixed formats: `modelopt_mixed` covers FP8 + NVFP4 per layer only; MXFP8 + NVFP4 or FP8-block + anything has
    no SGLang method -> UnsupportedByBackend.
  * `--kv-cache-dtype auto` follows the checkpoint's kv_cache_quant_algo, so bf16 is always passed explicitly.
  * Routers, embeddings, lm_head (ParallelLMHead) and MTP eh_proj (plain nn.Linear in deepseek_nextn) are never
    quantized by these methods.
  * Where SGLang fuses, renames or re-derives, the emitted config makes it produce exactly the plan or we refuse by
    name (checked against SGLang's own code in tests/test_sglang_oracle.py):
      - DeepSeek-V2/V3 fuse each layer's shared expert into the routed FusedMoE (ep 1, runners other than the
        trtllm/cutedsl ones; `resolve_shared_experts_config`): `--disable-shared-experts-fusion` whenever shared and
        routed experts of a layer differ in format (Fp8Config has no `can_fuse_shared_expert` veto);
      - moe-TP is derived, tp // ep // moe_dp: the plan's rollout etp must equal tp/ep (else refused);
      - weights are built in the model dtype: fp32/fp16 exceptions are refused by name, except the DeepSeek router
        (`router_fp32` through `--json-model-override-args`) and its fp32 noaux_tc bias.

Public API:
  rollout_config(plan) -> RolloutConfig      # validated; raises UnsupportedByBackend
  emit(plan) -> list[Artifact]                # sglang/server_args.json, sglang/launch_args.txt, sglang/env.sh,
                                              # sglang/quantization_config.json (+ hf_quant_config.json for NVFP4)
  derive_kinds(quant_config, arch) -> {hf_name: kind}     # what SGLang would run, from a quantization_config
  shared_experts_fused(plan) -> bool; serving_prefix(plan, tensor) -> the SGLang module that loads it
  SGLangBackend (registered "sglang"): emit(plan, options, problems), derive_formats(artifacts, arch)
"""

from __future__ import annotations

import fnmatch
import json
import re
from dataclasses import dataclass, field
from typing import Callable, Optional

from precision_dsl.plan import Plan, TensorPlan, per_precision
from precision_dsl.format_specs import is_per_token
from precision_dsl.precision import FormatKind
from precision_dsl.backends.common import (Artifact, Problems, UnsupportedByBackend, argv_file, argv_value,
                                          dump_json, engine_format, fused_module_sizes, is_quantized, kind_handler,
                                          module_of, plan_stamp, read_json_artifact, unsupported_kind)
from precision_dsl.backends.registry import Backend, EmitOptions, register_backend

BACKEND = "sglang"
SGLANG_VERSION = "0.5.23"
MODELOPT_PRODUCER = {"name": "modelopt", "version": "0.47.0"}

# SGLang fused module name -> HF shard names (layers/quantization/utils.py fused mapping + DeepSeek packed mapping).
FUSED_SHARDS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
}
# Roles SGLang never quantizes with these methods (quantizing them cannot be expressed).
_NEVER_QUANTIZED_ROLES = {"lm_head": "ParallelLMHead is not quantized by fp8/mxfp8/modelopt_fp4 configs",
                          "mtp.lm_head": "the NextN shared_head.head is a ParallelLMHead (not quantized)",
                          "mtp.eh_proj": "deepseek_nextn builds eh_proj as a plain nn.Linear (not quantizable)"}
# Row-parallel roles: their K (input) dim is split across TP ranks; the others split N.
_ROW_PARALLEL = {"attn.o", "mlp.down", "routed_experts.down", "shared_experts.down"}


@dataclass
class RolloutConfig:
    method: Optional[str]  # SGLang --quantization value (None: unquantized checkpoint)
    quantization_config: Optional[dict]  # config.json "quantization_config"
    hf_quant_config: Optional[dict]  # hf_quant_config.json (ModelOpt), if any
    exclude: list[str]  # exemption list as written into the checkpoint config
    server_args: list[str]
    env: dict[str, str]
    notes: list[str] = field(default_factory=list)


def _sglang_prefix(t: TensorPlan) -> str:
    return t.sglang_prefix or module_of(t.hf_name)


def _check_fused(plan: Plan, probs: Problems) -> None:
    """Fused modules (qkv, gate_up, q_a+kv_a, shared gate_up, one expert's gate_up) are one GEMM in SGLang. Each
    kind of finding is recorded once, at its first fused module (the same cause repeats over layers and experts)."""
    groups = {m: g for g in plan.share_scale_groups for m in g.members}
    serving_key = per_precision(_serving_key)
    found: set[str] = set()
    for key, members in plan.fused_members().items():
        first = members[0]
        for t in members[1:]:
            if serving_key(t) != serving_key(first) and "siblings" not in found:
                found.add("siblings")
                probs.add(UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"SGLang fuses {', '.join(module_of(m.hf_name).rsplit('.', 1)[-1] for m in members)} into one "
                    f"GEMM ({_sglang_prefix(first)}): all shards need one precision, but {first.hf_name} is "
                    f"{first.precision.short()} and this one is {t.precision.short()}",
                    hint="give the fused siblings the same format in the policy"))
        rules = _SERVING.get(first.weight.kind) if first.is_linear else None
        if rules is not None and rules.fused_one_global_scale and "nvfp4_scale" not in found:
            gids = {groups[m.hf_name].id if m.hf_name in groups else None for m in members}
            if len(members) > 1 and (len(gids) != 1 or None in gids
                                     or set(groups[first.hf_name].members) != {m.hf_name for m in members}):
                found.add("nvfp4_scale")
                probs.add(UnsupportedByBackend(
                    BACKEND, first.hf_name,
                    f"SGLang keeps one NVFP4 weight_scale_2 for the fused module {_sglang_prefix(first)} (it takes "
                    "gate's / the max and does not requantize the others), so its members must share one global "
                    "scale",
                    hint="declare a share-scale group over the fused siblings (e.g. share_scale(gate, up))"))


def _serving_key(t: TensorPlan) -> tuple:
    """What a serving quant method fixes for a module: weight element/block/scale dtype and the activation format.
    The weight global-scale scope (per tensor vs shared by a group) is not part of it: ModelOpt stores one
    weight_scale_2 per checkpoint tensor either way (group members just carry equal values)."""
    w = t.precision.weight
    return (w.kind, w.element, w.block, w.scale_dtype, t.precision.activation)


def _check_experts(plan: Plan) -> None:
    """Raises at the first routed expert whose serving format differs from its layer's first (one cause)."""
    per_layer: dict[tuple, TensorPlan] = {}
    serving_key = per_precision(_serving_key)
    for t in plan.tensors:
        if not t.role.startswith("routed_experts."):
            continue
        key = (t.mtp, t.layer)
        ref = per_layer.setdefault(key, t)
        if serving_key(t) != serving_key(ref):
            raise UnsupportedByBackend(
                BACKEND, t.hf_name,
                f"SGLang's FusedMoE ({_sglang_prefix(t)}) runs all routed experts of a layer (gate/up/down) with one "
                f"quant method, but {ref.hf_name} is {ref.precision.short()} and this one is {t.precision.short()}",
                hint="select whole layers of routed experts (routed_experts in layers[...]) in the policy")


def _check_tensor(t: TensorPlan, plan: Plan) -> None:
    from precision_dsl.backends.quantize import check_supported

    if not is_quantized(t):
        return
    if t.role in _NEVER_QUANTIZED_ROLES:
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"quantized {t.role}: {_NEVER_QUANTIZED_ROLES[t.role]}")
    check_supported(t, BACKEND)
    _served(t.weight.kind, t.hf_name).check(t)


def _check_mxfp8(t: TensorPlan) -> None:
    a = t.precision.activation
    if a.kind != t.weight.kind or a.block != (1, 32):  # W8A8: the activations in the weight's format
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"SGLang mxfp8 is W8A8 with dynamic 1x32 MXFP8 "
                                                       f"activations; plan has activations {a.short()}")


def _check_fp8_block(t: TensorPlan) -> None:
    a = t.precision.activation
    if a.kind != t.weight.kind or a.block != (1, 128):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"SGLang block FP8 quantizes activations dynamically "
                                                       f"1x128; plan has activations {a.short()}")
    if a.scale_dtype not in (None, "fp32"):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"'{a.scale_dtype}' activation scales: SGLang's triton "
                                                       "block-FP8 path computes fp32 1x128 scales; its UE8M0 "
                                                       "(DeepGEMM) rounding is not verified equal to TE pow2",
                                   hint="use fp8_block(scales=fp32) for a Hopper rollout")


def _check_nvfp4(t: TensorPlan) -> None:
    a = t.precision.activation
    if a.kind != t.weight.kind or not is_per_token(a):
        raise UnsupportedByBackend(
            BACKEND, t.hf_name,
            f"NVFP4 activations {a.short()}: SGLang either needs a calibrated static input_scale (per-tensor) "
            "or per-token scales (SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION); only per_token is supported",
            hint="use nvfp4(act_scale=per_token)")
    if not t.role.startswith("routed_experts."):
        raise UnsupportedByBackend(
            BACKEND, t.hf_name,
            "per-token NVFP4 activations outside routed experts: SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION "
            "applies to the FlashInfer MoE runner; the dense ModelOpt FP4 linear uses the static input_scale",
            hint="keep NVFP4 on routed experts only (Miles does the same)")


def _check_shapes(t: TensorPlan, plan: Plan) -> None:
    if not is_quantized(t) or len(t.shape) != 2:
        return
    side = plan.parallel.rollout if plan.parallel else None
    tp, ep = (side.tp, side.ep) if side else (1, 1)
    split = max(tp // ep, 1) if t.role.startswith("routed_experts.") else tp
    kind = t.weight.kind
    rules = _SERVING.get(kind)
    if rules is None or rules.check is None:
        return  # a kind SGLang does not serve: refused by _check_tensor
    n, k = t.shape
    bk = rules.block_k
    k_part = k // split if t.role in _ROW_PARALLEL else k
    n_part = n // split if t.role not in _ROW_PARALLEL else n
    if (t.role in _ROW_PARALLEL and k % split) or (t.role not in _ROW_PARALLEL and n % split):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"shape {t.shape} does not split evenly over {split} ranks")
    if k_part % bk:
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"{kind.value} needs K per rank % {bk} == 0; "
                                                       f"K per rank is {k_part} (shape {t.shape}, split {split})")
    if rules.moe_block_n and split > 1 and n_part % rules.moe_block_n and t.role.startswith("routed_experts."):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"block FP8 MoE needs moe_intermediate/moe_tp % 128 == 0; "
                                                       f"got {n_part} (moe_tp={split})",
                                   hint="use expert parallelism (ep) instead of expert TP for the rollout")


def _exclusions(plan: Plan, modelopt: bool) -> list[str]:
    """Every non-quantized linear, in HF module names; plus SGLang fused / container prefixes (ModelOpt matches
    those, not the shards); FusedMoE containers instead of per-expert names."""
    out: list[str] = []
    seen: set[str] = set()

    def add(name: str) -> None:
        if name not in seen:
            seen.add(name)
            out.append(name)

    by_fused: dict[str, list[TensorPlan]] = {}
    for t in plan.tensors:
        if not t.is_linear or is_quantized(t):
            continue
        if t.role.startswith("routed_experts."):
            add(_sglang_prefix(t))  # model.layers.N.mlp.experts (FusedMoE container)
            continue
        add(module_of(t.hf_name))
        prefix = _sglang_prefix(t)
        last = prefix.rsplit(".", 1)[-1]
        if prefix != module_of(t.hf_name):
            if last in FUSED_SHARDS:
                by_fused.setdefault(prefix, []).append(t)
                # fp8/mxfp8 check fused modules shard by shard under the SGLang prefix's parent
                add(f"{prefix.rsplit('.', 1)[0]}.{module_of(t.hf_name).rsplit('.', 1)[-1]}")
            else:
                add(prefix)  # MTP NextN names (model.decoder.*), shared_head.head
    for prefix in by_fused:
        add(prefix)
    return out


def _check_high_precision(plan: Plan, probs: Problems) -> dict:
    """FP32/FP16 exceptions must reach SGLang or be refused by name. SGLang 0.5.23 builds every weight in the model
    dtype (`--dtype auto` -> config torch_dtype, bf16 for the bundled models), so a checkpoint fp32/fp16 tensor would
    be cast on load, except what the format table's `held` entries keep (see `_fp32_held`). Returns the model-config
    overrides to pass; a refusal is recorded once per (role, dtype), at its first tensor."""
    overrides: dict = {}
    refused: set[tuple] = set()
    for t in plan.tensors:
        kind = t.precision.weight.kind
        held = _SERVING[kind].held if kind in _SERVING else None
        kept = held(t, plan) if held is not None else {}  # a quantized kind: its handler checks it
        if kept is not None:
            overrides.update(kept)
            continue
        what = {"lm_head": "ParallelLMHead holds its weight in the model dtype (--enable-fp32-lm-head only makes "
                           "the logits fp32; the weight is still cast to bf16 on load)",
                "router.weight": f"the {plan.model_type} router is a ReplicatedLinear in the model dtype (no "
                                 "router-dtype option in SGLang 0.5.23)"}.get(
            t.role, "SGLang builds this weight in the model dtype (bf16) and casts the checkpoint tensor on load")
        if (t.role, kind) not in refused:
            refused.add((t.role, kind))
            probs.add(UnsupportedByBackend(BACKEND, t.hf_name, f"{kind.value} {t.role}: {what}",
                                           hint=f"keep {t.role} in bf16 for the rollout, or serve with another "
                                                "engine"))
    return overrides


def _model_dtype_held(t: TensorPlan, plan: Plan) -> Optional[dict]:
    return {}  # the model dtype: nothing to override


def _cast_on_load(t: TensorPlan, plan: Plan) -> Optional[dict]:
    return None  # SGLang would cast the checkpoint tensor to the model dtype: refused


def _fp32_held(t: TensorPlan, plan: Plan) -> Optional[dict]:
    """DeepSeek-V2/V3 `MoEGate.weight` is fp32 when the HF config says `router_fp32` (models/deepseek_v2.py
    MoEGate), which we set with `--json-model-override-args`; the noaux_tc router bias (`e_score_correction_bias`)
    is fp32 anyway."""
    if t.role == "router.bias":
        return {}  # MoEGate keeps e_score_correction_bias in fp32 (noaux_tc)
    if t.role == "router.weight" and plan.model_type in ("deepseek_v3", "deepseek_v2"):
        return {"router_fp32": True}
    return None


def _check_rollout_etp(plan: Plan) -> None:
    """SGLang derives expert-TP as moe_tp_size = tp_size // ep_size // moe_dp_size (runtime_context.py
    `derive_parallel_widths`); there is no expert-TP flag. A rollout etp that differs would be a contract SGLang
    never sees."""
    side = plan.parallel.rollout if plan.parallel else None
    if side is None or not any(t.role.startswith("routed_experts.") for t in plan.tensors):
        return
    if side.tp % side.ep:
        raise UnsupportedByBackend(BACKEND, "<parallel layout>", f"rollout ep={side.ep} does not divide tp="
                                   f"{side.tp}: SGLang requires tp_size % ep_size == 0")
    derived = side.tp // side.ep
    if side.etp != derived:
        first = next(t for t in plan.tensors if t.role.startswith("routed_experts."))
        raise UnsupportedByBackend(BACKEND, first.hf_name, f"rollout etp={side.etp}, but SGLang derives the expert "
                                   f"TP from the launch args: moe_tp = tp/ep = {side.tp}/{side.ep} = {derived}",
                                   hint=f"write rollout:tp={side.tp},ep={side.ep},etp={derived} (or leave etp out), "
                                        "or change the rollout tp/ep")


def _shared_expert_fusion_changes_formats(plan: Plan) -> Optional[TensorPlan]:
    """SGLang (DeepSeek-V2/V3, `resolve_shared_experts_config`) may fuse a layer's shared expert into the routed-
    experts FusedMoE as one more expert, which then runs with the routed experts' quant method. That is exact only
    where shared and routed experts of the layer have one serving format; returns a shared-expert tensor where not."""
    routed: dict[tuple, tuple] = {}
    serving_key = per_precision(_serving_key)
    for t in plan.tensors:
        if t.role.startswith("routed_experts.") and (t.mtp, t.layer) not in routed:
            routed[t.mtp, t.layer] = serving_key(t) if is_quantized(t) else ("hp",)
    for t in plan.tensors:
        if t.role in ("shared_experts.gate", "shared_experts.up", "shared_experts.down"):
            mine = serving_key(t) if is_quantized(t) else ("hp",)
            if (t.mtp, t.layer) in routed and routed[(t.mtp, t.layer)] != mine:
                return t
    return None


# MoE runners after which SGLang 0.5.23 switches shared-expert fusion off itself (arg_groups/overrides.py
# `_moe_runner_fusion_disable`).
_UNFUSING_RUNNERS = frozenset({"flashinfer_trtllm", "flashinfer_trtllm_routed", "experimental_sgl_trtllm",
                               "flashinfer_cutedsl", "lora_triton", "lora_cutedsl", "lora_marlin"})


def shared_experts_fused(plan: Plan) -> bool:
    """Whether SGLang 0.5.23, launched with this plan's emitted args, loads each decoder layer's shared expert into
    the routed-experts FusedMoE: DeepSeek-V3 (models/deepseek_v2.py `shared_experts_fusion_disable_reason`:
    DeepseekV3ForCausalLM with 256 routed experts and one shared expert) and GLM-4.5 (models/glm4_moe.py), on a
    CUDA GPU, with expert parallelism 1, unless `--disable-shared-experts-fusion` is passed or the MoE runner
    turns fusion off; on Blackwell `--moe-runner-backend auto` becomes flashinfer_trtllm for both (BF16 experts
    under no / mxfp8 quantization: arg_groups/overrides.py, the DeepseekV3ForCausalLM sm100 and MXFP8 defaults;
    arg_groups/model_overrides/glm4_moe.py), as it does for MXFP8 anywhere. Raises UnsupportedByBackend where the plan is refused (nothing is served)."""

    return plan.memo("sglang.shared_experts_fused",
                     lambda: _fuses_shared_experts(rollout_config(plan).server_args, plan.model_type, plan.tensors,
                                                   plan.target))


def _fuses_shared_experts(args: list[str], model_type: str, tensors, target: Optional[str]) -> bool:
    """The one reading of SGLang's shared-expert fusion (see `shared_experts_fused`) from the server args, the model
    and the target GPU (None: not known, as for a hand-written launch; only the args then decide the runner)."""
    runner = argv_value(args, "--moe-runner-backend") or "auto"
    ep = int(argv_value(args, "--ep-size") or argv_value(args, "--expert-parallel-size") or 1)
    if runner == "auto" and (target == "blackwell" or argv_value(args, "--quantization") == "mxfp8"):
        runner = "flashinfer_trtllm"
    if "--disable-shared-experts-fusion" in args or runner in _UNFUSING_RUNNERS or ep > 1:
        return False
    tensors = list(tensors)
    gate = next((t for t in tensors if t.role == "shared_experts.gate" and t.mtp is None), None)
    if gate is None:
        return False
    if model_type == "glm4_moe":
        return True
    routed = [t for t in tensors if t.role == "routed_experts.gate" and t.layer == gate.layer and t.mtp is None]
    one_shared = bool(routed) and gate.shape[0] == routed[0].shape[0]  # n_shared_experts x moe_intermediate
    return model_type == "deepseek_v3" and len(routed) == 256 and one_shared


def serving_prefix(plan: Plan, t: TensorPlan) -> str:
    """The SGLang module that loads `t` under the emitted launch. The IR's `sglang_prefix` is the architecture's
    module name with shared-expert fusion off (one name whatever the launch); where SGLang fuses
    (`shared_experts_fused`), `model.layers.N.mlp.shared_experts.*` is loaded as expert `n_routed_experts` of
    `model.layers.N.mlp.experts` (models/deepseek_common/deepseek_weight_loader.py, glm4_moe.py load_weights)."""
    if t.role.startswith("shared_experts.") and t.mtp is None and shared_experts_fused(plan):
        return module_of(t.hf_name).split(".shared_experts.")[0] + ".experts"
    return _sglang_prefix(t)


def rollout_config(plan: Plan) -> RolloutConfig:
    """Validated SGLang configuration of `plan` (memoized on the plan; raises UnsupportedByBackend naming every
    problem found, BackendErrors when there are several)."""

    def compute():
        try:
            return _rollout_config(plan)
        except UnsupportedByBackend as err:
            return err

    res = plan.memo("sglang.rollout_config", compute)
    if isinstance(res, UnsupportedByBackend):
        raise res
    return res


def _rollout_config(plan: Plan) -> RolloutConfig:
    probs = Problems()
    probs.run(_check_rollout_etp, plan)
    model_overrides = _check_high_precision(plan, probs)
    # The per-tensor checks read only (role, precision, linear?, shape) besides the name they report: run them once
    # per distinct combination (a few dozen on DeepSeek-V3's 46k tensors). Each distinct finding is recorded once,
    # at the first tensor in plan order that has it (the representatives are a sample, not a count of tensors).
    distinct = list({(t.role, id(t.precision), t.is_linear, t.shape): t for t in reversed(plan.tensors)}.values())
    distinct.reverse()
    refused = _per_tensor(_check_tensor, distinct, plan, probs)
    _check_fused(plan, probs)
    probs.run(_check_experts, plan)
    # a tensor SGLang cannot serve at all has no shape constraint worth adding
    _per_tensor(_check_shapes, [t for t in distinct if t.hf_name not in refused], plan, probs)

    quant = [t for t in plan.tensors if is_quantized(t)]
    kinds: dict[FormatKind, TensorPlan] = {}
    for t in quant:
        kinds.setdefault(t.weight.kind, t)
    if len(kinds) > 1:
        names = sorted(k.value for k in kinds)
        minority = min(kinds, key=lambda k: sum(1 for t in quant if t.weight.kind == k))
        probs.add(UnsupportedByBackend(
            BACKEND, kinds[minority].hf_name,
            f"one checkpoint mixing {' + '.join(names)}: SGLang {SGLANG_VERSION} has no quant method for this mix "
            "(modelopt_mixed covers FP8 + NVFP4 only)",
            hint="use one quantized format for the rollout and keep the rest bf16"))
    probs.raise_if_any()
    side = plan.parallel.rollout if plan.parallel else None
    tp, ep = (side.tp, side.ep) if side else (1, 1)
    has_moe = any(t.role.startswith("routed_experts.") for t in plan.tensors)
    experts_quantized = any(t.role.startswith("routed_experts.") for t in quant)
    env: dict[str, str] = {}
    notes: list[str] = []
    args = ["--tp-size", str(tp)]
    if side is not None and side.pp > 1:
        args += ["--pp-size", str(side.pp)]
    if has_moe:
        args += ["--ep-size", str(ep)]
    args += ["--kv-cache-dtype", "bf16"]  # explicit: `auto` follows the checkpoint's kv_cache_quant_algo
    kind = next(iter(kinds), None)
    if kind is None:
        q = _Quant(method=None, quantization_config=None, exclude=[])
        if has_moe:
            args += ["--moe-runner-backend", "auto"]
    else:
        q = _served(kind, kinds[kind].hf_name).config(
            plan, _Layout(ep=ep, has_moe=has_moe, experts_quantized=experts_quantized))
        args += q.args
        env.update(q.env)
        notes += q.notes
    unfusable = _shared_expert_fusion_changes_formats(plan)
    if unfusable is not None:
        # also where SGLang would not fuse anyway (ep > 1, trtllm runners): the flag pins the decision
        args += ["--disable-shared-experts-fusion"]
        notes.append(f"shared experts are kept out of the routed-experts FusedMoE ({unfusable.hf_name} is "
                     f"{unfusable.precision.short()}, unlike the routed experts of its layer)")
    if model_overrides:
        args += ["--json-model-override-args", json.dumps(model_overrides, sort_keys=True, separators=(",", ":"))]
    return RolloutConfig(method=q.method, quantization_config=q.quantization_config, hf_quant_config=q.hf_quant_config,
                         exclude=q.exclude, server_args=args, env=env, notes=notes)


def _per_tensor(check, tensors: list[TensorPlan], plan: Plan, probs: Problems) -> set[str]:
    """Run `check(t, plan)` for each tensor; record each distinct capability once. Returns the refused tensors."""
    seen = {e.capability for e in probs.items}
    refused: set[str] = set()
    for t in tensors:
        found = Problems()
        found.run(check, t, plan)
        for e in found.items:
            refused.add(t.hf_name)
            if e.capability not in seen:
                seen.add(e.capability)
                probs.add(e)
    return refused


@dataclass(frozen=True)
class _Layout:
    """What a format's serving config reads from the rollout layout besides the plan."""

    ep: int
    has_moe: bool
    experts_quantized: bool


@dataclass
class _Quant:
    """One format's part of the SGLang configuration: the checkpoint's quant method and config, and the server
    args / env / notes that method needs."""

    method: Optional[str]
    quantization_config: Optional[dict]
    exclude: list[str]
    hf_quant_config: Optional[dict] = None
    args: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)


def _mxfp8_config(plan: Plan, lay: _Layout) -> _Quant:
    exclude = _exclusions(plan, modelopt=False)
    q = _Quant("mxfp8", {"quant_method": "mxfp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                         "weight_block_size": [1, 32], "scale_fmt": "ue8m0", "modules_to_not_convert": exclude},
               exclude, args=["--quantization", "mxfp8", "--fp8-gemm-backend", "triton"])
    if lay.has_moe:
        # cutlass MXFP8 MoE has no EP (Miles run_qwen3_30b_a3b.py); flashinfer_trtllm supports EP.
        q.args += ["--moe-runner-backend", ("flashinfer_trtllm" if lay.ep > 1 else "cutlass")
                   if lay.experts_quantized else "auto"]
    q.notes.append("MXFP8 GEMMs need SM100 (Blackwell); on Hopper SGLang would convert MXFP8 to 128-block FP8 "
                   "(not bit-exact) - do not serve this checkpoint on Hopper")
    return q


def _fp8_block_config(plan: Plan, lay: _Layout) -> _Quant:
    exclude = _exclusions(plan, modelopt=False)
    # DeepGEMM on Blackwell requantizes scales to UE8M0; the triton path keeps the fp32 scales of the plan.
    q = _Quant("fp8", {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "weight_block_size": [128, 128], "modules_to_not_convert": exclude},
               exclude, args=["--quantization", "fp8", "--fp8-gemm-backend", "triton"])
    if lay.has_moe:
        q.args += ["--moe-runner-backend", "triton" if lay.experts_quantized else "auto"]
    return q


def _nvfp4_config(plan: Plan, lay: _Layout) -> _Quant:
    exclude = _exclusions(plan, modelopt=True)
    qcfg = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "ignore": exclude,
            "kv_cache_scheme": None, "producer": MODELOPT_PRODUCER,
            "config_groups": {"group_0": {"weights": {"num_bits": 4, "type": "float", "group_size": 16},
                                          "input_activations": {"num_bits": 4, "type": "float",
                                                                "group_size": 16, "dynamic": True},
                                          "targets": ["Linear"]}}}
    hf_quant = {"policyc": plan_stamp(plan), "producer": MODELOPT_PRODUCER,
                "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                                 "exclude_modules": exclude}}
    return _Quant("modelopt_fp4", qcfg, exclude, hf_quant,
                  args=["--quantization", "modelopt_fp4", "--moe-runner-backend", "flashinfer_trtllm_routed"],
                  env={"SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION": "1",
                       "FLASHINFER_DISABLE_FP4_QUANT_FAST_MATH": "1",
                       "TRTLLM_DISABLE_FP4_QUANT_FAST_MATH": "1"},
                  notes=["NVFP4 GEMMs need SM100 (Blackwell)"])


def _mxfp8_derived(qcfg: dict, fused: bool) -> str:
    return engine_format("mxfp8", block=tuple(qcfg.get("weight_block_size") or (1, 32)))


def _fp8_block_derived(qcfg: dict, fused: bool) -> str:
    # Fp8Config reads float32 weight_scale_inv: the engine sees fp32 scales (power-of-two values are still fp32)
    return engine_format("fp8_block", block=tuple(qcfg.get("weight_block_size") or (128, 128)), scale_dtype="fp32")


def _nvfp4_derived(qcfg: dict, fused: bool) -> str:
    # ModelOpt FP4: 1 x group_size blocks; a fused module (w13 = gate+up, qkv) keeps one weight_scale_2
    return engine_format("nvfp4", block=(1, int(qcfg.get("group_size") or 16)), shared=fused)


@dataclass(frozen=True)
class _ServingFormat:
    """How SGLang serves one format kind. A quantized kind: the per-tensor check, the quant method's configuration,
    the checkpoint `quant_method` it is read back from. A high-precision kind: whether SGLang holds a tensor of that
    kind (`held(t, plan)`: the model-config overrides that keep it, None: refused). Both: the weight format SGLang
    runs for a module ((quantization_config, fused module?) -> TensorFormat.short())."""

    derived: Callable[[dict, bool], str]
    check: Optional[Callable[[TensorPlan], None]] = None
    config: Optional[Callable[[Plan, _Layout], _Quant]] = None
    quant_method: Optional[str] = None
    block_k: int = 1  # K elements per scale block: K per TP rank must be a multiple
    moe_block_n: Optional[int] = None  # FusedMoE needs N per expert-TP rank % this (block FP8's 128-row blocks)
    fused_one_global_scale: bool = False  # one global scale per fused module (ModelOpt NVFP4 weight_scale_2)
    held: Optional[Callable[[TensorPlan, Plan], Optional[dict]]] = None


def _served(kind: FormatKind, tensor: str) -> _ServingFormat:
    """The quantized serving rules of `kind` (a kind SGLang does not quantize with: refused, common.kind_handler)."""
    rules = kind_handler(_SERVING, kind, BACKEND, tensor)
    if rules.check is None:
        raise unsupported_kind(BACKEND, tensor, kind)
    return rules


def _held_derived(kind: FormatKind) -> Callable[[dict, bool], str]:
    return lambda qcfg, fused: engine_format(kind)


# THE format table of the SGLang backend: a quantized kind not here (FP8 per-tensor) is refused (`_served`).
_SERVING = {
    FormatKind.MXFP8: _ServingFormat(_mxfp8_derived, _check_mxfp8, _mxfp8_config, "mxfp8", 32),
    FormatKind.FP8_BLOCK: _ServingFormat(_fp8_block_derived, _check_fp8_block, _fp8_block_config, "fp8", 128,
                                         moe_block_n=128),
    FormatKind.NVFP4: _ServingFormat(_nvfp4_derived, _check_nvfp4, _nvfp4_config, "modelopt", 16,
                                     fused_one_global_scale=True),
    FormatKind.BF16: _ServingFormat(_held_derived(FormatKind.BF16), held=_model_dtype_held),
    FormatKind.FP32: _ServingFormat(_held_derived(FormatKind.FP32), held=_fp32_held),
    FormatKind.FP16: _ServingFormat(_held_derived(FormatKind.FP16), held=_cast_on_load),
}


def emit(plan: Plan) -> list[Artifact]:
    cfg = rollout_config(plan)
    stamp = plan_stamp(plan)
    env_lines = [f"# policyc {stamp['content_hash']} ({plan.policy_name} on {plan.model}); SGLang {SGLANG_VERSION}"]
    env_lines += [f"export {k}={v}" for k, v in sorted(cfg.env.items())]
    manifest = {"policyc": stamp, "sglang_version": SGLANG_VERSION, "quantization": cfg.method,
                "server_args": cfg.server_args, "env": cfg.env,
                "checkpoint": "serve the checkpoint written by `policyc convert` for this plan (its config carries "
                              "the quantization_config below and policyc_plan.json)",
                "quantization_config": cfg.quantization_config, "notes": cfg.notes}
    arts = [Artifact("sglang/server_args.json", dump_json(manifest), "SGLang server args + env + quant config"),
            Artifact("sglang/launch_args.txt", argv_file(cfg.server_args),
                     "argv fragment: python -m sglang.launch_server --model-path CKPT $(cat launch_args.txt)"),
            Artifact("sglang/env.sh", "\n".join(env_lines) + "\n", "environment for the SGLang server"),
            Artifact("sglang/quantization_config.json", dump_json({"policyc": stamp,
                                                                   "quantization_config": cfg.quantization_config}),
                     "config.json quantization_config of the rollout checkpoint")]
    if cfg.hf_quant_config is not None:
        arts.append(Artifact("sglang/hf_quant_config.json", dump_json(cfg.hf_quant_config), "ModelOpt hf_quant_config"))
    return arts


# ---------------------------------------------------------------------------------------------------------------
# derivation: which tensors would SGLang quantize given a quantization_config (used by consistency tests / verify)
# ---------------------------------------------------------------------------------------------------------------
def _path_match(prefix: str, entries: set[str]) -> bool:
    # Fp8Config adds each entry with and without a `model.` prefix; matching is on dotted-path boundaries.
    cands = {prefix, prefix[len("model."):] if prefix.startswith("model.") else "model." + prefix}
    return any(c in entries for c in cands)


def _fp8_skipped(prefix: str, entries: set[str]) -> bool:
    last = prefix.rsplit(".", 1)[-1]
    if last == "experts":
        return any("experts" in e and prefix in e for e in entries)
    if last in FUSED_SHARDS:
        parent = prefix.rsplit(".", 1)[0]
        flags = [_path_match(f"{parent}.{s}", entries) for s in FUSED_SHARDS[last]]
        if any(flags) and not all(flags):
            raise ValueError(f"{prefix}: SGLang requires all shards of fused layers to have the same precision")
        return all(flags)
    return _path_match(prefix, entries)


class _ModelOptMatcher:
    """ModelOpt `is_layer_excluded`: glob -> regex full match against the prefix or any single dotted part; a
    pattern ending in q_a_proj / kv_a_proj_with_mqa also excludes the fused fused_qkv_a_proj_with_mqa.
    Literal patterns (the common case) are matched through a set, globs through precompiled regexes."""

    def __init__(self, patterns: list[str]):
        self.literal = {p for p in patterns if not any(c in p for c in "*?[")}
        self.globs = [re.compile(fnmatch.translate(p)) for p in patterns if p not in self.literal]
        self.mla_parents = {p.rsplit(".", 1)[0] for p in patterns
                            if p.rsplit(".", 1)[-1] in ("q_a_proj", "kv_a_proj_with_mqa")}

    def __call__(self, prefix: str) -> bool:
        parts = prefix.split(".")
        if prefix in self.literal or any(part in self.literal for part in parts):
            return True
        if any(rx.match(prefix) or any(rx.match(part) for part in parts) for rx in self.globs):
            return True
        if prefix.endswith("fused_qkv_a_proj_with_mqa"):
            return any(parent in prefix for parent in self.mla_parents)
        return False


def derive_kinds(quant_config: Optional[dict], arch) -> dict[str, str]:
    """{hf_name: kind} SGLang would run for `arch` under a checkpoint `quantization_config` (None: unquantized).
    Independent of the plan: reads only the config, with SGLang's own matching rules. `SGLangBackend.derive_formats`
    adds the format fields."""
    out: dict[str, str] = {}
    if not quant_config:
        return {t.hf_name: "bf16" for t in arch.tensors}
    method = quant_config.get("quant_method")
    if method == "modelopt":
        kind = {"NVFP4": "nvfp4"}[quant_config["quant_algo"]]
        skipped = _ModelOptMatcher(list(quant_config.get("ignore") or quant_config.get("exclude_modules") or []))
    else:
        kind = next((k.value for k, r in _SERVING.items() if r.quant_method is not None and r.quant_method == method),
                    None)
        if kind is None:
            raise ValueError(f"quant_method {method!r}: not one SGLang {SGLANG_VERSION} method policyc emits")
        entries = set(quant_config.get("modules_to_not_convert") or quant_config.get("ignored_layers") or [])
        skipped = lambda p: _fp8_skipped(p, entries)  # noqa: E731
    memo: dict[str, bool] = {}  # one answer per SGLang module (all experts of a layer share one prefix)
    for t in arch.tensors:
        if not t.is_linear or t.role in _NEVER_QUANTIZED_ROLES or t.sglang_prefix is None:
            out[t.hf_name] = "bf16"
            continue
        if t.sglang_prefix not in memo:
            memo[t.sglang_prefix] = skipped(t.sglang_prefix)
        out[t.hf_name] = "bf16" if memo[t.sglang_prefix] else kind
    return out


def derive_formats_of_config(quant_config: Optional[dict], arch) -> dict[str, str]:
    """{hf_name: TensorFormat.short()} of the weight SGLang runs for each tensor under `quant_config`."""
    kinds = derive_kinds(quant_config, arch)
    fused = fused_module_sizes(arch)
    return {n: _SERVING[FormatKind(k)].derived(quant_config or {}, fused.get(n, 1) > 1) for n, k in kinds.items()}


@dataclass(frozen=True)
class RolloutTensor:
    """What SGLang loads and computes for one HF tensor: the weight format (derive_formats' answer) and the
    activation of a quantized GEMM (`act`: TensorFormat.short() parts the audit turns into a format)."""

    kind: str  # bf16 | mxfp8 | fp8_block | nvfp4
    weight: str  # TensorFormat.short()
    why: tuple[str, ...]
    act_scope: Optional[str] = None  # NVFP4: row (per token, computed online) | tensor (the static input_scale)
    shared: bool = False  # one weight_scale_2 for the fused module
    block: Optional[tuple[int, int]] = None




def shared_experts_fusion(server_args: list[str], arch, target: Optional[str] = None) -> Optional[str]:
    """Why SGLang fuses the shared experts into the routed FusedMoE under these server args, or None when it does not
    (the same reading as `shared_experts_fused`, for a launch read back: `_fuses_shared_experts`)."""
    if not _fuses_shared_experts(server_args, arch.model_type, arch.tensors, target):
        return None
    return (f"SGLang {SGLANG_VERSION} loads the shared expert as one more expert of the routed FusedMoE "
            "(no --disable-shared-experts-fusion, ep 1, a MoE runner that keeps fusion on)")


def rollout_tensors(quant_config: Optional[dict], env: dict, server_args: list[str], arch) -> dict[str, RolloutTensor]:
    """{hf_name: RolloutTensor}: the rollout's side of a deployment from the checkpoint's quantization_config, the
    server args and the server's env (emitted, or a hand-written launch / a converted checkpoint). The same reading
    as `derive_formats` (derive_kinds + the format table's `derived`), plus shared-expert fusion and the NVFP4
    activation SGLang computes."""
    kinds = derive_kinds(quant_config, arch)
    fused = fused_module_sizes(arch)
    fusion = shared_experts_fusion(server_args, arch)
    routed_kind: dict[tuple, str] = {}
    for t in arch.tensors:
        if t.role.startswith("routed_experts."):
            routed_kind.setdefault((t.mtp, t.layer), kinds[t.hf_name])
    method = (quant_config or {}).get("quant_method")
    where = "the checkpoint's quantization_config" if quant_config else "an unquantized checkpoint"
    per_token = env.get("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION") == "1"
    out: dict[str, RolloutTensor] = {}
    for t in arch.tensors:
        k = kinds[t.hf_name]
        why = [f"{where} ({method})" if quant_config else where]
        is_fused = fused.get(t.hf_name, 1) > 1
        if fusion and t.role in ("shared_experts.gate", "shared_experts.up", "shared_experts.down") \
                and (t.mtp, t.layer) in routed_kind:
            k, is_fused = routed_kind[(t.mtp, t.layer)], t.role != "shared_experts.down"
            why = [fusion + f": it runs the routed experts' {k}"]
        elif t.is_linear and k == "bf16" and quant_config and t.sglang_prefix is not None \
                and t.role not in _NEVER_QUANTIZED_ROLES:
            why.append(f"{t.sglang_prefix} is excluded")
        elif t.role in _NEVER_QUANTIZED_ROLES:
            why = [_NEVER_QUANTIZED_ROLES[t.role]]
        rules = _SERVING.get(FormatKind(k)) if k not in ("bf16", "fp16", "fp32") else None
        if rules is None:
            out[t.hf_name] = RolloutTensor(k, k, tuple(why))
            continue
        fields: dict = {}
        if k == "nvfp4":
            expert = t.role.startswith("routed_experts.") or (fusion is not None and t.role.startswith("shared_"))
            row = per_token and expert
            why.append("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION=1: per-token activation scales" if row else
                       ("SGLANG_FLASHINFER_NVFP4_PER_TOKEN_ACTIVATION unset" if expert else "a dense ModelOpt FP4 "
                        "linear") + ": the checkpoint's static per-tensor input_scale")
            fields = dict(act_scope="row" if row else "tensor", shared=is_fused,
                          block=(1, int((quant_config or {}).get("group_size") or 16)))
        out[t.hf_name] = RolloutTensor(k, rules.derived(quant_config or {}, is_fused), tuple(why), **fields)
    return out


@register_backend
class SGLangBackend(Backend):
    name = BACKEND
    role = "rollout"
    description = f"SGLang {SGLANG_VERSION} server args, env and the checkpoint quantization_config (rollout)"

    def artifacts(self, plan: Plan, options: EmitOptions) -> list[Artifact]:
        return emit(plan)

    def derive_formats(self, artifacts, arch) -> dict[str, str]:
        """The rollout's weight formats from sglang/quantization_config.json, matched with SGLang's exemption
        rules (Fp8Config is_layer_skipped / ModelOpt is_layer_excluded)."""
        doc = read_json_artifact(artifacts, "sglang/quantization_config.json")
        return derive_formats_of_config(doc.get("quantization_config"), arch)
