"""Parsing of the `--parallel` option shared by `check`, `plan`, `emit` and `run --engine miles`.

Syntax (sides separated by whitespace or ';'; keys tp, etp, ep, pp; omitted keys default to 1, except the rollout
etp, which defaults to what SGLang derives from the launch args: moe_tp = tp / ep):

    trainer:tp=2,etp=1,ep=8,pp=2 rollout:tp=8,ep=8
    tp=4,ep=8                      # no side prefix: the same layout for trainer and rollout
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .arch.base import Architecture
from .errors import PolicycError
from .plan import ParallelLayout, ParallelSide

_KEYS = ("tp", "etp", "ep", "pp")
MAX_DEGREE = 65_536  # far above any real deployment; bounds every product the checks compute


class ParallelSpecError(PolicycError, ValueError):
    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _parse_side(text: str, where: str) -> ParallelSide:
    values: dict[str, int] = {}
    for item in filter(None, (p.strip() for p in text.split(","))):
        m = re.fullmatch(r"([a-z]+)\s*=\s*(\d+)", item)
        if not m:
            raise ParallelSpecError(f"cannot read '{item[:80]}' in the {where} layout",
                                    "write key=value pairs, e.g. tp=2,etp=1,ep=8,pp=2")
        if len(m.group(2)) > 7:  # before int(): a 5000-digit number is a ValueError in CPython, not a size
            raise ParallelSpecError(f"{m.group(1)} in the {where} layout is out of range (1..{MAX_DEGREE})")
        key, val = m.group(1), int(m.group(2))
        if key not in _KEYS:
            raise ParallelSpecError(f"unknown parallel dimension '{key}' in the {where} layout",
                                    f"known dimensions: {', '.join(_KEYS)}")
        if not 1 <= val <= MAX_DEGREE:
            raise ParallelSpecError(f"{key}={val} in the {where} layout is out of range (1..{MAX_DEGREE})")
        if key in values:
            raise ParallelSpecError(f"{key} given twice in the {where} layout")
        values[key] = val
    return ParallelSide(**values)


def parse_parallel(spec: str | None) -> ParallelLayout | None:
    if spec is None or not spec.strip():
        return None
    parts = [p for p in re.split(r"[\s;]+", spec.strip()) if p]
    explicit_rollout_etp = False
    sides: dict[str, ParallelSide] = {}
    for part in parts:
        if ":" in part:
            side, body = part.split(":", 1)
            side = side.strip().lower()
            if side not in ("trainer", "rollout"):
                raise ParallelSpecError(f"unknown side '{side}' in --parallel",
                                        "use trainer:... and/or rollout:...")
            if side in sides:
                raise ParallelSpecError(f"side '{side}' given twice in --parallel")
            sides[side] = _parse_side(body, side)
            explicit_rollout_etp |= side == "rollout" and re.search(r"(^|,)\s*etp\s*=", body) is not None
        else:
            if sides:
                raise ParallelSpecError(f"'{part}' has no side prefix", "prefix each part with trainer: or rollout:")
            both = _parse_side(part, "trainer/rollout")
            sides = {"trainer": both, "rollout": both}
            explicit_rollout_etp = re.search(r"(^|,)\s*etp\s*=", part) is not None
    rollout = sides.get("rollout", ParallelSide())
    if not explicit_rollout_etp and rollout.ep and rollout.tp % rollout.ep == 0:
        # SGLang has no expert-TP flag: it derives moe_tp_size = tp // ep (// moe_dp); an omitted rollout etp is that
        rollout = rollout.model_copy(update={"etp": rollout.tp // rollout.ep})
    return ParallelLayout(trainer=sides.get("trainer", ParallelSide()), rollout=rollout)


def format_parallel(layout: ParallelLayout) -> str:
    def side(s: ParallelSide) -> str:
        return ",".join(f"{k}={getattr(s, k)}" for k in _KEYS)

    return f"trainer:{side(layout.trainer)} rollout:{side(layout.rollout)}"


# ---- what the engines refuse -----------------------------------------------------------------------------------------
# Divisibility rules of a layout against the model's shapes, each where the engine enforces it. A layout an engine
# refuses at start-up (an assert or ValueError while it builds the model) is refused here first, by the rule's name.
# Vocabulary sizes are not a rule: both engines pad the embedding / lm_head to a multiple of tp.


@dataclass(frozen=True)
class LayoutViolation:
    side: str  # "trainer" (Megatron) | "rollout" (SGLang)
    rule: str  # stable name, e.g. "heads % tp"
    message: str
    hint: str


def _model_sizes(arch: Architecture) -> dict[str, object]:
    """The sizes the engines split: heads, query groups, layers, experts and the FFN widths (the K of each down
    projection: the dense MLP's intermediate, the routed experts' and the shared experts')."""
    c = arch.config
    heads = c.get("num_attention_heads")
    widths: dict[str, set[int]] = {"mlp.down": set(), "routed_experts.down": set(), "shared_experts.down": set()}
    for t in arch.tensors:
        if t.role in widths and len(t.shape) >= 2 and t.mtp is None:
            widths[t.role].add(int(t.shape[-1]))
    return {"heads": int(heads) if isinstance(heads, int) else None,
            "kv_heads": c.get("num_key_value_heads") if isinstance(c.get("num_key_value_heads"), int) else heads,
            "mla": "kv_lora_rank" in c, "layers": arch.num_layers, "experts": arch.num_experts, **widths}


def _divides(side: str, rule: str, size: int, what: str, degree: int, name: str, where: str, hint: str) -> list:
    if degree <= 1 or size % degree == 0:
        return []
    return [LayoutViolation(side, rule, f"{side} {name}={degree} does not divide {what} ({size}); {where}", hint)]


def trainer_violations(arch: Architecture, side: ParallelSide) -> list[LayoutViolation]:
    """megatron-core 0.16.1's rules (the file and check named in each message)."""
    m = _model_sizes(arch)
    out: list[LayoutViolation] = []
    hint_tp = "choose a trainer tp that divides it"
    if m["heads"]:
        out += _divides("trainer", "heads % tp", m["heads"], "num_attention_heads", side.tp, "tp",
                        "megatron-core 0.16.1 transformer_config.py TransformerConfig.__post_init__ refuses it",
                        hint_tp)
        g = m["kv_heads"]
        if isinstance(g, int) and g and not m["mla"] and side.tp > 1 and g % side.tp and side.tp % g:
            out.append(LayoutViolation(
                "trainer", "query groups % tp",
                f"trainer tp={side.tp} is neither a divisor nor a multiple of num_key_value_heads ({g}); megatron-core "
                "0.16.1 transformer_config.py TransformerConfig.__post_init__ requires num_query_groups % tp == 0 or "
                "tp % num_query_groups == 0", "choose a trainer tp that divides the KV heads, or a multiple of them"))
    for size in sorted(m["mlp.down"]) + sorted(m["shared_experts.down"]):
        out += _divides("trainer", "ffn % tp", size, "the MLP intermediate size", side.tp, "tp",
                        "megatron-core 0.16.1 extensions/transformer_engine.py TERowParallelLinear divides "
                        "linear_fc2's input by tp", hint_tp)
    if m["experts"]:
        out += _divides("trainer", "experts % ep", m["experts"], "the routed experts", side.ep, "ep",
                        "megatron-core 0.16.1 transformer/moe/moe_layer.py BaseMoELayer asserts "
                        "num_moe_experts % ep_size == 0", "choose a trainer ep that divides the expert count")
        for size in sorted(m["routed_experts.down"]):
            out += _divides("trainer", "moe ffn % etp", size, "the expert intermediate size", side.etp, "etp",
                            "megatron-core 0.16.1 extensions/transformer_engine.py TEGroupedLinear divides the "
                            "expert linear_fc1 / linear_fc2 by the expert-TP size", "choose a trainer etp that divides it")
    if side.pp > arch.num_layers:
        out.append(LayoutViolation(
            "trainer", "layers >= pp",
            f"trainer pp={side.pp} exceeds the {arch.num_layers} decoder layers: a pipeline stage would hold no layer "
            "(megatron-core 0.16.1 transformer_config.py TransformerConfig.__post_init__ refuses an empty stage of an "
            "uneven split; a pp that does not divide the layers is laid out with --decoder-first/last-pipeline-"
            "num-layers)", f"choose a trainer pp of at most {arch.num_layers}"))
    return out


def rollout_violations(arch: Architecture, side: ParallelSide) -> list[LayoutViolation]:
    """SGLang 0.5.23's rules (moe_tp = tp / ep is check_rollout_etp's)."""
    m = _model_sizes(arch)
    out: list[LayoutViolation] = []
    hint_tp = "choose a rollout tp that divides it"
    if m["heads"]:
        out += _divides("rollout", "heads % tp", m["heads"], "num_attention_heads", side.tp, "tp",
                        "SGLang 0.5.23 asserts it when it builds the attention (srt/layers/linear.py QKVParallelLinear, "
                        "srt/models/qwen3_moe.py Qwen3MoeAttention)", hint_tp)
        g = m["kv_heads"]
        if isinstance(g, int) and g and not m["mla"] and side.tp > 1 and g % side.tp and side.tp % g:
            out.append(LayoutViolation(
                "rollout", "kv heads % tp",
                f"rollout tp={side.tp} neither divides num_key_value_heads ({g}) nor is a multiple of it (to replicate "
                "them); SGLang 0.5.23 srt/layers/linear.py QKVParallelLinear (and srt/models/qwen3_moe.py "
                "Qwen3MoeAttention) assert one or the other",
                "choose a rollout tp that divides the KV heads, or a multiple of them"))
    for size in sorted(m["mlp.down"]):
        out += _divides("rollout", "ffn % tp", size, "the MLP intermediate size", side.tp, "tp",
                        "SGLang 0.5.23 srt/layers/linear.py RowParallelLinear divides down_proj's input by tp", hint_tp)
    if m["experts"]:
        out += _divides("rollout", "experts % ep", m["experts"], "the routed experts", side.ep, "ep",
                        "SGLang 0.5.23 srt/layers/moe/fused_moe_triton/layer.py FusedMoE asserts "
                        "num_experts % ep_size == 0", "choose a rollout ep that divides the expert count")
        for size in sorted(m["routed_experts.down"]):
            out += _divides("rollout", "moe ffn % moe_tp", size, "the expert intermediate size", side.etp,
                            "moe_tp (tp / ep)", "SGLang 0.5.23 srt/layers/moe/fused_moe_triton/layer.py FusedMoE "
                            "asserts intermediate_size % moe_tp_size == 0", "choose a rollout tp / ep that divides it")
    return out


def layout_violations(arch: Architecture, layout: ParallelLayout) -> list[LayoutViolation]:
    """Every rule the layout breaks on either side (empty when both engines accept it)."""
    return trainer_violations(arch, layout.trainer) + rollout_violations(arch, layout.rollout)
