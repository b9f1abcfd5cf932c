"""The verl plugin that carries a per-module TE precision recipe into verl's Megatron actor.

megatron-core reads a per-module recipe only as `TransformerConfig.quant_recipe`, a `RecipeConfig` object
(megatron-core 0.16.1 megatron/core/transformer/transformer_config.py:877, matched per module by
models/gpt/gpt_model.py:265 `get_quant_config_or_none(name, self.config.quant_recipe)`); Megatron-LM builds it from
`--te-precision-config-file` with `RecipeConfig.from_yaml_file` (megatron/core/quantization/quant_config.py). verl
0.9.1 copies `actor_rollout_ref.actor.megatron.override_transformer_config` onto the model config as plain Hydra
data (verl/workers/engine/megatron/transformer_impl.py: `bridge.set_extra_args(**override_transformer_config)` on the
mbridge path, `provider.apply_overrides_and_finalize(overrides=...)` or setattr + `provider.finalize()` on the
Megatron-Bridge path), so the launch can only put the YAML's absolute path there, a str.

verl imports this module in every worker (`actor_rollout_ref.model.external_lib`, imported by
`HFModelConfig.__post_init__`, verl/workers/config/model.py:149, before the engine builds its model). On import it
wraps `TransformerConfig.__post_init__` once: a `quant_recipe` that is a str / PathLike is replaced by
`RecipeConfig.from_yaml_file(path)` before megatron-core's own `__post_init__` runs. Every config class derived from
TransformerConfig goes through it: MLATransformerConfig calls `super().__post_init__()`, mbridge constructs
`TransformerConfig(**kwargs)`, and Megatron-Bridge's deferred `finalize()` calls
`MCoreTransformerConfig.__post_init__(self)` (megatron-bridge 0.5.1 megatron/bridge/models/transformer_config.py).
A RecipeConfig (or None) passes untouched, so a second `__post_init__` / `finalize()` changes nothing.

Without this module megatron-core keeps the str and fails loudly at model construction
(`get_quant_config_or_none` calls `recipe.match` on it: AttributeError), never silently; the launch sets
`external_lib` together with the key. A process without megatron-core (a rollout worker) is left alone: no
TransformerConfig can be built there.
"""

from __future__ import annotations

import os

from ..errors import PolicycError

MODULE = __name__  # the value of actor_rollout_ref.model.external_lib (engine/verl.py PLUGIN)
KEY = "quant_recipe"  # the TransformerConfig field, as override_transformer_config names it (verl.py RECIPE_KEY)
CONFIG_KEY = f"actor_rollout_ref.actor.megatron.override_transformer_config.{KEY}"
_MARK = "_policyc_quant_recipe_from_yaml"


class VerlPluginError(PolicycError, ValueError):
    def __init__(self, message: str, hint: str = "", code: int = 2):
        super().__init__(message)
        self.hint, self.code = hint, code


def load_recipe(value):
    """`RecipeConfig.from_yaml_file(value)` for a path; a missing / unreadable / invalid file names the key."""
    from megatron.core.quantization.quant_config import RecipeConfig

    path = os.fspath(value)
    hint = ("the launch names the te_precision.yaml policyc emitted beside it by absolute path: keep the emitted "
            "directory readable at that path on every trainer node, or re-emit it there")
    if not os.path.isabs(path):
        raise VerlPluginError(f"{CONFIG_KEY}={path!r} is not an absolute path (Ray workers run in other "
                              "directories)", hint)
    try:
        with open(path, "rb"):
            pass
    except OSError as err:
        raise VerlPluginError(f"{CONFIG_KEY}: cannot read the TE precision YAML {path!r} ({err.strerror})",
                              hint) from None
    try:
        return RecipeConfig.from_yaml_file(path)
    except Exception as err:  # megatron-core's own refusal of the document, with the key that named it
        raise VerlPluginError(f"{CONFIG_KEY}: megatron-core cannot read {path!r} as a RecipeConfig "
                              f"({type(err).__name__}: {err})", hint) from None


def install() -> bool:
    """Wrap TransformerConfig.__post_init__ (once). False when megatron-core is not importable here."""
    try:
        from megatron.core.transformer.transformer_config import TransformerConfig
    except ImportError:
        return False
    original = TransformerConfig.__post_init__
    if getattr(original, _MARK, False):
        return True

    def __post_init__(self):
        value = getattr(self, KEY, None)
        if isinstance(value, (str, os.PathLike)):
            setattr(self, KEY, load_recipe(value))
        original(self)

    setattr(__post_init__, _MARK, True)
    __post_init__.__wrapped__ = original
    __post_init__.__doc__ = original.__doc__
    TransformerConfig.__post_init__ = __post_init__
    return True


INSTALLED = install()
