"""`load_architecture(name_or_path)`: bundled model name, config.json path, or checkpoint directory -> Architecture.

Only config.json is read (never weights), as JSON data. Every failure is an ArchitectureError with a hint.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

from ..resources import models_dir
from ._config import MAX_PARAMS, MAX_TENSORS
from .base import Architecture, gc_paused
from .errors import ArchitectureError
from .families import apply_aliases, dispatch
from .families import supported_model_types as _supported_model_types
from .source import apply_source_formats, parse_source_quantization
MAX_CONFIG_BYTES = 16 * 1024 * 1024  # real config.json files are a few KiB


def supported_model_types() -> list[str]:
    return _supported_model_types()


def list_bundled() -> list[str]:
    """Names of the bundled models (directories precision_dsl/models/<name>/ holding a config.json)."""
    root = models_dir()
    if not root.is_dir():
        return []
    return sorted(p.name for p in root.iterdir() if (p / "config.json").is_file())


def _locate(name_or_path: str) -> tuple[str, Path]:
    """Return (display name, config.json path)."""
    if not isinstance(name_or_path, (str, os.PathLike)) or not str(name_or_path).strip():
        raise ArchitectureError(
            f"model must be a bundled name or a path, got {name_or_path!r}",
            hint=f"use one of {', '.join(list_bundled())} or a path to config.json / a checkpoint directory",
        )
    text = str(name_or_path)
    bundled = models_dir() / text / "config.json"
    if "/" not in text and os.sep not in text and bundled.is_file():
        return text, bundled
    path = Path(text).expanduser()
    if path.is_dir():
        cfg = path / "config.json"
        if not cfg.is_file():
            raise ArchitectureError(
                f"{path}: directory has no config.json",
                hint="point at a HuggingFace checkpoint directory (it holds config.json) or at the config.json itself",
            )
        return text, cfg
    if path.is_file():
        return text, path
    # HF repo ids of bundled models ("Qwen/Qwen3-30B-A3B", "deepseek-ai/DeepSeek-V3") resolve offline to the bundle.
    alias = text.rstrip("/").rsplit("/", 1)[-1].lower()
    if (models_dir() / alias / "config.json").is_file():
        return alias, models_dir() / alias / "config.json"
    raise ArchitectureError(
        f"unknown model {text!r}: not a bundled model and no such file or directory",
        hint=f"bundled models: {', '.join(list_bundled())}; or give a path to config.json / a checkpoint directory",
    )


def read_config(path: Path) -> dict[str, Any]:
    """Read and parse a config.json as data (size-checked before reading)."""
    try:
        size = path.stat().st_size
        if size > MAX_CONFIG_BYTES:
            raise ArchitectureError(
                f"{path}: {size} bytes is far too large for a config.json",
                hint="pass the model's config.json, not a weights or index file",
            )
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ArchitectureError(f"{path}: not UTF-8 text", hint="pass the model's config.json (JSON text)") from None
    except OSError as exc:
        raise ArchitectureError(f"{path}: cannot read: {exc.strerror}", hint="check the path and permissions") from None
    from ..jsonsafe import loads_bounded

    def bad(message: str) -> ArchitectureError:
        return ArchitectureError(message, hint="fix the JSON syntax (trailing commas and comments are not allowed "
                                               "in JSON); config.json holds plain numbers and strings")

    # bounded: deep nesting, 5000-digit integers, NaN and duplicate keys are errors, not tracebacks
    raw = loads_bounded(text, str(path), bad, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(raw, dict):
        raise ArchitectureError(
            f"{path}: top level is a JSON {type(raw).__name__}, expected an object",
            hint="a HuggingFace config.json is a JSON object with model_type, hidden_size, ...",
        )
    return raw


def architecture_from_config(raw: dict[str, Any], name: str, source: str = "config.json") -> Architecture:
    """Build the Architecture of an already-parsed config dict (`source` names it in error messages)."""
    # architectures first, model_type second (families.py); the adapter sees the family's canonical model_type
    # (Kimi-K2's "kimi_k2" is DeepSeek-V3) and the public config.json attribute names (transformers 5 aliases).
    family, arch_class = dispatch(raw, source)
    adapter = family.adapter
    parsed = apply_aliases(raw, adapter, source)
    if parsed.get("model_type") != family.model_type:
        parsed = dict(parsed, model_type=family.model_type)
    source_quant = parse_source_quantization(raw, source)
    cfg = adapter.parse(parsed, source)
    # Bound the work before building: every block has < 40 non-expert tensors plus 3 per routed expert.
    blocks = cfg.num_hidden_layers + getattr(cfg, "num_nextn_predict_layers", 0)
    experts = getattr(cfg, "num_experts", None) or getattr(cfg, "n_routed_experts", None) or 0
    estimate = blocks * (3 * experts + 40) + 3
    if estimate > MAX_TENSORS:
        raise ArchitectureError(
            f"{source}: config describes about {estimate} tensors ({blocks} blocks x {experts} experts; "
            f"limit {MAX_TENSORS})",
            hint="check num_hidden_layers / num_experts / n_routed_experts for typos",
        )
    with gc_paused():
        tensors = apply_source_formats(adapter.emit(cfg), source_quant)
    total = sum(math.prod(t.shape) for t in tensors)
    if total > MAX_PARAMS:
        raise ArchitectureError(
            f"{source}: config describes {total / 1e12:.1f} T parameters (limit {MAX_PARAMS / 1e12:.0f} T)",
            hint="check hidden_size / intermediate sizes / vocab_size for typos",
        )
    # Scalars come from the validated config and tensors from model_construct; skip re-validating 46k objects.
    return Architecture.model_construct(
        name=name,
        model_type=family.model_type,
        source_model_type=raw.get("model_type") if raw.get("model_type") != family.model_type else None,
        architecture=arch_class,
        source_quantization=source_quant.method if source_quant else None,
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        config=raw,
        tensors=tuple(tensors),
        **adapter.summary(cfg),
    )


def load_architecture(name_or_path: str) -> Architecture:
    """Bundled name ("tiny-moe", "qwen3-30b-a3b", "deepseek-v3", ...), a config.json path, or a checkpoint directory.

    An HF repo id whose last part is a bundled name (case-insensitive, e.g. "Qwen/Qwen3-30B-A3B") also resolves to the
    bundled config when no such local path exists. Raises ArchitectureError (a ValueError) on any bad input."""
    name, path = _locate(name_or_path)
    return architecture_from_config(read_config(path), name, str(path))
