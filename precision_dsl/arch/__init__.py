"""Architecture catalog: every checkpoint tensor of a model with its HF / Megatron-core / SGLang names.

    from precision_dsl.arch import load_architecture
    arch = load_architecture("qwen3-30b-a3b")   # or a config.json path, or a checkpoint directory
"""

from .base import FUSED_SIBLINGS, LINEAR_ROLES, ROLE_GROUPS, ROLES, Architecture, TensorInfo
from .errors import ArchitectureError
from .groups import fused_groups, megatron_params, sglang_modules
from .loader import architecture_from_config, list_bundled, load_architecture, read_config, supported_model_types

__all__ = [
    "FUSED_SIBLINGS",
    "LINEAR_ROLES",
    "ROLES",
    "ROLE_GROUPS",
    "Architecture",
    "ArchitectureError",
    "TensorInfo",
    "architecture_from_config",
    "fused_groups",
    "list_bundled",
    "load_architecture",
    "megatron_params",
    "read_config",
    "sglang_modules",
    "supported_model_types",
]
