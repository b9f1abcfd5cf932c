"""Megatron-core (>= 0.16) + TransformerEngine (>= 2.14) trainer backend.

Emits, for one plan:
  * global flags: --fp8-format/--fp8-recipe (tensorwise|blockwise|mxfp8), --fp4-format e2m1/--fp4-recipe nvfp4,
    --first-last-layers-bf16 --num-layers-at-start-in-bf16 N --num-layers-at-end-in-bf16 M (always explicit:
    Megatron's defaults are 1/1), --fp8-param-gather / --fp4-param-gather when the whole trainer is one format;
  * a per-module `--te-precision-config-file` YAML (TEQuantizationParams configs + ordered glob matchers on
    Megatron module names, first match wins; megatron/core/quantization/quant_config.py). Matchers only override
    modules whose autocast is already quantized (override_quantized_autocast=True, override_nonquantized=False),
    so first/last BF16 layers stay BF16 whatever the matchers say. Module layer indices are LOCAL to a pipeline
    stage: a layer-agnostic YAML is emitted when every module kind has one recipe outside the first/last BF16
    layers; otherwise one YAML per PP stage with explicit local indices;
  * TE env vars: NVTE_BACKWARD_OVERRIDE (high_precision|dequantized), NVFP4 1x16 weights / no RHT / no stochastic
    rounding / row-scaled (per-token) activations, NVTE_FP8_BLOCK_SCALING_FP32_SCALES, NVTE_USE_FAST_MATH=0.

Exactness rules (raise UnsupportedByBackend otherwise):
  * a TE recipe quantizes both GEMM inputs with one format -> weight and activation kinds must match;
  * fused Megatron modules (linear_qkv = q,k,v; linear_fc1 = gate,up; TEGroupedLinear = all routed experts of a
    layer) run one recipe -> all their HF tensors need one precision;
  * NVFP4: TE takes the amax of the whole TE weight (fc1 = [gate; up] of one expert) per TP shard -> the plan's
    global scale must be a share-scale group equal to the fused members, and that dim must not be TP-split;
  * env vars are process-wide -> one backward mode, one NVFP4 activation scope, one FP8-block scale dtype;
  * embedding / output_layer are not TE modules in megatron-core 0.16 -> cannot be quantized.

Public API:
  trainer_config(plan) -> TrainerConfig
  emit(plan) -> list[Artifact]   # megatron/args.txt, megatron/flags.json, megatron/env.sh,
                                 # megatron/te_precision.yaml or megatron/te_precision.stage{S}.yaml
  derive_formats(flags, yamls, arch, pp) -> {hf_name: kind}   # uses megatron-core's own loader when available
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

from ..plan import Plan, TensorPlan
from ..precision import BackwardMode, FormatKind, Precision

from .common import Artifact, UnsupportedByBackend, dump_json, plan_stamp

BACKEND = "megatron"
BF16_CONFIG = "bf16"

# TE recipe name -> the plan's weight kind it produces.
RECIPE_KIND = {"mxfp8": "mxfp8", "blockwise": "fp8_block", "tensorwise": "fp8", "nvfp4": "nvfp4"}
_FP4_RECIPES = {"nvfp4"}
_LAYER_RE = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


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
    yamls: dict[str, dict]  # file name -> YAML document (one, or one per PP stage)
    per_stage: bool
    first_last: tuple[int, int]  # (start, end) BF16 layer counts, (0, 0) when the flag is not used
    notes: list[str] = field(default_factory=list)


def megatron_module(megatron_name: str) -> str:
    """Module path of a Megatron parameter name: drop `.weight`, `.weight17`, `.bias`, `.layer_norm_weight`."""
    return megatron_name.rsplit(".", 1)[0]


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
    if w.kind == FormatKind.MXFP8:
        if w.block != (1, 32) or a.block != (1, 32) or w.element != "e4m3":
            raise UnsupportedByBackend(BACKEND, t.hf_name, f"TE MXFP8BlockScaling is 1x32 e4m3 forward; plan says "
                                                           f"W {w.short()} A {a.short()}")
        return Recipe("mxfp8", fmt)
    if w.kind == FormatKind.FP8_BLOCK:
        if w.block != (128, 128) or a.block != (1, 128):
            raise UnsupportedByBackend(BACKEND, t.hf_name, "TE Float8BlockScaling is 128x128 weights / 1x128 "
                                                           f"activations; plan says W {w.block} A {a.block}")
        return Recipe("blockwise", fmt)
    if w.kind == FormatKind.FP8:
        return Recipe("tensorwise", fmt)
    if w.kind == FormatKind.NVFP4:
        if quant_bwd:
            raise UnsupportedByBackend(BACKEND, t.hf_name, "quantized NVFP4 backward (TE's NVFP4 gradients use RHT "
                                                           "and stochastic rounding, which policyc turns off)")
        if w.block not in ((1, 16), (16, 16)) or a.block != (1, 16):
            raise UnsupportedByBackend(BACKEND, t.hf_name, f"TE NVFP4 is 1x16 (or 16x16 weights); plan says "
                                                           f"W {w.block} A {a.block}")
        if w.global_scale not in (None, "tensor", "group"):
            raise UnsupportedByBackend(BACKEND, t.hf_name, f"'{w.global_scale}' weight global scale: TE keeps one "
                                                           "amax per weight tensor")
        if a.global_scale not in (None, "tensor", "row"):
            raise UnsupportedByBackend(BACKEND, t.hf_name, f"'{a.global_scale}' activation global scale: TE supports "
                                                           "per-tensor or row-scaled (per-token) activations")
        return Recipe("nvfp4")
    raise UnsupportedByBackend(BACKEND, t.hf_name, f"no TE recipe for {w.short()}")


def _module_tensors(plan: Plan) -> dict[str, list[TensorPlan]]:
    mods: dict[str, list[TensorPlan]] = defaultdict(list)
    for t in plan.tensors:
        if not t.is_linear:
            continue
        if t.megatron_name is None or not t.megatron_name.startswith(("decoder.", "mtp.")):
            if t.precision.is_quantized:
                raise UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"quantized {t.role}: {t.megatron_name or 'this tensor'} is not a TransformerEngine module in "
                    "megatron-core 0.16 (fp8_output_proj exists only in Megatron HEAD)")
            continue
        if t.role == "mtp.eh_proj" and t.precision.is_quantized:
            raise UnsupportedByBackend(BACKEND, t.hf_name, "quantized MTP eh_proj: its autocast scope in "
                                                           "megatron-core 0.16 is not the MTP layer's (unverified)")
        mods[megatron_module(t.megatron_name)].append(t)
    return mods


def _check_nvfp4_scope(module: str, members: list[TensorPlan], plan: Plan, groups: dict) -> None:
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
            raise UnsupportedByBackend(BACKEND, ts[0].hf_name,
                                       f"NVFP4 per-tensor weight scale under {'expert ' if expert else ''}TP={tp}: TE "
                                       "computes the amax per TP shard, so the trainer's global scale would differ "
                                       "from the checkpoint's",
                                       hint=f"use {'etp' if expert else 'tp'}=1 for NVFP4 modules")
        if len(ts) == 1:
            continue
        names = {t.hf_name for t in ts}
        g = groups.get(ts[0].hf_name)
        if g is None or set(g.members) != names:
            raise UnsupportedByBackend(
                BACKEND, ts[0].hf_name,
                f"separate NVFP4 global scales for {', '.join(sorted(t.megatron_part or '?' for t in ts))}: TE "
                f"computes one amax over the fused weight {pname}",
                hint="declare a share-scale group over the fused siblings (e.g. share_scale(gate, up))")


def _module_recipes(plan: Plan) -> dict[str, Recipe]:
    out: dict[str, Recipe] = {}
    groups = None
    for module, members in _module_tensors(plan).items():
        first = members[0]
        rec = _recipe_for(first)
        for t in members[1:]:
            if t.precision is not first.precision and t.precision != first.precision:
                what = ("all routed experts of a layer (TEGroupedLinear)" if ".experts." in module
                        else "the fused module")
                raise UnsupportedByBackend(
                    BACKEND, t.hf_name,
                    f"{what} {module} runs one TE recipe, but {first.hf_name} is {first.precision.short()} and "
                    f"this one is {t.precision.short()}",
                    hint="give every tensor of the fused Megatron module the same precision")
        if rec.name == "nvfp4":
            if groups is None:
                groups = {m: g for g in plan.share_scale_groups for m in g.members}
            _check_nvfp4_scope(module, members, plan, groups)
        out[module] = rec
    return out


def _uniform(plan: Plan, what: str, values: dict[str, object], capability: str) -> object:
    distinct = {v for v in values.values() if v is not None}
    if len(distinct) > 1:
        ref = next(iter(values.values()))
        odd = next(n for n, v in values.items() if v != ref)
        raise UnsupportedByBackend(BACKEND, odd, f"{capability}: the plan uses {sorted(map(str, distinct))} for "
                                                 f"{what}, but TE reads it from one process-wide env var")
    return next(iter(distinct), None)


def _env(plan: Plan, recipes: dict[str, Recipe]) -> dict[str, str]:
    quant = [t for t in plan.tensors if t.is_linear and t.precision.is_quantized]
    env: dict[str, str] = {}
    if not quant:
        return env
    bwd = _uniform(plan, "the backward mode", {t.hf_name: t.backward.value for t in quant},
                   "per-module backward mode")
    if bwd in ("high_precision", "dequantized"):
        env["NVTE_BACKWARD_OVERRIDE"] = str(bwd)
    env["NVTE_USE_FAST_MATH"] = "0"
    nv = [t for t in quant if t.weight.kind == FormatKind.NVFP4]
    if nv:
        act = _uniform(plan, "NVFP4 activation global scales", {t.hf_name: t.activation.global_scale or "tensor"
                                                                 for t in nv}, "per-module NVFP4 activation scaling")
        w2d = _uniform(plan, "NVFP4 weight blocks", {t.hf_name: t.weight.block for t in nv}, "per-module NVFP4 2D")
        env["NVTE_NVFP4_DISABLE_2D_QUANTIZATION"] = "0" if w2d == (16, 16) else "1"
        env["NVTE_NVFP4_DISABLE_RHT"] = "1"
        env["NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING"] = "1"
        env["NVTE_NVFP4_ROW_SCALED_ACTIVATION"] = "1" if act == "row" else "0"
        env["NVTE_NVFP4_4OVER6"] = "none"
    fb = [t for t in quant if t.weight.kind == FormatKind.FP8_BLOCK]
    if fb:
        sd = _uniform(plan, "FP8-block scale dtypes",
                      {t.hf_name: (t.weight.scale_dtype or "fp32") for t in fb}
                      | {t.hf_name + " (activation)": (t.activation.scale_dtype or "fp32") for t in fb},
                      "per-module FP8-block scale dtype")
        # TE default is power-of-2 scales; =1 keeps exact fp32 scales (Hopper only: Blackwell emulates blockwise
        # with MXFP8 and requires pow2, quantizers.md §6.2).
        env["NVTE_FP8_BLOCK_SCALING_FP32_SCALES"] = "1" if sd == "fp32" else "0"
    return env


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
    cap = L // pp
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


def _matchers_for(modules: dict[str, Recipe], layer_offset: int, layer_range: range, global_recipe: Recipe,
                  layer_specific: bool) -> tuple[dict, dict]:
    """(configs, matchers) for the modules in `layer_range` (+ MTP modules when given). Layer indices in patterns
    are local (global - layer_offset)."""
    configs: dict[str, dict] = {BF16_CONFIG: _config_doc(Recipe(BF16_CONFIG))}
    matchers: dict[str, dict] = {}

    def use(rec: Recipe) -> str:
        configs.setdefault(rec.key, _config_doc(rec))
        return rec.key

    by_kind: dict[str, dict[int, Recipe]] = defaultdict(dict)
    mtp: dict[str, Recipe] = {}
    for mod, rec in modules.items():
        layer, kind = _split_layer(mod)
        if layer is None:
            mtp[mod] = rec
        elif layer in layer_range:
            by_kind[kind][layer] = rec
    i = 0
    for mod, rec in sorted(mtp.items()):
        if rec.name != BF16_CONFIG:
            matchers[f"m{i:03d}_mtp"] = {"type": "glob", "pattern": mod, "config": use(rec), "enabled": True}
            i += 1
    exceptions, general = [], []
    for kind, per_layer in sorted(by_kind.items()):
        common = Counter(r for r in per_layer.values()).most_common(1)[0][0]
        if layer_specific:
            for layer, rec in sorted(per_layer.items()):
                if rec != common:
                    exceptions.append((f"decoder.layers.{layer - layer_offset}.{kind}", rec))
        if common.name != BF16_CONFIG:
            general.append((f"decoder.layers.*.{kind}", common))
    for pattern, rec in exceptions + general:
        matchers[f"m{i:03d}"] = {"type": "glob", "pattern": pattern, "config": use(rec), "enabled": True}
        i += 1
    matchers["default_bf16"] = {"type": "glob", "pattern": "*", "config": BF16_CONFIG, "enabled": True}
    return configs, matchers


def trainer_config(plan: Plan) -> TrainerConfig:
    recipes = _module_recipes(plan)
    env = _env(plan, recipes)
    side = plan.parallel.trainer if plan.parallel else None
    pp = side.pp if side else 1
    L = plan.num_layers
    quant = {m: r for m, r in recipes.items() if r.name != BF16_CONFIG}
    flags: list[str] = ["--transformer-impl", "transformer_engine", "--bf16"]
    if any(".mlp.experts." in m for m in recipes):
        # The TE YAML names routed experts as one TEGroupedLinear (`mlp.experts.linear_fc1`); without grouped GEMM
        # Megatron builds SequentialMLP (`mlp.experts.local_experts.K.linear_fc1`) and the globs would not match.
        flags.append("--moe-grouped-gemm")
    notes: list[str] = []
    if not quant:
        return TrainerConfig(flags=flags, env=env, module_recipes=recipes, yamls={}, per_stage=False,
                             first_last=(0, 0))
    counts = Counter(r for r in quant.values())
    fp4 = [r for r in counts if r.name in _FP4_RECIPES]
    fp8 = [r for r in counts if r.name not in _FP4_RECIPES]
    global_recipe = max(counts, key=lambda r: (counts[r], r.key))
    if global_recipe.name in _FP4_RECIPES:
        flags += ["--fp4-format", "e2m1", "--fp4-recipe", global_recipe.name]
    else:
        flags += ["--fp8-format", global_recipe.fp8_format, "--fp8-recipe", global_recipe.name]
    start, end = _first_last(plan, recipes, pp)
    if start or end:
        flags += ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", str(start),
                  "--num-layers-at-end-in-bf16", str(end)]
    # Param gather keeps TE weights in the low-precision format; it is global (cannot vary per module, and the
    # per-module YAML does not change param init - TransformerEngineMixedPrecision.md), so only when the whole
    # trainer is one recipe with no BF16 linears.
    all_linear = [r for r in recipes.values()]
    if len(counts) == 1 and all(r == global_recipe for r in all_linear) and global_recipe.name in ("mxfp8",
                                                                                                   "blockwise",
                                                                                                   "tensorwise",
                                                                                                   "nvfp4"):
        flags += ["--fp4-param-gather" if global_recipe.name in _FP4_RECIPES else "--fp8-param-gather"]
    if fp4 and fp8:
        notes.append("FP8 and FP4 modules mixed: the global flags carry the majority recipe and the TE per-module "
                     "config switches the others (Megatron forbids --fp8-format with --fp4-format)")
    # Layer-agnostic iff every module kind has one recipe over the layers outside first/last BF16.
    active = range(start, L - end)
    kinds: dict[str, set] = defaultdict(set)
    for mod, r in recipes.items():
        layer, kind = _split_layer(mod)
        if layer is not None and layer in active:
            kinds[kind].add(r)
    per_stage = any(len(v) > 1 for v in kinds.values())
    if per_stage and L % pp:
        odd = next(k for k, v in kinds.items() if len(v) > 1)
        raise UnsupportedByBackend(BACKEND, f"decoder.layers.*.{odd}",
                                   f"layer-specific precision needs stage-local TE configs, and {L} layers do not "
                                   f"split evenly over pp={pp} (the stage boundaries are not known to policyc)",
                                   hint="use a pp that divides the layer count, or make the rule layer-agnostic")
    yamls: dict[str, dict] = {}
    if not per_stage:
        configs, matchers = _matchers_for(recipes, 0, active, global_recipe, layer_specific=False)
        yamls["te_precision.yaml"] = {"configs": configs, "matchers": matchers}
    else:
        lps = L // pp
        for s in range(pp):
            stage_layers = range(max(s * lps, start), min((s + 1) * lps, L - end))
            mods = {m: r for m, r in recipes.items()
                    if (_split_layer(m)[0] is None and s == pp - 1) or (_split_layer(m)[0] in stage_layers)}
            configs, matchers = _matchers_for(mods, s * lps, stage_layers, global_recipe, layer_specific=True)
            yamls[f"te_precision.stage{s}.yaml"] = {"configs": configs, "matchers": matchers}
        notes.append("layer-specific precision: PP rank s must get --te-precision-config-file "
                     "te_precision.stage{s}.yaml (module layer indices are stage-local in megatron-core)")
    flags += ["--te-precision-config-file",
              "te_precision.yaml" if not per_stage else "te_precision.stage{PP_RANK}.yaml"]
    if pp > 1 or (side and (side.tp > 1 or side.ep > 1)):
        flags += ["--tensor-model-parallel-size", str(side.tp), "--pipeline-model-parallel-size", str(side.pp),
                  "--expert-model-parallel-size", str(side.ep), "--expert-tensor-parallel-size", str(side.etp)]
    cfg = TrainerConfig(flags=flags, env=env, module_recipes=recipes, yamls=yamls, per_stage=per_stage,
                        first_last=(start, end), notes=notes)
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


def emit(plan: Plan) -> list[Artifact]:
    import yaml

    cfg = trainer_config(plan)
    stamp = plan_stamp(plan)
    header = f"# policyc {stamp['content_hash']} ({plan.policy_name} on {plan.model}); megatron-core>=0.16, TE>=2.14\n"
    arts = [Artifact("megatron/args.txt", " ".join(cfg.flags) + "\n", "Megatron-LM argv fragment"),
            Artifact("megatron/flags.json", dump_json({"policyc": stamp, "flags": cfg.flags, "env": cfg.env,
                                                       "first_last_layers_bf16": list(cfg.first_last),
                                                       "per_stage_te_config": cfg.per_stage,
                                                       "te_precision_files": sorted(cfg.yamls),
                                                       "notes": cfg.notes}), "flags + env (machine readable)"),
            Artifact("megatron/env.sh", header + "".join(f"export {k}={v}\n" for k, v in sorted(cfg.env.items())),
                     "TransformerEngine environment")]
    for name, doc in sorted(cfg.yamls.items()):
        arts.append(Artifact(f"megatron/{name}", header + yaml.safe_dump(doc, sort_keys=False),
                             "--te-precision-config-file"))
    return arts


# ---------------------------------------------------------------------------------------------------------------
# derivation (artifact -> formats), with megatron-core's own loader when installed
# ---------------------------------------------------------------------------------------------------------------
def _flag(flags: list[str], name: str) -> Optional[str]:
    return flags[flags.index(name) + 1] if name in flags else None


def resolve_modules(flags: list[str], yamls: dict[str, dict], modules: list[str], num_layers: int, pp: int,
                    use_megatron: bool = True) -> dict[str, str]:
    """{global module path: weight kind} as Megatron+TE would run it given the emitted flags and YAML(s).
    With use_megatron, matching/parsing goes through megatron.core.quantization (RecipeConfig.from_config_dict,
    get_quant_config_or_none) and TEQuantizationParams.parse_from_config."""
    g_fp8 = _flag(flags, "--fp8-recipe") if "--fp8-format" in flags else None
    g_fp4 = _flag(flags, "--fp4-recipe") if "--fp4-format" in flags else None
    global_kind = RECIPE_KIND[g_fp8] if g_fp8 else (RECIPE_KIND[g_fp4] if g_fp4 else "bf16")
    first_last = "--first-last-layers-bf16" in flags
    start = int(_flag(flags, "--num-layers-at-start-in-bf16") or 1) if first_last else 0
    end = int(_flag(flags, "--num-layers-at-end-in-bf16") or 1) if first_last else 0
    lps = num_layers // pp
    per_stage = any(".stage" in n for n in yamls)
    recipes = {}
    for name, doc in yamls.items():
        if use_megatron:
            from megatron.core.quantization.quant_config import RecipeConfig

            recipes[name] = RecipeConfig.from_config_dict(doc)
        else:
            recipes[name] = doc
    out: dict[str, str] = {}
    for mod in modules:
        if global_kind == "bf16":
            out[mod] = "bf16"
            continue
        layer, kind = _split_layer(mod)
        if layer is not None and (layer < start or layer >= num_layers - end):
            out[mod] = "bf16"  # no autocast; override_nonquantized_autocast is False
            continue
        stage = layer // lps if layer is not None else pp - 1
        local = f"decoder.layers.{layer - stage * lps}.{kind}" if layer is not None else mod
        fname = f"te_precision.stage{stage}.yaml" if per_stage else "te_precision.yaml"
        if fname not in yamls:
            out[mod] = global_kind
            continue
        if use_megatron:
            from megatron.core.extensions.transformer_engine import TEQuantizationParams
            from megatron.core.quantization.utils import get_quant_config_or_none

            qc = get_quant_config_or_none(local, recipes[fname])
            if qc is None:
                out[mod] = global_kind
                continue
            params = TEQuantizationParams.parse_from_config(qc)
            r = params.training_recipe
            if not r.override_quantized_autocast:
                out[mod] = global_kind
                continue
            name = r.fp8_quantization_recipe or r.fp4_quantization_recipe
            name = getattr(name, "value", name)
        else:
            import fnmatch

            name = None
            matched = False
            for m in recipes[fname]["matchers"].values():
                if m.get("enabled") and fnmatch.fnmatch(local, m["pattern"]):
                    tr = recipes[fname]["configs"][m["config"]]["training_recipe"]
                    name = tr.get("fp8_quantization_recipe") or tr.get("fp4_quantization_recipe")
                    matched = True
                    break
            if not matched:
                out[mod] = global_kind
                continue
        out[mod] = RECIPE_KIND[str(name)] if name else "bf16"
    return out


def derive_formats(flags: list[str], yamls: dict[str, dict], arch, pp: int = 1,
                   use_megatron: bool = True) -> dict[str, str]:
    """{hf_name: kind} the trainer runs, derived from the emitted flags + YAML(s) for the architecture's tensors
    (independent of the plan). Non-TE tensors are bf16."""
    modules = {t.hf_name: megatron_module(t.megatron_name) for t in arch.tensors
               if t.is_linear and t.megatron_name and (t.megatron_name.startswith("decoder.")
                                                       or t.megatron_name.startswith("mtp."))
               and t.role != "mtp.eh_proj"}
    resolved = resolve_modules(flags, yamls, sorted(set(modules.values())), arch.num_layers, pp,
                               use_megatron=use_megatron)
    return {t.hf_name: resolved.get(modules.get(t.hf_name, ""), "bf16") for t in arch.tensors}
