"""The supported model families and how a config.json is dispatched to one.

Dispatch reads what the checkpoint says it is: the HF `architectures` class names first (that is what transformers,
SGLang and vLLM instantiate: Kimi-K2 ships `"architectures": ["DeepseekV3ForCausalLM"]` with `"model_type":
"kimi_k2"`, and SGLang / Miles serve and train it as DeepSeek-V3), then `model_type`. A config naming neither a
supported class nor a supported model_type is refused with both named.

Each family lists the public models it covers and how its tensor names were proven (README "Supported models").
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import Any, Optional

from . import deepseek_v3, dense, glm4_moe, qwen3_moe
from .errors import ArchitectureError


@dataclass(frozen=True)
class Family:
    model_type: str  # the canonical HF model_type the adapter builds (also Architecture.model_type)
    adapter: ModuleType
    architectures: tuple[str, ...]  # HF architecture class names dispatched here
    aliases: tuple[str, ...]  # other model_type values of the same architecture (kimi_k2)
    example: str  # a bundled model (precision_dsl/models/<example>/config.json)
    models: str  # public models covered


FAMILIES: tuple[Family, ...] = (
    Family("deepseek_v3", deepseek_v3, ("DeepseekV3ForCausalLM",), ("kimi_k2",), "deepseek-v3",
           "DeepSeek-V3, DeepSeek-R1, DeepSeek-V3.1, Kimi-K2-Instruct, Kimi-K2-Thinking (bundled: deepseek-v3, "
           "kimi-k2)"),
    Family("deepseek_v2", deepseek_v3, ("DeepseekV2ForCausalLM",), (), "",
           "DeepSeek-V2, DeepSeek-V2-Lite"),
    Family("glm4_moe", glm4_moe, ("Glm4MoeForCausalLM",), (), "glm-4.5-air",
           "GLM-4.5, GLM-4.5-Air, GLM-4.6 (bundled: glm-4.5-air)"),
    Family("qwen3_moe", qwen3_moe, ("Qwen3MoeForCausalLM",), (), "qwen3-30b-a3b",
           "Qwen3-30B-A3B, Qwen3-235B-A22B (+ 2507 updates) (bundled: qwen3-30b-a3b, qwen3-235b-a22b)"),
    Family("qwen2_moe", qwen3_moe, ("Qwen2MoeForCausalLM",), (), "", "Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B"),
    Family("qwen3", dense, ("Qwen3ForCausalLM",), (), "qwen3-8b",
           "Qwen3-0.6B ... Qwen3-32B (bundled: qwen3-0.6b, qwen3-8b)"),
    Family("qwen2", dense, ("Qwen2ForCausalLM",), (), "", "Qwen2 / Qwen2.5 dense"),
    Family("llama", dense, ("LlamaForCausalLM",), (), "llama-3.2-1b", "Llama 2 / 3 / 3.1 / 3.2 (bundled: llama-3.2-1b)"),
    Family("mistral", dense, ("MistralForCausalLM",), (), "", "Mistral-7B"),
)

BY_ARCHITECTURE: dict[str, Family] = {a: f for f in FAMILIES for a in f.architectures}
BY_MODEL_TYPE: dict[str, Family] = {mt: f for f in FAMILIES for mt in (f.model_type, *f.aliases)}


def supported_model_types() -> list[str]:
    return sorted(BY_MODEL_TYPE)


def supported_architectures() -> list[str]:
    return sorted(BY_ARCHITECTURE)


def dispatch(raw: dict[str, Any], source: str) -> tuple[Family, Optional[str]]:
    """(family, the architecture class that chose it or None when model_type did)."""
    archs = raw.get("architectures")
    model_type = raw.get("model_type")
    if archs is not None and not (isinstance(archs, list) and all(isinstance(a, str) for a in archs)):
        raise ArchitectureError(f"{source}: field 'architectures' must be a list of class names, got {archs!r}",
                                hint='e.g. "architectures": ["DeepseekV3ForCausalLM"]')
    for a in archs or ():
        if a in BY_ARCHITECTURE:
            return BY_ARCHITECTURE[a], a
    if isinstance(model_type, str) and model_type in BY_MODEL_TYPE:
        return BY_MODEL_TYPE[model_type], None
    if archs is None and model_type is None:
        msg = "neither 'architectures' nor 'model_type' is set"
    elif model_type is not None and not isinstance(model_type, str):
        msg = f"field 'model_type' must be a string, got {model_type!r}"
    else:
        msg = f"unsupported model: architectures {archs!r}, model_type {model_type!r}"
    raise ArchitectureError(
        f"{source}: {msg}",
        hint=f"supported architectures: {', '.join(supported_architectures())}; "
             f"supported model types: {', '.join(supported_model_types())}",
    )


def apply_aliases(raw: dict[str, Any], adapter: ModuleType, source: str) -> dict[str, Any]:
    """Map attribute names transformers 5 writes (e.g. Qwen3-MoE `num_local_experts`) onto the public config.json
    names the adapter reads. Both present with different values is an error, not a silent pick."""
    aliases: dict[str, str] = getattr(adapter, "ALIASES", {})
    if not any(k in raw for k in aliases):
        return raw
    out = dict(raw)
    for new, old in aliases.items():
        if new not in raw:
            continue
        if old in raw and raw[old] != raw[new]:
            raise ArchitectureError(
                f"{source}: '{new}' ({raw[new]!r}) and '{old}' ({raw[old]!r}) disagree",
                hint=f"transformers 5 writes '{new}' for '{old}'; keep one of them",
            )
        out[old] = raw[new]
    return out
