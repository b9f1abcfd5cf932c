"""Megatron-core (>= 0.16.0, verified against 0.16.1) + TransformerEngine trainer backend.

Emits, for one plan:
  * global flags: --fp8-format/--fp8-recipe (tensorwise|blockwise|mxfp8), --fp4-format e2m1/--fp4-recipe nvfp4,
    --first-last-layers-bf16 --num-layers-at-start-in-bf16 N --num-layers-at-end-in-bf16 M (always explicit:
    Megatron's defaults are 1/1), --fp8-param-gather / --fp4-param-gather when the whole trainer is one format,
    --moe-router-dtype fp32 for an fp32 router, the parallel sizes and, for a layer count the pipeline does not
    divide, --decoder-first/last-pipeline-num-layers (Megatron-LM core_v0.16.1 validate_args otherwise asserts
    num_layers % pp == 0);
  * ONE per-module `--te-precision-config-file` YAML (TEQuantizationParams configs + ordered glob matchers on
    Megatron module names, first match wins; megatron/core/quantization/quant_config.py). Matchers only override
    modules whose autocast is already quantized (override_quantized_autocast=True, override_nonquantized=False),
    so first/last BF16 layers stay BF16 whatever the matchers say. megatron-core matches the module path of
    GPTModel.named_modules(), whose layer index is LOCAL to the pipeline stage, and Megatron gives every rank the
    same command line: a layer-specific rule is emitted with stage-local indices when it means the same thing on
    every stage, and refused by name otherwise (megatron-core 0.16.1 has only GlobMatcher, no global-layer match);
  * TE env vars: NVTE_BACKWARD_OVERRIDE (high_precision|dequantized), NVFP4 1x16 weights / no RHT / no stochastic
    rounding / row-scaled (per-token) activations, NVTE_FP8_BLOCK_SCALING_FP32_SCALES; env.sh also unsets
    NVTE_USE_FAST_MATH and NVTE_NVFP4_4OVER6 (TE's defaults are the exact ones; a leftover user value is not).

Exactness rules (collected and raised together as UnsupportedByBackend):
  * a TE recipe quantizes both GEMM inputs with one format -> weight and activation kinds must match;
  * fused Megatron modules (linear_qkv = q,k,v; linear_fc1 = gate,up; TEGroupedLinear = all routed experts of a
    layer) run one recipe -> all their HF tensors need one precision;
  * NVFP4: TE takes the amax of the whole TE weight (fc1 = [gate; up] of one expert) per TP shard -> the plan's
    global scale must be a share-scale group equal to the fused members, and that dim must not be TP-split;
  * env vars are process-wide -> one backward mode, one NVFP4 activation scope, one FP8-block scale dtype;
  * embedding / output_layer are not TE modules in megatron-core 0.16 -> cannot be quantized;
  * MTP under FP4: megatron-core 0.16.1 opens no quantized autocast for the MTP layer unless config.fp8
    (multi_token_prediction.py "currently ignoring FP4 in MTP layers") -> quantized MTP modules need an FP8 global;
  * high-precision exceptions: router fp32 -> --moe-router-dtype fp32 (one flag for all layers); expert_bias is
    always fp32 in megatron-core (router.py _maintain_float32_expert_bias); any other fp32 / fp16 tensor has no
    megatron-core 0.16.1 option under --bf16 -> refused by name, never dropped;
  * with --te-version, a capability the installed TE lacks (backends/versions.py) is refused by name.

Public API:
  trainer_config(plan, te_version=None) -> TrainerConfig
  emit(plan, te_version=None) -> list[Artifact]   # megatron/args.txt, flags.json, env.sh, te_precision.yaml
  pipeline_split(num_layers, pp) -> None | (first, last);  stage_ranges(num_layers, pp) -> [range per PP rank]
  derive_kinds(flags, yamls, arch, pp) -> {hf_name: kind}   # uses megatron-core's own loader when asked
  MegatronBackend (registered "megatron"): emit(plan, options, problems), derive_formats(artifacts, arch)
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Callable, Optional

from precision_dsl.plan import Plan, TensorPlan
from precision_dsl.format_specs import NVFP4_SPEC, Scope
from precision_dsl.precision import BackwardMode, FormatKind, Precision

from precision_dsl.backends import versions
from precision_dsl.backends.common import (Artifact, ArtifactError, Problems, UnsupportedByBackend, argv_file,
                                          dump_json, engine_format, fused_module_sizes, kind_handler, plan_stamp,
                                          read_json_artifact, unsupported_kind)
from precision_dsl.backends.registry import Backend, EmitOptions, register_backend

BACKEND = "megatron"
BF16_CONFIG = "bf16"
TE_YAML = "te_precision.yaml"

# TE recipe name -> the plan's weight kind it produces.
RECIPE_KIND = {"mxfp8": "mxfp8", "blockwise": "fp8_block", "tensorwise": "fp8", "nvfp4": "nvfp4"}
_FP4_RECIPES = {"nvfp4"}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
# Variables TE reads whose default is the exact behaviour: unset in env.sh rather than exported (NVTE_USE_FAST_MATH
# is read by TE's C++ quantizer, transformer_engine/pytorch/csrc/quantizer.cpp; NVTE_NVFP4_4OVER6 exists from TE 2.17,
# default "none": TE 2.20.2 common/recipe/__init__.py).
UNSET_ENV = ("NVTE_USE_FAST_MATH", "NVTE_NVFP4_4OVER6", "NVTE_NVFP4_4OVER6_ERR_USE_FAST_MATH")


@dataclass(frozen=True)
class Recipe:
    """One TE quantization recipe (what a TEQuantizationParams training_recipe says)."""

    name: str  # bf16 | mxfp8 | blockwise | tensorwise | nvfp4
    fp8_format: str = "e4m3"  # e4m3 | hybrid (E5M2 gradients)

    @property
    def key(self) -> str:
        return self.name if self.name in (BF16_CONFIG, "nvfp4") or self.fp8_format == "e4m3" \
            else f"{self.name}_{self.fp8_format}"

    def te_recipe(self) -> dict:
        if self.name == BF16_CONFIG:
            return {}
        if self.name in _FP4_RECIPES:
            return {"fp4_quantization_recipe": self.name}
        return {"fp8_quantization_recipe": self.name, "fp8_format": self.fp8_format}


@dataclass
class TrainerConfig:
    flags: list[str]
    env: dict[str, str]
    module_recipes: dict[str, Recipe]  # global Megatron module path -> recipe (decoder + mtp modules)
    yamls: dict[str, dict]  # file name -> YAML document (at most one: te_precision.yaml)
    first_last: tuple[int, int]  # (start, end) BF16 layer counts, (0, 0) when the flag is not used
    stages: list[range] = field(default_factory=list)  # global decoder layers of each PP rank
    requires: list = field(default_factory=list)  # versions.Requirement
    notes: list[str] = field(default_factory=list)

    @property
    def te_minimum(self) -> str:
        return versions.minimum(self.requires, "transformer-engine")

    @property
    def mcore_minimum(self) -> str:
        return versions.minimum(self.requires, "megatron-core")


def megatron_module(megatron_name: str) -> str:
    """Module path of a Megatron parameter name: drop `.weight`, `.weight17`, `.bias`, `.layer_norm_weight`."""
    return megatron_name.rsplit(".", 1)[0]


# ---------------------------------------------------------------------------------------------------------------
# pipeline layout (megatron-core 0.16.1 transformer_layer.get_transformer_layer_offset / uneven PP)
# ---------------------------------------------------------------------------------------------------------------
def pipeline_split(num_layers: int, pp: int) -> Optional[tuple[int, int]]:
    """(layers of the first stage, layers of the last stage) when `pp` does not divide `num_layers`, else None.
    Middle stages get num_layers // pp each; the remainder goes to the first and last stage (megatron-core requires
    the middle layers to split evenly over pp - 2 stages, TransformerConfig.__post_init__ "Uneven PP")."""
    if pp <= 1 or num_layers % pp == 0:
        return None
    if pp == 2:
        first = (num_layers + 1) // 2
        return first, num_layers - first
    base, rem = divmod(num_layers, pp)
    return base + (rem + 1) // 2, base + rem // 2


def stage_ranges(num_layers: int, pp: int) -> list[range]:
    split = pipeline_split(num_layers, pp)
    if split is None:
        per = num_layers // pp if pp > 0 else num_layers
        return [range(s * per, (s + 1) * per) for s in range(pp)]
    first, last = split
    mid = (num_layers - first - last) // (pp - 2) if pp > 2 else 0
    out = [range(0, first)]
    for s in range(pp - 2):
        out.append(range(first + s * mid, first + (s + 1) * mid))
    out.append(range(num_layers - last, num_layers))
    return out


# ---------------------------------------------------------------------------------------------------------------
# precision -> TE recipe
# ---------------------------------------------------------------------------------------------------------------
def _recipe_for(t: TensorPlan) -> Recipe:
    p: Precision = t.precision
    w, a, g = p.weight, p.activation, p.grad
    if not p.is_quantized:
        return Recipe(BF16_CONFIG)
    if w.kind != a.kind:
        raise UnsupportedByBackend(BACKEND, t.hf_name,
                                   f"weight {w.short()} with activation {a.short()}: a TE recipe quantizes both "
                                   "GEMM inputs with one format (no weight-only or mixed W/A recipes)")
    quant_bwd = p.backward == BackwardMode.QUANTIZED
    fmt = "e4m3"
    if quant_bwd and g.kind != w.kind:
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"quantized backward with {g.short()} gradients under a "
                                                       f"{w.kind.value} recipe: TE uses the recipe's own format")
    if quant_bwd and g.element == "e5m2":
        fmt = "hybrid"
    return kind_handler(_TE_FORMATS, w.kind, BACKEND, t.hf_name).recipe(t, fmt, quant_bwd)


def _mxfp8_recipe(t: TensorPlan, fmt: str, quant_bwd: bool) -> Recipe:
    w, a = t.precision.weight, t.precision.activation
    if w.block != (1, 32) or a.block != (1, 32) or w.element != "e4m3":
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"TE MXFP8BlockScaling is 1x32 e4m3 forward; plan says "
                                                       f"W {w.short()} A {a.short()}")
    return Recipe("mxfp8", fmt)


def _fp8_block_recipe(t: TensorPlan, fmt: str, quant_bwd: bool) -> Recipe:
    w, a = t.precision.weight, t.precision.activation
    if w.block != (128, 128) or a.block != (1, 128):
        raise UnsupportedByBackend(BACKEND, t.hf_name, "TE Float8BlockScaling is 128x128 weights / 1x128 "
                                                       f"activations; plan says W {w.block} A {a.block}")
    return Recipe("blockwise", fmt)


def _fp8_recipe(t: TensorPlan, fmt: str, quant_bwd: bool) -> Recipe:
    return Recipe("tensorwise", fmt)


def _nvfp4_recipe(t: TensorPlan, fmt: str, quant_bwd: bool) -> Recipe:
    w, a = t.precision.weight, t.precision.activation
    if quant_bwd:
        raise UnsupportedByBackend(BACKEND, t.hf_name, "quantized NVFP4 backward (TE's NVFP4 gradients use RHT "
                                                       "and stochastic rounding, which policyc turns off)")
    if w.block not in ((1, 16), (16, 16)) or a.block != (1, 16):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"TE NVFP4 is 1x16 (or 16x16 weights); plan says "
                                                       f"W {w.block} A {a.block}")
    if not NVFP4_SPEC.one_weight_scale_per_tensor(w.global_scale):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"'{w.global_scale}' weight global scale: TE keeps one "
                                                       "amax per weight tensor")
    if not NVFP4_SPEC.activation_scale_supported(a.global_scale):
        raise UnsupportedByBackend(BACKEND, t.hf_name, f"'{a.global_scale}' activation global scale: TE supports "
                                                       "per-tensor or row-scaled (per-token) activations")
    return Recipe("nvfp4")


def _module_tensors(plan: Plan, probs: Problems) -> dict[str, list[TensorPlan]]:
    mods: dict[str, list[TensorPlan]] = defaultdict(list)
    for t in plan.tensors:
        if not t.is_linear:
            continue
        if t.megatron_name is None or not t.megatron_name.startswith(("decoder.", "mtp.")):
            if t.precision.is_quantized:
                probs.add(UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"quantized {t.role}: {t.megatron_name or 'this tensor'} is not a TransformerEngine module in "
                    "megatron-core 0.16 (fp8_output_proj exists only in Megatron HEAD)"))
            continue
        if t.role == "mtp.eh_proj" and t.precision.is_quantized:
            probs.add(UnsupportedByBackend(BACKEND, t.hf_name, "quantized MTP eh_proj: its autocast scope in "
                                                               "megatron-core 0.16 is not the MTP layer's "
                                                               "(unverified)"))
            continue
        mods[megatron_module(t.megatron_name)].append(t)
    return mods


def _check_nvfp4_scope(module: str, members: list[TensorPlan], plan: Plan, probs: Problems, groups: dict) -> None:
    """TE computes one amax per TE weight tensor (per TP shard): fc1 = [gate; up] of one expert, qkv = [q; k; v].
    `groups`: HF name -> its share-scale group (built once per plan, not per module)."""
    by_param: dict[str, list[TensorPlan]] = defaultdict(list)
    for t in members:
        by_param[t.megatron_name].append(t)
    side = plan.parallel.trainer if plan.parallel else None
    for pname, ts in by_param.items():
        expert = "experts" in pname.split(".")
        tp = (side.etp if expert else side.tp) if side else 1
        if tp > 1:
            probs.add(UnsupportedByBackend(BACKEND, ts[0].hf_name,
                                           f"NVFP4 per-tensor weight scale under {'expert ' if expert else ''}"
                                           f"TP={tp}: TE computes the amax per TP shard, so the trainer's global "
                                           "scale would differ from the checkpoint's",
                                           hint=f"use {'etp' if expert else 'tp'}=1 for NVFP4 modules"))
            continue
        if len(ts) == 1:
            continue
        names = {t.hf_name for t in ts}
        g = groups.get(ts[0].hf_name)
        if g is None or set(g.members) != names:
            probs.add(UnsupportedByBackend(
                BACKEND, ts[0].hf_name,
                f"separate NVFP4 global scales for {', '.join(sorted(t.megatron_part or '?' for t in ts))}: TE "
                f"computes one amax over the fused weight",
                hint="declare a share-scale group over the fused siblings (e.g. `share_scale routed_experts.{gate, up}`)"))


def _module_recipes(plan: Plan, probs: Problems) -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    groups = None
    for module, members in _module_tensors(plan, probs).items():
        first = members[0]
        rec = probs.run(_recipe_for, first)
        if rec is None:
            continue
        bad = False
        for t in members[1:]:
            if t.precision is not first.precision and t.precision != first.precision:
                what = ("all routed experts of a layer (TEGroupedLinear)" if ".experts." in module
                        else "the fused module")
                probs.add(UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"{what} runs one TE recipe, but {first.role} is {first.precision.short()} and {t.role} is "
                    f"{t.precision.short()}",
                    hint="give every tensor of the fused Megatron module the same precision"))
                bad = True
                break
        if bad:
            continue
        if rec.name == "nvfp4":
            if groups is None:
                groups = {m: g for g in plan.share_scale_groups for m in g.members}
            _check_nvfp4_scope(module, members, plan, probs, groups)
        out[module] = rec
    return out


def _uniform(plan: Plan, what: str, values: dict[str, object], capability: str, probs: Problems) -> object:
    distinct = {v for v in values.values() if v is not None}
    if len(distinct) > 1:
        ref = next(iter(values.values()))
        odd = next(n for n, v in values.items() if v != ref)
        probs.add(UnsupportedByBackend(BACKEND, odd, f"{capability}: the plan uses {sorted(map(str, distinct))} "
                                                     f"for {what}, but TE reads it from one process-wide env var"))
        return ref
    return next(iter(distinct), None)


def _env(plan: Plan, probs: Problems, reqs: list) -> dict[str, str]:
    # env values depend only on the precision: one representative tensor per distinct Precision object (thousands of
    # DeepSeek-V3 experts share a handful)
    seen: dict[int, TensorPlan] = {}
    for t in plan.tensors:
        if t.is_linear and id(t.precision) not in seen and t.precision.is_quantized:
            seen[id(t.precision)] = t
    quant = list(seen.values())
    env: dict[str, str] = {}
    if not quant:
        return env
    bwd = _uniform(plan, "the backward mode", {t.hf_name: t.backward.value for t in quant},
                   "per-module backward mode", probs)
    if bwd in ("high_precision", "dequantized"):
        env["NVTE_BACKWARD_OVERRIDE"] = str(bwd)
        reqs.append(versions.requirement("te.backward_override"))
        if bwd == "dequantized":
            reqs.append(versions.requirement("te.dequantized_drops_saved_input"))
    for kind, rules in _TE_FORMATS.items():
        of_kind = [t for t in quant if t.weight.kind == kind]
        if of_kind and rules.env is not None:
            rules.env(plan, of_kind, env, probs, reqs)
    return env


def _nvfp4_env(plan: Plan, nv: list[TensorPlan], env: dict[str, str], probs: Problems, reqs: list) -> None:
    act = _uniform(plan, "NVFP4 activation global scales", {t.hf_name: t.activation.global_scale or "tensor"
                                                             for t in nv},
                   "per-module NVFP4 activation scaling", probs)
    w2d = _uniform(plan, "NVFP4 weight blocks", {t.hf_name: t.weight.block for t in nv}, "per-module NVFP4 2D",
                   probs)
    env["NVTE_NVFP4_DISABLE_2D_QUANTIZATION"] = "0" if w2d == (16, 16) else "1"
    env["NVTE_NVFP4_DISABLE_RHT"] = "1"
    env["NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"] = "1"
    reqs.append(versions.requirement("te.nvfp4_formula"))
    if act == Scope.PER_TOKEN:
        env["NVTE_NVFP4_ROW_SCALED_ACTIVATION"] = "1"
        reqs.append(versions.requirement("te.nvfp4_row_scaled_activation"))


def _fp8_block_env(plan: Plan, fb: list[TensorPlan], env: dict[str, str], probs: Problems, reqs: list) -> None:
    sd = _uniform(plan, "FP8-block scale dtypes",
                  {t.hf_name: (t.weight.scale_dtype or "fp32") for t in fb}
                  | {t.hf_name + " (activation)": (t.activation.scale_dtype or "fp32") for t in fb},
                  "per-module FP8-block scale dtype", probs)
    # TE default is power-of-2 scales; =1 keeps exact fp32 scales (Hopper only: Blackwell emulates blockwise
    # with MXFP8 and requires pow2).
    env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1" if sd == "fp32" else "0"
    reqs.append(versions.requirement("te.fp8_block_fp32_scales"))


def _no_recipe(t: TensorPlan, fmt: str, quant_bwd: bool) -> Recipe:
    raise unsupported_kind(BACKEND, t.hf_name, t.precision.weight.kind)


def _bf16_held(t: TensorPlan) -> Optional[tuple[str, str]]:
    if t.role == "router.bias":
        return ("bf16 expert bias: megatron-core keeps the router's expert_bias in fp32 (router.py "
                "_maintain_float32_expert_bias)", "keep router.bias fp32")
    return None


def _fp32_held(t: TensorPlan) -> Optional[tuple[str, str]]:
    # router.weight: --moe-router-dtype fp32 (below); router.bias: expert_bias is an fp32 buffer in megatron-core
    if t.role in ("router.weight", "router.bias"):
        return None
    return (f"fp32 {t.role}: megatron-core 0.16.1 under --bf16 holds {t.role} in bf16 (fp32 only as the optimizer's "
            "main copy) and has no per-module fp32 option", f"keep {t.role} bf16 for the Megatron trainer")


def _fp16_held(t: TensorPlan) -> Optional[tuple[str, str]]:
    return (f"fp16 {t.role}: the trainer runs --bf16 and megatron-core 0.16.1 has no per-module fp16",
            f"keep {t.role} bf16 for the Megatron trainer")


def _held_derived(kind: FormatKind) -> Callable[[dict, bool], str]:
    return lambda env, fused: engine_format(kind)


@dataclass(frozen=True)
class _TeFormat:
    """How the trainer runs one format kind. A quantized kind: its TE recipe (checked against the plan's format)
    and the process-wide TE env vars it sets (None: none). A high-precision kind: whether megatron-core 0.16.1 under
    --bf16 holds a tensor of that kind (`held`: None, or the refusal's (capability, hint)) and the
    --moe-router-dtype that runs routers in it (None: the default, params_dtype). Derivation reads the same table
    back (`_derived_weight`)."""

    recipe: Callable[[TensorPlan, str, bool], Recipe]
    env: Optional[Callable[[Plan, list, dict, Problems, list], None]]
    derived: Callable[[dict, bool], str]  # (env of the emitted flags.json, fused module?) -> weight format short()
    held: Optional[Callable[[TensorPlan], Optional[tuple[str, str]]]] = None
    router_dtype: Optional[str] = None


def _mxfp8_derived(env: dict, fused: bool) -> str:
    return engine_format("mxfp8")


def _nvfp4_derived(env: dict, fused: bool) -> str:
    # TE takes one amax per TE weight tensor: the members of a fused module (fc1 = [gate; up]) share it
    block = (16, 16) if env.get("NVTE_NVFP4_DISABLE_2D_QUANTIZATION") == "0" else (1, 16)
    return engine_format("nvfp4", block=block, shared=fused)


def _fp8_block_derived(env: dict, fused: bool) -> str:
    return engine_format("fp8_block", scale_dtype="fp32" if env.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES") == "1"
                         else "pow2")


def _fp8_derived(env: dict, fused: bool) -> str:
    return engine_format("fp8")


# THE format table of the Megatron/TE backend, one entry per kind (a quantized kind without a TE recipe would be
# refused: common.kind_handler). Order matters only for the env: the NVFP4 variables are written before the
# FP8-block one.
_TE_FORMATS = {
    FormatKind.MXFP8: _TeFormat(_mxfp8_recipe, None, _mxfp8_derived),
    FormatKind.NVFP4: _TeFormat(_nvfp4_recipe, _nvfp4_env, _nvfp4_derived),
    FormatKind.FP8_BLOCK: _TeFormat(_fp8_block_recipe, _fp8_block_env, _fp8_block_derived),
    FormatKind.FP8: _TeFormat(_fp8_recipe, None, _fp8_derived),
    FormatKind.BF16: _TeFormat(_no_recipe, None, _held_derived(FormatKind.BF16), held=_bf16_held),
    # TopKRouter.gating runs router_gating_linear in fp32 (the live parameter is params_dtype; the optimizer's main
    # copy is fp32)
    FormatKind.FP32: _TeFormat(_no_recipe, None, _held_derived(FormatKind.FP32), held=_fp32_held,
                               router_dtype="fp32"),
    FormatKind.FP16: _TeFormat(_no_recipe, None, _held_derived(FormatKind.FP16), held=_fp16_held),
}


def _high_precision_flags(plan: Plan, probs: Problems) -> list[str]:
    """High-precision (fp32/fp16/bf16) exceptions of non-quantized tensors, expressed in megatron-core 0.16.1's
    terms or refused (the `held` / `router_dtype` entries of the format table)."""
    flags: list[str] = []
    routers = [t for t in plan.tensors if t.role == "router.weight"]
    dtypes = [kind_handler(_TE_FORMATS, t.weight.kind, BACKEND, t.hf_name).router_dtype for t in routers]
    wanted = sorted({d for d in dtypes if d is not None})
    if wanted:
        if len(set(dtypes)) > 1:
            odd = next(t for t, d in zip(routers, dtypes) if d != wanted[0])
            probs.add(UnsupportedByBackend(BACKEND, odd.hf_name,
                                           f"router {odd.weight.kind.value} next to {wanted[0]} routers: "
                                           "megatron-core's --moe-router-dtype is one setting for every MoE layer",
                                           hint="give every router one precision"))
        else:
            flags += ["--moe-router-dtype", wanted[0]]
    for t in plan.tensors:
        held = kind_handler(_TE_FORMATS, t.precision.weight.kind, BACKEND, t.hf_name).held
        refusal = held(t) if held is not None else None  # a quantized kind: its recipe decides
        if refusal is not None:
            probs.add(UnsupportedByBackend(BACKEND, t.hf_name, refusal[0], hint=refusal[1]))
    return flags


# ---------------------------------------------------------------------------------------------------------------
# flags + YAML
# ---------------------------------------------------------------------------------------------------------------
def _split_layer(module: str) -> tuple[Optional[int], str]:
    m = _LAYER_RE.match(module)
    return (int(m.group(1)), m.group(2)) if m else (None, module)


def _first_last(plan: Plan, recipes: dict[str, Recipe], pp: int) -> tuple[int, int]:
    L = plan.num_layers
    layer_q: dict[int, bool] = defaultdict(bool)
    for mod, r in recipes.items():
        layer, _ = _split_layer(mod)
        if layer is not None:
            layer_q[layer] |= r.name != BF16_CONFIG
    cap = L // pp  # TransformerConfig.__post_init__: 0 <= num_layers_at_{start,end}_in_bf16 <= num_layers // pp
    start = 0
    while start < min(L, cap) and not layer_q[start]:
        start += 1
    end = 0
    while end < min(L - start, cap) and not layer_q[L - 1 - end]:
        end += 1
    return start, end


def _config_doc(recipe: Recipe) -> dict:
    return {"transformer_engine_config_type": "TEQuantizationParams", "training_recipe": recipe.te_recipe(),
            "evaluation_recipe": recipe.te_recipe()}


def _te_yaml(recipes: dict[str, Recipe], stages: list[range], active: range, probs: Problems,
             hf_of: dict[str, str]) -> dict:
    """One YAML for every pipeline rank. Decoder rules: per module kind, a layer-agnostic glob with the most common
    recipe, plus stage-local exceptions `decoder.layers.<local>.<kind>`; an exception is only expressible when every
    stage that has that local index wants the same recipe there (layers inside the first/last BF16 ranges never
    reach a matcher's effect: their autocast is off and override_nonquantized_autocast is False)."""
    configs: dict[str, dict] = {BF16_CONFIG: _config_doc(Recipe(BF16_CONFIG))}
    matchers: dict[str, dict] = {}

    def use(rec: Recipe) -> str:
        configs.setdefault(rec.key, _config_doc(rec))
        return rec.key

    by_kind: dict[str, dict[int, Recipe]] = defaultdict(dict)
    mtp: dict[str, Recipe] = {}
    for mod, rec in recipes.items():
        layer, kind = _split_layer(mod)
        if layer is None:
            mtp[mod] = rec
        elif layer in active:
            by_kind[kind][layer] = rec
    stage_of = {layer: (s, rng.start) for s, rng in enumerate(stages) for layer in rng}
    i = 0
    for mod, rec in sorted(mtp.items()):
        if rec.name != BF16_CONFIG:
            matchers[f"m{i:03d}_mtp"] = {"type": "glob", "pattern": mod, "config": use(rec), "enabled": True}
            i += 1
    exceptions, general = [], []
    for kind, per_layer in sorted(by_kind.items()):
        common = max(Counter(per_layer.values()).items(), key=lambda kv: (kv[1], kv[0].key))[0]
        local_want: dict[int, tuple[Recipe, int]] = {}
        for layer, rec in sorted(per_layer.items()):
            local = layer - stage_of[layer][1]
            prev = local_want.get(local)
            if prev is None:
                local_want[local] = (rec, layer)
            elif prev[0] != rec:
                s0, s1 = stage_of[prev[1]][0], stage_of[layer][0]
                probs.add(UnsupportedByBackend(
                    BACKEND, hf_of.get(f"decoder.layers.{layer}.{kind}", f"decoder.layers.{layer}.{kind}"),
                    f"layer-specific precision under pipeline parallelism: global layers {prev[1]} (PP stage {s0}) "
                    f"and {layer} (PP stage {s1}) are both decoder.layers.{local} on their stage, but the plan runs "
                    f"{prev[0].name} and {rec.name} there; megatron-core 0.16.1 matches --te-precision-config-file "
                    "globs on stage-local module paths and every rank gets the same file",
                    hint="make the rule the same on every stage (or layer-agnostic), or use a pp whose stages "
                         "repeat the layer pattern"))
        # a local index is forced to `common` on stages where it must be common but another stage wants an exception
        for local, (rec, layer) in sorted(local_want.items()):
            if rec == common:
                continue
            clash = [g for g, r in per_layer.items() if g - stage_of[g][1] == local and r != rec]
            if clash:
                continue  # reported above
            exceptions.append((f"decoder.layers.{local}.{kind}", rec))
        if common.name != BF16_CONFIG:
            general.append((f"decoder.layers.*.{kind}", common))
    for pattern, rec in exceptions + general:
        matchers[f"m{i:03d}"] = {"type": "glob", "pattern": pattern, "config": use(rec), "enabled": True}
        i += 1
    matchers["default_bf16"] = {"type": "glob", "pattern": "*", "config": BF16_CONFIG, "enabled": True}
    return {"configs": configs, "matchers": matchers}


def trainer_config(plan: Plan, te_version: Optional[str] = None) -> TrainerConfig:
    """Flags, env and YAML that make Megatron run the plan; every problem is collected and raised together.
    Memoized per plan object (check, emit and the Miles launch all ask for it)."""

    def compute():
        try:
            return _trainer_config(plan, te_version)
        except UnsupportedByBackend as err:
            return err

    res = plan.memo(f"megatron.trainer_config:{te_version}", compute)
    if isinstance(res, UnsupportedByBackend):
        raise res
    return res


def _trainer_config(plan: Plan, te_version: Optional[str]) -> TrainerConfig:
    probs = Problems()
    reqs: list = []
    recipes = _module_recipes(plan, probs)
    env = _env(plan, probs, reqs)
    side = plan.parallel.trainer if plan.parallel else None
    pp = side.pp if side else 1
    L = plan.num_layers
    stages = stage_ranges(L, pp)
    quant = {m: r for m, r in recipes.items() if r.name != BF16_CONFIG}
    flags: list[str] = ["--transformer-impl", "transformer_engine", "--bf16"]
    if any(".mlp.experts." in m for m in recipes):
        # The TE YAML names routed experts as one TEGroupedLinear (`mlp.experts.linear_fc1`); without grouped GEMM
        # Megatron builds SequentialMLP (`mlp.experts.local_experts.K.linear_fc1`) and the globs would not match.
        flags.append("--moe-grouped-gemm")
    flags += _high_precision_flags(plan, probs)
    if side is not None and (pp > 1 or side.tp > 1 or side.ep > 1 or side.etp > 1):
        flags += ["--tensor-model-parallel-size", str(side.tp), "--pipeline-model-parallel-size", str(side.pp),
                  "--expert-model-parallel-size", str(side.ep), "--expert-tensor-parallel-size", str(side.etp)]
        split = pipeline_split(L, pp)
        if split is not None:
            flags += ["--decoder-first-pipeline-num-layers", str(split[0]),
                      "--decoder-last-pipeline-num-layers", str(split[1])]
    notes: list[str] = []
    yamls: dict[str, dict] = {}
    start = end = 0
    if quant:
        counts = Counter(quant.values())
        mtp_q = sorted(m for m in quant if _split_layer(m)[0] is None)
        global_recipe = max(counts, key=lambda r: (counts[r], r.key))
        if mtp_q and global_recipe.name in _FP4_RECIPES:
            fp8 = [r for r in counts if r.name not in _FP4_RECIPES]
            if fp8:
                global_recipe = max(fp8, key=lambda r: (counts[r], r.key))
            else:
                t = next(t for t in plan.tensors if t.megatron_name and megatron_module(t.megatron_name) == mtp_q[0])
                probs.add(UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"quantized MTP layer ({quant[mtp_q[0]].name}) under an FP4 trainer: megatron-core 0.16.1 opens "
                    "a quantized autocast for the MTP layer only when config.fp8 is set (multi_token_prediction.py: "
                    "'currently ignoring FP4 in MTP layers'), so it would run BF16",
                    hint="keep mtp bf16 (e.g. `mtp: bf16`), or quantize the MTP layer with an FP8 format"))
        if global_recipe.name in _FP4_RECIPES:
            flags += ["--fp4-format", "e2m1", "--fp4-recipe", global_recipe.name]
        else:
            flags += ["--fp8-format", global_recipe.fp8_format, "--fp8-recipe", global_recipe.name]
        start, end = _first_last(plan, recipes, pp)
        if start or end:
            flags += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                      "--num-layers-at-end-in-bf16", str(end)]
        # Param gather keeps TE weights in the low-precision format; it is global (cannot vary per module, and the
        # per-module YAML does not change param init - megatron/core/extensions/TransformerEngineMixedPrecision.md in
        # Megatron-LM core_v0.16.1), so only when the whole trainer is one recipe with no BF16 linears.
        if len(counts) == 1 and all(r == global_recipe for r in recipes.values()):
            flags += ["--fp4-param-gather" if global_recipe.name in _FP4_RECIPES else "--fp8-param-gather"]
        if len({r.name in _FP4_RECIPES for r in counts}) > 1:
            notes.append("FP8 and FP4 modules mixed: the global flags carry one recipe and the TE per-module config "
                         "switches the others (Megatron forbids --fp8-format with --fp4-format)")
        hf_of: dict[str, str] = {}
        for t in plan.tensors:
            if t.is_linear and t.megatron_name and t.layer is not None:
                hf_of.setdefault(megatron_module(t.megatron_name), t.hf_name)
        yamls[TE_YAML] = _te_yaml(recipes, stages, range(start, L - end), probs, hf_of)
        flags += ["--te-precision-config-file", TE_YAML]
        reqs.append(versions.requirement("mcore.te_precision_config"))
    for r in versions.missing(reqs, "transformer-engine", te_version):
        probs.add(UnsupportedByBackend(BACKEND, "*", f"needs {r.text}, but --te-version is {te_version}",
                                       hint=f"install transformer-engine>={r.version}, or change the policy so it "
                                            "does not need this capability"))
    probs.raise_if_any()
    cfg = TrainerConfig(flags=flags, env=env, module_recipes=recipes, yamls=yamls, first_last=(start, end),
                        stages=stages, requires=sorted(set(reqs), key=lambda r: (r.engine, r.capability)),
                        notes=notes)
    _self_check(plan, cfg, pp)
    return cfg


def _self_check(plan: Plan, cfg: TrainerConfig, pp: int) -> None:
    """Resolve every module through the emitted artifacts with the same first-match glob semantics as
    megatron-core and compare with the intended recipe (cheap; no megatron import)."""
    derived = resolve_modules(cfg.flags, cfg.yamls, list(cfg.module_recipes), plan.num_layers, pp,
                              use_megatron=False)
    for mod, rec in cfg.module_recipes.items():
        want = RECIPE_KIND.get(rec.name, "bf16")
        if derived[mod] != want:  # pragma: no cover - a generator bug, not a user error
            raise AssertionError(f"megatron emitter self-check: {mod} resolves to {derived[mod]}, plan says {want}")


def emit(plan: Plan, te_version: Optional[str] = None) -> list[Artifact]:
    import shlex

    import yaml

    cfg = trainer_config(plan, te_version)
    stamp = plan_stamp(plan)
    header = (f"# policyc {stamp['content_hash']} ({plan.policy_name} on {plan.model}); "
              f"{versions.header(cfg.requires)}\n")
    env_sh = (header + "".join(f"export {k}={shlex.quote(v)}\n" for k, v in sorted(cfg.env.items()))
              + "# TE's defaults are the exact behaviour; a value left in the environment would not be\n"
              + f"unset {' '.join(UNSET_ENV)}\n")
    arts = [Artifact("megatron/args.txt", argv_file(cfg.flags),
                     "Megatron-LM argv fragment: pretrain_gpt.py $(cat args.txt)"),
            Artifact("megatron/flags.json", dump_json({"policyc": stamp, "flags": cfg.flags, "env": cfg.env,
                                                       "unset_env": list(UNSET_ENV),
                                                       "first_last_layers_bf16": list(cfg.first_last),
                                                       "pipeline_stages": [[r.start, r.stop] for r in cfg.stages],
                                                       "te_precision_files": sorted(cfg.yamls),
                                                       "requires": {"transformer-engine": cfg.te_minimum,
                                                                    "megatron-core": cfg.mcore_minimum,
                                                                    "capabilities": [r.text for r in cfg.requires]},
                                                       "notes": cfg.notes}), "flags + env (machine readable)"),
            Artifact("megatron/env.sh", env_sh, "TransformerEngine environment")]
    for name, doc in sorted(cfg.yamls.items()):
        arts.append(Artifact(f"megatron/{name}", header + yaml.safe_dump(doc, sort_keys=False),
                             "--te-precision-config-file (one file for every pipeline rank)"))
    return arts


def read_args(text: str) -> list[str]:
    """The argv of an emitted megatron/args.txt (`#` lines are skipped: files emitted before it was bare argv)."""
    return " ".join(line for line in text.splitlines() if not line.lstrip().startswith("#")).split()


# ---------------------------------------------------------------------------------------------------------------
# derivation (artifact -> formats), with megatron-core's own loader when installed
# ---------------------------------------------------------------------------------------------------------------
def _flag(flags: list[str], name: str) -> Optional[str]:
    return flags[flags.index(name) + 1] if name in flags else None


def flag_stages(flags: list[str], num_layers: int) -> list[range]:
    """Global decoder layers per PP rank as the emitted flags lay them out."""
    pp = int(_flag(flags, "--pipeline-model-parallel-size") or 1)
    first, last = _flag(flags, "--decoder-first-pipeline-num-layers"), _flag(flags, "--decoder-last-pipeline-num-layers")
    if first is None and last is None:
        per = num_layers // pp
        return [range(s * per, (s + 1) * per) for s in range(pp)]
    f, la = int(first or 0), int(last or 0)
    n_mid = pp - (first is not None) - (last is not None)
    mid = (num_layers - f - la) // n_mid if n_mid else 0
    out, pos = [], 0
    for s in range(pp):
        n = f if (s == 0 and first is not None) else la if (s == pp - 1 and last is not None) else mid
        out.append(range(pos, pos + n))
        pos += n
    return out


def resolve_modules(flags: list[str], yamls: dict[str, dict], modules: list[str], num_layers: int, pp: int = 1,
                    use_megatron: bool = True) -> dict[str, str]:
    """{global module path: weight kind} as Megatron+TE would run it given the emitted flags and YAML.
    With use_megatron, matching/parsing goes through megatron.core.quantization (RecipeConfig.from_config_dict,
    get_quant_config_or_none) and TEQuantizationParams.parse_from_config."""
    return {m: r.kind for m, r in explain_modules(flags, yamls, modules, num_layers, use_megatron).items()}


@dataclass(frozen=True)
class ModuleReading:
    """What megatron-core 0.16.1 + TE run for one TE module, and which flag / matcher decided it."""

    kind: str  # bf16 | mxfp8 | fp8_block | fp8 | nvfp4
    fp8_format: Optional[str]  # e4m3 | hybrid (the recipe's, for FP8 recipes)
    why: str


def _matcher_of(doc: dict, local: str) -> Optional[tuple[str, dict]]:
    """(matcher name, its config's training_recipe) of the first enabled glob matching `local` (megatron-core's
    first-match rule; megatron/core/quantization/quant_config.py: a matcher without `enabled` is off)."""
    import fnmatch

    for name, m in (doc.get("matchers") or {}).items():
        if isinstance(m, dict) and m.get("enabled", False) and fnmatch.fnmatch(local, str(m.get("pattern"))):
            cfg = (doc.get("configs") or {}).get(m.get("config")) or {}
            return f"{name} '{m.get('pattern')}'", dict(cfg.get("training_recipe") or {})
    return None


def explain_modules(flags: list[str], yamls: dict[str, dict], modules: list[str], num_layers: int,
                    use_megatron: bool = True) -> dict[str, ModuleReading]:
    """{global module path: ModuleReading}: the one reading of the trainer's flags + TE YAML (resolve_modules and
    the audit of a deployment both use it). Layers are matched on their stage-local paths (--pipeline-model-parallel
    -size, --decoder-first/last-pipeline-num-layers), first/last BF16 layers and MTP under FP4 get no quantized
    autocast (override_nonquantized_autocast is False in what policyc reads)."""
    g_fp8 = _flag(flags, "--fp8-recipe") if "--fp8-format" in flags else None
    g_fp4 = _flag(flags, "--fp4-recipe") if "--fp4-format" in flags else None
    g_fmt = _flag(flags, "--fp8-format") if g_fp8 else None
    global_kind = RECIPE_KIND[g_fp8] if g_fp8 else (RECIPE_KIND[g_fp4] if g_fp4 else "bf16")
    global_why = (f"--fp8-format {g_fmt} --fp8-recipe {g_fp8}" if g_fp8 else
                  f"--fp4-format {_flag(flags, '--fp4-format')} --fp4-recipe {g_fp4}" if g_fp4 else
                  "no --fp8-format / --fp4-format (BF16 trainer)")
    first_last = "--first-last-layers-bf16" in flags
    start = int(_flag(flags, "--num-layers-at-start-in-bf16") or 1) if first_last else 0
    end = int(_flag(flags, "--num-layers-at-end-in-bf16") or 1) if first_last else 0
    offset = {layer: rng.start for rng in flag_stages(flags, num_layers) for layer in rng}
    doc = yamls.get(TE_YAML) if TE_YAML in yamls else next(iter(yamls.values()), None)
    recipe = None
    if doc is not None and use_megatron:
        from megatron.core.quantization.quant_config import RecipeConfig

        recipe = RecipeConfig.from_config_dict(doc)
    out: dict[str, ModuleReading] = {}
    for mod in modules:
        layer, kind = _split_layer(mod)
        if global_kind == "bf16":
            out[mod] = ModuleReading("bf16", None, global_why)
            continue
        if layer is None and g_fp8 is None:
            out[mod] = ModuleReading("bf16", None, f"MTP layer under {global_why}: megatron-core 0.16.1 opens a "
                                     "quantized autocast for MTP only under an FP8 recipe (multi_token_prediction.py)")
            continue
        if layer is not None and (layer < start or layer >= num_layers - end):
            out[mod] = ModuleReading("bf16", None, f"layer {layer} is in --first-last-layers-bf16 "
                                     f"(--num-layers-at-start-in-bf16 {start}, --num-layers-at-end-in-bf16 {end})")
            continue
        local = f"decoder.layers.{layer - offset[layer]}.{kind}" if layer is not None else mod
        stage = f" (stage-local {local})" if local != mod else ""
        found = _matcher_of(doc, local) if doc is not None else None
        if doc is None or found is None:
            out[mod] = ModuleReading(global_kind, g_fmt, global_why + ("" if doc is None else
                                                                        f"; no TE YAML matcher{stage}"))
            continue
        matcher, tr = found
        if use_megatron:
            from megatron.core.extensions.transformer_engine import TEQuantizationParams
            from megatron.core.quantization.utils import get_quant_config_or_none

            qc = get_quant_config_or_none(local, recipe)
            if qc is None:
                out[mod] = ModuleReading(global_kind, g_fmt, global_why)
                continue
            r = TEQuantizationParams.parse_from_config(qc).training_recipe
            if not r.override_quantized_autocast:
                out[mod] = ModuleReading(global_kind, g_fmt, f"{global_why} (TE YAML matcher {matcher} does not "
                                         "override a quantized autocast)")
                continue
            name = r.fp8_quantization_recipe or r.fp4_quantization_recipe
            name = getattr(name, "value", name)
            fmt = getattr(r.fp8_format, "value", r.fp8_format) if r.fp8_quantization_recipe else None
        else:
            name = tr.get("fp8_quantization_recipe") or tr.get("fp4_quantization_recipe")
            fmt = tr.get("fp8_format", "e4m3") if tr.get("fp8_quantization_recipe") else None
        k = RECIPE_KIND[str(name)] if name else "bf16"
        out[mod] = ModuleReading(k, str(fmt).lower() if fmt and k != "bf16" else None,
                                 f"TE YAML matcher {matcher}{stage} -> {name or 'bf16'}")
    return out


def derive_kinds(flags: list[str], yamls: dict[str, dict], arch, pp: int = 1,
                 use_megatron: bool = True) -> dict[str, str]:
    """{hf_name: kind} the trainer runs, derived from the emitted flags + YAML for the architecture's tensors
    (independent of the plan). Non-TE tensors are bf16. `MegatronBackend.derive_formats` adds the format fields."""
    modules = {t.hf_name: megatron_module(t.megatron_name) for t in arch.tensors
               if t.is_linear and t.megatron_name and (t.megatron_name.startswith("decoder.")
                                                       or t.megatron_name.startswith("mtp."))
               and t.role != "mtp.eh_proj"}
    resolved = resolve_modules(flags, yamls, sorted(set(modules.values())), arch.num_layers, pp,
                               use_megatron=use_megatron)
    return {t.hf_name: resolved.get(modules.get(t.hf_name, ""), "bf16") for t in arch.tensors}


def _derived_weight(kind: str, env: dict, fused: bool) -> str:
    return _TE_FORMATS[FormatKind(kind)].derived(env, fused)


@dataclass(frozen=True)
class TrainerTensor:
    """What the trainer computes for one HF tensor: the weight format (derive_formats' answer) and, for a quantized
    linear, the activation scale scope, the backward mode and the FP8 format as TE reads its process-wide env."""

    kind: str  # bf16 | mxfp8 | fp8_block | fp8 | nvfp4
    weight: str  # TensorFormat.short() of the weight
    why: tuple[str, ...]  # the flags / matchers / env variables that decided it
    fp8_format: Optional[str] = None  # e4m3 | hybrid (FP8 recipes)
    backward: str = "high_precision"  # quantized | high_precision | dequantized
    act_scope: Optional[str] = None  # NVFP4 activation second-level scale: tensor | row (per token)
    weight_block: Optional[tuple[int, int]] = None
    scale_dtype: Optional[str] = None  # FP8-block scales: fp32 | pow2
    shared: bool = False  # one global scale over the fused module's members (TE: one amax per TE weight)


def _env_backward(env: dict) -> tuple[str, str]:
    v = env.get("NVTE_BACKWARD_OVERRIDE")
    if v in ("high_precision", "dequantized"):
        return v, f"NVTE_BACKWARD_OVERRIDE={v}"
    return "quantized", ("NVTE_BACKWARD_OVERRIDE unset: TE runs the recipe's quantized wgrad/dgrad GEMMs" if v is None
                         else f"NVTE_BACKWARD_OVERRIDE={v!r} is no TE mode: the quantized backward stays")


def trainer_tensors(flags: list[str], yamls: dict[str, dict], env: dict, arch, use_megatron: bool = True,
                    extra_hf: tuple = (), extra_megatron: tuple = ()) -> dict[str, TrainerTensor]:
    """{hf_name: TrainerTensor}: the trainer's side of a deployment from Megatron flags, the TE YAML and the TE env
    (emitted, or hand-written as a Miles launch gives them). The same reading as `derive_formats` (explain_modules
    + the format table's `derived`), plus what TE decides from the env. `extra_hf` / `extra_megatron`: Miles'
    --extra-high-precision-layers-hf / -megatron substrings (miles/utils/arguments.py): its Megatron-to-HF export
    sends those weights in BF16 whatever Megatron ran, so the published weight is BF16."""
    modules = {t.hf_name: megatron_module(t.megatron_name) for t in arch.tensors
               if t.is_linear and t.megatron_name and t.megatron_name.startswith(("decoder.", "mtp."))
               and t.role != "mtp.eh_proj"}
    read = explain_modules(flags, yamls, sorted(set(modules.values())), arch.num_layers, use_megatron=use_megatron)
    fused = fused_module_sizes(arch)
    bwd, bwd_why = _env_backward(env)
    out: dict[str, TrainerTensor] = {}
    for t in arch.tensors:
        mod = modules.get(t.hf_name)
        if mod is None:
            why = ("not a TransformerEngine module in megatron-core 0.16 (runs BF16)" if t.is_linear
                   else "not a GEMM weight")
            kind = "fp32" if t.role == "router.weight" and _flag(flags, "--moe-router-dtype") == "fp32" else "bf16"
            out[t.hf_name] = TrainerTensor(kind, kind, (why,) if kind == "bf16" else ("--moe-router-dtype fp32",))
            continue
        r = read[mod]
        hit = next((s for s in extra_hf if s and s in t.hf_name), None) or next(
            (s for s in extra_megatron if s and s in (t.megatron_name or "")), None)
        if hit is not None and r.kind != "bf16":
            flag = "hf" if hit in extra_hf else "megatron"
            out[t.hf_name] = TrainerTensor("bf16", "bf16", (f"--extra-high-precision-layers-{flag} {hit!r}: Miles "
                                                            "exports it in BF16",))
            continue
        if r.kind == "bf16":
            out[t.hf_name] = TrainerTensor("bf16", "bf16", (r.why,))
            continue
        is_fused = fused.get(t.hf_name, 1) > 1
        why = [r.why]
        if extra_hf or extra_megatron:
            why.append(f"no --extra-high-precision-layers-hf {list(extra_hf)} / -megatron {list(extra_megatron)} "
                       f"substring is in {t.hf_name} / {t.megatron_name}")
        fields: dict = {}
        if r.kind == "nvfp4":
            row = env.get("NVTE_NVFP4_ROW_SCALED_ACTIVATION") == "1"
            why.append("NVTE_NVFP4_ROW_SCALED_ACTIVATION=1: one FP32 activation scale per token" if row else
                       "NVTE_NVFP4_ROW_SCALED_ACTIVATION unset: TE keeps one per-tensor activation amax")
            fields = dict(act_scope="row" if row else "tensor", shared=is_fused,
                          weight_block=(16, 16) if env.get("NVTE_NVFP4_DISABLE_2D_QUANTIZATION") == "0" else (1, 16))
            for var in ("NVTE_NVFP4_DISABLE_RHT", "NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"):
                if env.get(var) != "1":
                    why.append(f"{var} unset: TE's NVFP4 gradients are not the exact formula")
        elif r.kind == "fp8_block":
            fp32 = env.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES") == "1"
            fields = dict(scale_dtype="fp32" if fp32 else "pow2")
            why.append("NVTE_FP8_BLOCK_SCALING_FP32_SCALES=1: fp32 scales" if fp32 else
                       "NVTE_FP8_BLOCK_SCALING_FP32_SCALES unset: TE's power-of-2 scales")
        why.append(bwd_why)
        out[t.hf_name] = TrainerTensor(r.kind, _derived_weight(r.kind, env, is_fused), tuple(why),
                                       fp8_format=r.fp8_format or "e4m3", backward=bwd, **fields)
    return out


@register_backend
class MegatronBackend(Backend):
    name = BACKEND
    role = "trainer"
    description = "Megatron-LM flags, TransformerEngine per-module precision YAML and NVTE_* env (trainer)"

    def artifacts(self, plan: Plan, options: EmitOptions) -> list[Artifact]:
        return emit(plan, te_version=options.te_version)

    def derive_formats(self, artifacts, arch) -> dict[str, str]:
        """The trainer's weight formats from megatron/flags.json (flags + env) and the TE YAML it names, resolved
        with megatron-core's own loader and glob matcher when megatron-core is installed (else the same first-match
        glob rule, reimplemented)."""
        import importlib.util

        import yaml

        doc = read_json_artifact(artifacts, "megatron/flags.json")
        flags, env = list(doc.get("flags") or []), dict(doc.get("env") or {})
        yamls = {}
        for name in doc.get("te_precision_files") or []:
            raw = artifacts.get(f"megatron/{name}")
            if raw is None:
                raise ArtifactError(f"artifact megatron/{name} (named by megatron/flags.json) is missing")
            try:
                yamls[name] = yaml.safe_load(raw)
            except yaml.YAMLError as err:
                raise ArtifactError(f"artifact megatron/{name} is not YAML: {str(err).splitlines()[0]}") from None
        pp = int(_flag(flags, "--pipeline-model-parallel-size") or 1)
        use_megatron = importlib.util.find_spec("megatron") is not None \
            and importlib.util.find_spec("megatron.core") is not None
        kinds = derive_kinds(flags, yamls, arch, pp=pp, use_megatron=use_megatron)
        fused = fused_module_sizes(arch)
        return {n: _derived_weight(k, env, fused.get(n, 1) > 1) for n, k in kinds.items()}
