"""Source precision: how a published checkpoint STORES each tensor, from its config.json `quantization_config`.

DeepSeek-V3 / R1 / V3.1 and Kimi-K2 ship FP8 block-quantized releases (deepseek-ai/DeepSeek-V3
`README_WEIGHTS.md`, `inference/fp8_cast_bf16.py`): `quantization_config = {quant_method: fp8, fmt: e4m3,
activation_scheme: dynamic, weight_block_size: [128, 128]}`; every decoder-layer linear `X` is `X.weight` float8_e4m3fn [N, K] plus
`X.weight_scale_inv` float32 [ceil(N/128), ceil(K/128)] (dequant multiplier). Embeddings, lm_head, norms, the router
(`mlp.gate`), its FP32 `e_score_correction_bias` and the MTP `eh_proj` / `shared_head.head` stay in torch_dtype and are
excluded by the model code, not by a list (the published Kimi-K2-Instruct safetensors headers show exactly this split;
SGLang 0.5.23 builds the gate and the NextN eh_proj without a quant method). Newer FP8 configs add
`modules_to_not_convert` (or `ignored_layers`): those modules are stored unquantized; matched like SGLang's
`layers/quantization/utils.py` `_module_path_match` (dotted-path boundaries, entries with and without `model.`).
`scale_fmt: "ue8m0"` (DeepSeek-V3.1) means the scales are powers of two: recorded as scale_dtype "pow2".

The result is `TensorInfo.source_format` (None = stored as the logical `dtype`); resolve turns it into the plan's
source precision and byte counts; the converter checks it against the checkpoint's own headers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ..precision import FormatKind, TensorFormat
from .errors import ArchitectureError

# Linear roles a DeepSeek-style FP8 release keeps in torch_dtype (model code, not a list, decides it).
_NEVER_QUANTIZED_ROLES = frozenset({"lm_head", "mtp.lm_head", "mtp.eh_proj"})


@dataclass(frozen=True)
class SourceQuantization:
    method: str  # quantization_config.quant_method
    fmt: Optional[TensorFormat]  # None: a method policyc cannot describe (stored format unknown)
    ignored: tuple[str, ...] = ()


def fp8_block_format(block: tuple[int, int] = (128, 128), pow2: bool = False) -> TensorFormat:
    return TensorFormat(kind=FormatKind.FP8_BLOCK, element="e4m3", block=block,
                        scale_dtype="pow2" if pow2 else "fp32")


def parse_source_quantization(raw: dict[str, Any], source: str) -> Optional[SourceQuantization]:
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise ArchitectureError(f"{source}: 'quantization_config' must be an object, got {type(q).__name__}",
                                hint="remove it for a BF16 checkpoint")
    method = q.get("quant_method")
    if not isinstance(method, str):
        raise ArchitectureError(f"{source}: quantization_config.quant_method is missing or not a string",
                                hint='DeepSeek-style FP8 releases say "quant_method": "fp8"')
    ignored = q.get("modules_to_not_convert") or q.get("ignored_layers") or ()
    if not (isinstance(ignored, (list, tuple)) and all(isinstance(x, str) for x in ignored)):
        raise ArchitectureError(f"{source}: quantization_config modules_to_not_convert / ignored_layers must be a "
                                f"list of module names, got {ignored!r}")
    if method == "fp8":
        fmt_name = q.get("fmt", "e4m3")
        if fmt_name != "e4m3":
            raise ArchitectureError(f"{source}: quantization_config.fmt {fmt_name!r} is not supported",
                                    hint="FP8 releases (DeepSeek-V3, Kimi-K2) store e4m3 weights")
        block = q.get("weight_block_size")
        if block is None:  # per-tensor FP8 (X.weight_scale): described, converted only if a backend supports it
            return SourceQuantization(method, TensorFormat(kind=FormatKind.FP8, element="e4m3", scale_dtype="fp32"),
                                      tuple(ignored))
        if not (isinstance(block, (list, tuple)) and len(block) == 2
                and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise ArchitectureError(f"{source}: quantization_config.weight_block_size must be [rows, cols] of "
                                    f"positive ints, got {block!r}", hint="DeepSeek-V3: [128, 128]")
        return SourceQuantization(method, fp8_block_format(tuple(block), pow2=q.get("scale_fmt") == "ue8m0"),
                                  tuple(ignored))
    return SourceQuantization(method, None, tuple(ignored))


def _module_path_match(ignored: str, module: str) -> bool:
    """Same rule as SGLang 0.5.23 `_module_path_match`: equal, a dotted prefix, or a dotted infix."""
    ignored, module = ignored.rstrip("."), module.rstrip(".")
    return ignored == module or module.startswith(ignored + ".") or f".{ignored}." in f".{module}."


def is_ignored(module: str, ignored: tuple[str, ...]) -> bool:
    # SGLang's Fp8Config adds every entry with and without the `model.` prefix.
    bare = module.removeprefix("model.")
    return any(_module_path_match(e, module) or _module_path_match(e, bare) for e in ignored)


def apply_source_formats(tensors: list, sq: Optional[SourceQuantization]) -> list:
    """Set `source_format` on every tensor the release stores quantized. The TensorInfo objects were just built by
    the adapter and are not shared yet, so the field is written in place (a copy per tensor would double the
    DeepSeek-V3 load time)."""
    if sq is None or sq.fmt is None:
        return tensors
    from .base import LINEAR_ROLES

    fmt = sq.fmt
    roles = LINEAR_ROLES - _NEVER_QUANTIZED_ROLES  # every linear role is a 2-D `.weight`
    ignored = sq.ignored
    for t in tensors:
        if t.role in roles and not (ignored and is_ignored(t.hf_name[:-len(".weight")], ignored)):
            t.__dict__["source_format"] = fmt
    return tensors
