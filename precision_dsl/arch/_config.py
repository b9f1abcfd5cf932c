"""Pydantic validation of the config.json fields the adapters read.

Only the fields that decide tensor names/shapes are validated; everything else in config.json is kept verbatim in
`Architecture.config`. Ints are strict (a JSON "2048" string or 2048.5 is an error, not silently coerced) and bounded
so an absurd config fails here with a clear message instead of building millions of tensors.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .errors import ArchitectureError

# Bounds are far above any released model (DeepSeek-V3: hidden 7168, 256 experts, vocab 129280, 61 layers) but low
# enough that a typo (hidden_size 71680000) cannot make the catalog allocate gigabytes.
Hidden = Annotated[int, Field(strict=True, ge=1, le=65_536)]
Inner = Annotated[int, Field(strict=True, ge=1, le=1_048_576)]
Layers = Annotated[int, Field(strict=True, ge=1, le=1_024)]
Heads = Annotated[int, Field(strict=True, ge=1, le=4_096)]
HeadDim = Annotated[int, Field(strict=True, ge=1, le=4_096)]
Vocab = Annotated[int, Field(strict=True, ge=1, le=8_388_608)]
Experts = Annotated[int, Field(strict=True, ge=0, le=4_096)]
Count = Annotated[int, Field(strict=True, ge=0, le=64)]
StrictBool = Annotated[bool, Field(strict=True)]

DTYPES = ("bfloat16", "float16", "float32")
MAX_TENSORS = 1_000_000  # DeepSeek-V3: 46k; Kimi-K2-like 384 experts x 61 layers: ~70k
MAX_PARAMS = 20_000_000_000_000  # 20 T parameters


class BaseLMConfig(BaseModel):
    """Fields shared by every decoder-only family."""

    model_config = ConfigDict(extra="allow", frozen=True)

    model_type: str
    hidden_size: Hidden
    num_hidden_layers: Layers
    num_attention_heads: Heads
    num_key_value_heads: Optional[Heads] = None  # None -> num_attention_heads (MHA), as in transformers
    vocab_size: Vocab
    tie_word_embeddings: StrictBool = False
    torch_dtype: Optional[str] = None
    dtype: Optional[str] = None  # transformers >= 4.56 writes "dtype" instead of "torch_dtype"

    @model_validator(mode="after")
    def _check_common(self):
        kv = self.kv_heads
        if self.num_attention_heads % kv:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads ({kv})"
            )
        d = self.torch_dtype or self.dtype
        if d is not None and d not in DTYPES:
            raise ValueError(f"torch_dtype {d!r} is not one of {', '.join(DTYPES)}")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def checkpoint_dtype(self) -> str:
        return self.torch_dtype or self.dtype or "bfloat16"


class GQAConfig(BaseLMConfig):
    """Fields of the standard GQA attention block (Llama / Mistral / Qwen2 / Qwen3 / Qwen-MoE / GLM-4.5)."""

    head_dim: Optional[HeadDim] = None  # transformers falls back to hidden_size // num_attention_heads

    @model_validator(mode="after")
    def _check_head_dim(self):
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"head_dim is not given and hidden_size ({self.hidden_size}) is not divisible by "
                f"num_attention_heads ({self.num_attention_heads})"
            )
        return self

    @property
    def resolved_head_dim(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads


C = TypeVar("C", bound=BaseModel)


def validate_config(model: type[C], raw: dict[str, Any], source: str) -> C:
    """Validate `raw` against `model`, turning pydantic's error into an ArchitectureError naming file and field."""
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        lines = []
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"]) or "(config)"
            msg = err["msg"].removeprefix("Value error, ")
            if err["type"] == "missing":
                lines.append(f"field '{loc}' is missing")
            elif err["loc"]:
                got = repr(err.get("input"))
                got = got if len(got) <= 60 else got[:57] + "..."
                lines.append(f"field '{loc}': {msg} (got {got})")
            else:
                lines.append(msg)
        raise ArchitectureError(
            f"{source}: invalid {raw.get('model_type')} config: " + "; ".join(lines),
            hint="fix these fields in config.json (compare with the model's public config on the HF Hub)",
        ) from None
