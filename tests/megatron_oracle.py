"""Oracle: what megatron-core 0.16.1 ITSELF runs for every TE module, given policyc's emitted Megatron artifacts.

Nothing here re-implements megatron-core's decisions; each step calls its code:

  * TransformerConfig / MLATransformerConfig built from the emitted flags (their __post_init__ validation runs:
    first/last-BF16 ranges, fp8 x fp4, uneven pipeline split, router dtype). The flag -> field table is Megatron-LM
    core_v0.16.1 `megatron/training/arguments.py` (GitHub-only, not in the wheel): fields are `--` + name with `-`
    except the renames listed in FLAG_FIELDS (l.1329-1330 decoder_*_pipeline_num_layers, fp8_param_gather);
  * `validate_args` rule reproduced (the only one the emitted flags can trip, arguments.py l.556-568): without
    --decoder-first/last-pipeline-num-layers, num_layers % pipeline size must be 0;
  * the per-module YAML loaded by `megatron.core.quantization.utils.load_quantization_recipe` (the call
    core_transformer_config_from_args makes for --te-precision-config-file, l.1380-1383);
  * per pipeline rank: `transformer_layer.get_transformer_layer_offset(config, pp_rank=r)` and
    `transformer_block.get_num_layers_to_build(config, pp_rank=r)` give the rank's global layers; the module path
    the matcher sees is GPTModel.named_modules()'s, i.e. stage-local `decoder.layers.<local>.*`;
  * layer context: `fp8_utils.is_first_last_bf16_layer(config, global_layer)` (get_fp4_context applies the same
    rule, fp4_utils.py l.120-136); MTP: quantized context only when config.fp8 (multi_token_prediction.py l.773-781,
    "currently ignoring FP4 in MTP layers");
  * per module: `quantization.utils.get_quant_config_or_none` + `TEQuantizationParams.parse_from_config` +
    `extensions.transformer_engine._get_should_context_be_quantized_params` (the function will_execute_quantized
    uses); when the override does not apply, the module runs the context's (global) recipe.

A load failure raises OracleUnavailable with the reason (tests turn it into a failure, never a skip).

Other megatron-core releases (VERSIONS) are judged by the same functions in a separate process (`judge_in_process`):
the release's wheel is downloaded once with `pip download --no-deps` into the oracle cache, unpacked, and put first
on that process's sys.path, so the session's installed 0.16.1 is never shadowed. megatron-core >= 0.17 declares
Requires-Python >= 3.12; its sources import and run on 3.11 (only the wheel's metadata asks for 3.12), so the wheel
is fetched with `--python-version 3.12`. The CLI flag -> field table stays Megatron-LM core_v0.16.1's (the training
arguments are not in the wheel); every field must exist in the release's TransformerConfig, whose constructor
rejects any other keyword.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from oracles._wheels import download, extract, install_site

MEGATRON_CORE_VERSION = "0.16.1"  # the installed one (test extra)
# Every release the Megatron artifacts are judged by: the installed one and the newest on the registry (read from its
# wheel, in another process).
VERSIONS = ("0.16.1", "0.19.2")
KIND_OF_RECIPE = {"mxfp8": "mxfp8", "blockwise": "fp8_block", "tensorwise": "fp8", "nvfp4": "nvfp4"}

# Megatron-LM core_v0.16.1 CLI flag -> TransformerConfig field (value flags)
FLAG_FIELDS = {
    "--fp8-format": "fp8", "--fp8-recipe": "fp8_recipe", "--fp4-format": "fp4", "--fp4-recipe": "fp4_recipe",
    "--num-layers-at-start-in-bf16": "num_layers_at_start_in_bf16",
    "--num-layers-at-end-in-bf16": "num_layers_at_end_in_bf16",
    "--tensor-model-parallel-size": "tensor_model_parallel_size",
    "--pipeline-model-parallel-size": "pipeline_model_parallel_size",
    "--expert-model-parallel-size": "expert_model_parallel_size",
    "--expert-tensor-parallel-size": "expert_tensor_parallel_size",
    "--decoder-first-pipeline-num-layers": "num_layers_in_first_pipeline_stage",
    "--decoder-last-pipeline-num-layers": "num_layers_in_last_pipeline_stage",
    "--moe-router-dtype": "moe_router_dtype",
}
BOOL_FLAGS = {"--bf16": "bf16", "--first-last-layers-bf16": "first_last_layers_bf16",
              "--fp8-param-gather": "fp8_param", "--fp4-param-gather": "fp4_param",
              "--moe-grouped-gemm": "moe_grouped_gemm"}
TRAINING_ONLY = {"--transformer-impl": "transformer_engine", "--te-precision-config-file": None}


class OracleUnavailable(RuntimeError):
    pass


def load(version: str = MEGATRON_CORE_VERSION):
    try:
        import megatron.core as mc
        from megatron.core.extensions import transformer_engine as te_ext  # noqa: F401
        from megatron.core.quantization import utils as qutils  # noqa: F401
        from megatron.core.transformer import transformer_block, transformer_layer  # noqa: F401
    except Exception as err:  # pragma: no cover - the failure path is the point
        raise OracleUnavailable(f"megatron-core {version} cannot be imported ({err!r}); install the "
                                "test extra: pip install -e '.[test]'") from err
    if mc.__version__ != version:
        raise OracleUnavailable(f"megatron-core {mc.__version__} imported; the oracle is pinned to {version}")
    return mc


@dataclass(frozen=True)
class Reading:
    """What megatron-core runs for one TE module."""

    kind: str  # bf16 | mxfp8 | fp8_block | fp8 | nvfp4
    fp8_format: Optional[str] = None  # e4m3 | hybrid for FP8 recipes


def plan_modules(plan) -> dict[str, list]:
    """{Megatron module path: the plan's tensors in it} of the decoder and MTP linears megatron-core builds as TE
    modules (not MTP's eh_proj); the members of one module share one format."""
    from precision_dsl.backends.megatron import megatron_module

    mods: dict[str, list] = {}
    for t in plan.tensors:
        if t.is_linear and t.megatron_name and t.megatron_name.split(".")[0] in ("decoder", "mtp") \
                and t.role != "mtp.eh_proj":
            mods.setdefault(megatron_module(t.megatron_name), []).append(t)
    return mods


def plan_reading(t) -> Reading:
    """The Reading megatron-core must produce for plan tensor `t`."""
    p = t.precision
    if not p.is_quantized:
        return Reading("bf16")
    if t.weight.kind.value == "nvfp4":
        return Reading("nvfp4")
    hybrid = p.backward.value == "quantized" and p.grad.element == "e5m2"
    return Reading(t.weight.kind.value, "hybrid" if hybrid else "e4m3")


def parse_flags(flags: list[str]) -> tuple[dict, Optional[str]]:
    """(TransformerConfig kwargs, --te-precision-config-file value). Unknown flags fail: every emitted flag must
    mean something to Megatron."""
    kw, yaml_name, i = {}, None, 0
    while i < len(flags):
        f = flags[i]
        if f in BOOL_FLAGS:
            kw[BOOL_FLAGS[f]] = True
            i += 1
        elif f in FLAG_FIELDS:
            v = flags[i + 1]
            kw[FLAG_FIELDS[f]] = int(v) if v.isdigit() else v
            i += 2
        elif f in TRAINING_ONLY:
            if f == "--te-precision-config-file":
                yaml_name = flags[i + 1]
            elif TRAINING_ONLY[f] is not None:
                assert flags[i + 1] == TRAINING_ONLY[f], f"{f} {flags[i + 1]}"
            i += 2
        else:
            raise AssertionError(f"emitted flag {f} has no Megatron-LM core_v0.16.1 meaning known to the oracle")
    return kw, yaml_name


def validate_args(kw: dict, num_layers: int) -> None:
    """Megatron-LM core_v0.16.1 validate_args, the pipeline rule (arguments.py l.556-568)."""
    pp = kw.get("pipeline_model_parallel_size", 1)
    if kw.get("num_layers_in_first_pipeline_stage") is None and kw.get("num_layers_in_last_pipeline_stage") is None:
        assert num_layers % pp == 0, "Number of layers should be divisible by the pipeline-model-parallel size"


@contextlib.contextmanager
def _without_te():
    """megatron-core's MoE x FP8 checks call is_te_min_version, which fails without TE on this CPU box (megatron-core
    0.16.1 megatron/core/utils.py: get_te_version() is None, compared with a Version): answer 'new enough' so the
    rest of __post_init__ validates."""
    import megatron.core.transformer.transformer_config as tc

    orig = tc.is_te_min_version
    tc.is_te_min_version = lambda *a, **k: True
    try:
        yield
    finally:
        tc.is_te_min_version = orig


def _shape_fields(arch) -> dict:
    """TransformerConfig fields of the architecture's shape (both ways of building a config below start here)."""
    c = arch.config
    base = dict(num_layers=arch.num_layers, hidden_size=c["hidden_size"],
                num_attention_heads=c["num_attention_heads"],
                ffn_hidden_size=c.get("intermediate_size", 4 * c["hidden_size"]),
                num_moe_experts=c.get("num_experts") or c.get("n_routed_experts"),
                moe_ffn_hidden_size=c.get("moe_intermediate_size"), moe_router_topk=c.get("num_experts_per_tok", 2),
                add_bias_linear=False, gated_linear_unit=True)
    if c.get("num_nextn_predict_layers"):
        base["mtp_num_layers"] = int(c["num_nextn_predict_layers"])
    return base


def build_config(arch, flags: list[str], yaml_dir: Optional[Path]):
    """TransformerConfig (MLATransformerConfig for DeepSeek-V3) from the architecture's shape + the emitted flags,
    with quant_recipe loaded from the emitted YAML by megatron-core."""
    import torch
    from megatron.core.quantization.utils import load_quantization_recipe
    from megatron.core.transformer import transformer_config as tc

    kw, yaml_name = parse_flags(flags)
    validate_args(kw, arch.num_layers)
    c = arch.config
    base = _shape_fields(arch)
    base.update(kw)
    if base.get("pipeline_model_parallel_size", 1) > 1:
        base["pipeline_dtype"] = torch.bfloat16
    if yaml_name is not None:
        base["quant_recipe"] = load_quantization_recipe(str(Path(yaml_dir) / yaml_name))
    with _without_te():
        if c.get("model_type") == "deepseek_v3":
            return tc.MLATransformerConfig(**base, q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"],
                                           qk_head_dim=c["qk_nope_head_dim"],
                                           qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"])
        return tc.TransformerConfig(**base, num_query_groups=c.get("num_key_value_heads"),
                                    kv_channels=c.get("head_dim"))


def stages(config) -> list[range]:
    """Global decoder layers of each pipeline rank, by megatron-core's own layout functions."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    out = []
    for r in range(config.pipeline_model_parallel_size):
        off = get_transformer_layer_offset(config, pp_rank=r)
        n = get_num_layers_to_build(config, pp_rank=r)
        out.append(range(off, off + n))
    return out


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")


def _global_reading(config) -> Optional[Reading]:
    if config.fp8:
        r = getattr(config.fp8_recipe, "value", config.fp8_recipe)
        return Reading(KIND_OF_RECIPE[str(r)], str(config.fp8))
    if config.fp4:
        r = getattr(config.fp4_recipe, "value", config.fp4_recipe)
        return Reading(KIND_OF_RECIPE[str(r)])
    return None


def read_modules(config, modules: list[str]) -> dict[str, tuple[int, Reading]]:
    """{global module path: (pp rank, Reading)} for decoder modules `decoder.layers.<global>.*` and MTP modules
    `mtp.*` (built on the last pipeline rank)."""
    from megatron.core.extensions.transformer_engine import (TEQuantizationParams,
                                                             _get_should_context_be_quantized_params)
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.quantization.utils import get_quant_config_or_none

    glob = _global_reading(config)
    layout = stages(config)
    assert sum(len(s) for s in layout) == config.num_layers and layout[0].start == 0
    rank_of = {layer: (r, rng.start) for r, rng in enumerate(layout) for layer in rng}
    out = {}
    for mod in modules:
        m = _LAYER.match(mod)
        if m:
            g = int(m.group(1))
            rank, off = rank_of[g]
            path = f"decoder.layers.{g - off}.{m.group(2)}"
            ctx = glob is not None and not is_first_last_bf16_layer(config, g)
        else:
            assert mod.startswith("mtp."), mod
            rank, path = len(layout) - 1, mod
            ctx = glob is not None and bool(config.fp8)
        qc = get_quant_config_or_none(path, config.quant_recipe)
        qparams = TEQuantizationParams.parse_from_config(qc) if qc is not None else None
        quantized = _get_should_context_be_quantized_params(qparams, True, ctx)
        if not quantized:
            out[mod] = (rank, Reading("bf16"))
            continue
        rec = qparams.training_recipe if qparams is not None else None
        overridden = rec is not None and ((ctx and rec.override_quantized_autocast)
                                          or (not ctx and rec.override_nonquantized_autocast))
        if not overridden:
            out[mod] = (rank, glob)
            continue
        if rec.fp8_quantization_recipe is not None:
            name = getattr(rec.fp8_quantization_recipe, "value", rec.fp8_quantization_recipe)
            out[mod] = (rank, Reading(KIND_OF_RECIPE[str(name)], rec.fp8_format))
        else:
            name = getattr(rec.fp4_quantization_recipe, "value", rec.fp4_quantization_recipe)
            out[mod] = (rank, Reading(KIND_OF_RECIPE[str(name)]))
    return out


# ---------------------------------------------------------------------------------------------------------------
# another release, from its wheel, in its own process
# ---------------------------------------------------------------------------------------------------------------
def fetch_site(version: str) -> Path:
    """The unpacked megatron-core `version` wheel (pip download --no-deps, PyPI, once; reused after)."""
    whl = download(f"megatron-core=={version}", OracleUnavailable, python_version="3.12")
    return install_site(f"megatron-core-{version}-site", lambda tmp: extract(whl, tmp, lambda n: n.startswith(
        "megatron/")), whl.name)


@dataclass(frozen=True)
class Job:
    """One judgment: the architecture (bundled model name), the emitted flags and the directory of the YAML."""

    key: str
    model: str
    flags: list
    yaml_dir: Optional[str]
    modules: list


def judge(jobs: list[Job], version: str = MEGATRON_CORE_VERSION) -> dict[str, dict]:
    """{key: {"stages": [[start, stop]], "modules": {module: [rank, kind, fp8_format]}} or {"error": text}} read by
    the megatron-core imported in this process (pinned to `version`)."""
    from precision_dsl.arch import load_architecture

    load(version)
    out: dict[str, dict] = {}
    for job in jobs:
        try:
            config = build_config(load_architecture(job.model), list(job.flags),
                                  Path(job.yaml_dir) if job.yaml_dir else None)
            mods = read_modules(config, list(job.modules))
            out[job.key] = {"stages": [[r.start, r.stop] for r in stages(config)],
                            "modules": {m: [rank, r.kind, r.fp8_format] for m, (rank, r) in mods.items()}}
        except Exception as err:  # megatron-core's own validation refusing is an answer, not a crash
            out[job.key] = {"error": f"{type(err).__name__}: {err}"}
    return out


def judge_in_process(jobs: list[Job], version: str, timeout: float = 900) -> dict[str, dict]:
    """`judge` under megatron-core `version` from its wheel, in a fresh process (the installed release stays in
    this one)."""
    site = fetch_site(version)
    repo = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "jobs.json", Path(d) / "out.json"
        src.write_text(json.dumps([job.__dict__ for job in jobs]))
        code = ("import json, sys; sys.path[:0] = [sys.argv[1], sys.argv[2], sys.argv[3]]; import megatron_oracle "
                "as mo; jobs = [mo.Job(**j) for j in json.load(open(sys.argv[4]))]; "
                "json.dump(mo.judge(jobs, sys.argv[6]), open(sys.argv[5], 'w'))")
        r = subprocess.run([sys.executable, "-c", code, str(site), str(Path(__file__).parent), str(repo), str(src),
                            str(dst), version], capture_output=True, text=True, timeout=timeout,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
        if r.returncode != 0 or not dst.exists():
            raise OracleUnavailable(f"megatron-core {version} judge process failed (rc {r.returncode}): "
                                    f"{(r.stderr or r.stdout).strip()[-1500:]}")
        return json.loads(dst.read_text())


# ---------------------------------------------------------------------------------------------------------------
# a TransformerConfig built from field values (verl's Megatron actor: override_transformer_config + parallel sizes)
# ---------------------------------------------------------------------------------------------------------------
CONFIG_PATHS = ("mbridge", "bridge")


def config_from_fields(arch, fields: dict, path: str = "mbridge"):
    """TransformerConfig (MLATransformerConfig for DeepSeek-V3) of the architecture's shape with `fields` set the
    way verl 0.9.1 sets them (verl/workers/engine/megatron/transformer_impl.py):

      * "mbridge": one constructor call with every field, as mbridge's `set_extra_args(**override_transformer_config)`
        builds `TransformerConfig(**kwargs)` (its __post_init__ runs once, on all of them);
      * "bridge": Megatron-Bridge's provider order: constructed with megatron-core's __post_init__ deferred (the
        provider's own __post_init__ is a no-op), every field set with setattr, then megatron-core's
        `TransformerConfig.__post_init__(self)` / `MLATransformerConfig.__post_init__(self)` called explicitly, as
        megatron-bridge's `finalize()` does (megatron-bridge 0.5.1 megatron/bridge/models/transformer_config.py).

    No YAML is loaded here: a `quant_recipe` in `fields` reaches megatron-core exactly as given."""
    import torch
    from megatron.core.transformer import transformer_config as tc

    c = arch.config
    base = _shape_fields(arch)
    if c.get("model_type") == "deepseek_v3":
        cls = tc.MLATransformerConfig
        base.update(q_lora_rank=c["q_lora_rank"], kv_lora_rank=c["kv_lora_rank"], qk_head_dim=c["qk_nope_head_dim"],
                    qk_pos_emb_head_dim=c["qk_rope_head_dim"], v_head_dim=c["v_head_dim"])
    else:
        cls = tc.TransformerConfig
        base.update(num_query_groups=c.get("num_key_value_heads"), kv_channels=c.get("head_dim"))
    fields = dict(fields)
    if (fields.get("pipeline_model_parallel_size") or 1) > 1:
        fields.setdefault("pipeline_dtype", torch.bfloat16)
    with _without_te():
        if path == "mbridge":
            return cls(**{**base, **fields})
        if path != "bridge":
            raise ValueError(f"unknown config path {path!r}")
        deferred = type(f"Deferred{cls.__name__}", (cls,), {"__post_init__": lambda self: None})
        config = deferred(**base)
        for name, value in fields.items():
            if not hasattr(config, name):  # apply_overrides_and_finalize refuses an unknown attribute
                raise AttributeError(f"{cls.__name__} has no attribute {name!r}")
            setattr(config, name, value)
        cls.__post_init__(config)
        return config
