"""SGLang 0.5.23's own model source is the judge of the catalog's SGLang module prefixes (GLM-4.5 MoE family).

The published `sglang==0.5.23` wheel is fetched with pip (PyPI only, no dependencies) into the one wheel cache the
SGLang oracle uses (tests/oracles/sglang_oracle.py `sglang_wheel`: $POLICYC_ORACLE_CACHE/wheels) and its `sglang/srt/models/glm4_moe.py` / `glm4_moe_nextn.py` are
read as text and parsed with `ast` (never imported: SGLang needs CUDA). What is checked:
  * every module prefix the catalog gives a GLM tensor is built from `add_prefix("<name>", prefix)` names that the
    SGLang model classes really use (qkv_proj, o_proj, gate_up_proj, down_proj, experts, shared_experts, ...);
  * the quantizable linears are built with `quant_config` (so the prefix is what `is_layer_skipped` sees) while the
    router gate (`Glm4MoeGate`) takes no quant config, which is why the catalog gives it no prefix;
  * QKVParallelLinear gets `bias=attention_bias` (q/k/v biases are part of the fused module) and o_proj `bias=False`;
  * the NextN (MTP) draft model names its decoder `decoder`, keeps `model.shared_head.head`, and builds eh_proj as a
    plain `nn.Linear` (never quantized: no prefix in the catalog).
Set POLICYC_OFFLINE=1 to skip where PyPI cannot be reached.
"""

from __future__ import annotations

import ast
import os
import re
import zipfile
from pathlib import Path

import pytest

from oracles._wheels import cache_dir
from oracles.sglang_oracle import sglang_wheel
from precision_dsl.arch import architecture_from_config, load_architecture

SGLANG_VERSION = "0.5.23"


@pytest.fixture(scope="module")
def sglang_sources() -> dict[str, str]:
    if os.environ.get("POLICYC_OFFLINE") == "1" and not list((cache_dir() / "wheels").glob("sglang-*.whl")):
        pytest.skip("POLICYC_OFFLINE=1: the sglang wheel cannot be fetched")
    out = {}
    with zipfile.ZipFile(sglang_wheel()) as z:
        for name in ("glm4_moe.py", "glm4_moe_nextn.py"):
            out[name] = z.read(f"sglang/srt/models/{name}").decode()
    return out


def _classes(src: str) -> dict[str, ast.ClassDef]:
    return {n.name: n for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}


def _calls(node: ast.AST) -> list[ast.Call]:
    return [n for n in ast.walk(node) if isinstance(n, ast.Call)]


def _callee(c: ast.Call) -> str:
    f = c.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _prefix_names(node: ast.AST) -> set[str]:
    """Literal first arguments of every add_prefix(...) call."""
    return {c.args[0].value for c in _calls(node) if _callee(c) == "add_prefix" and c.args
            and isinstance(c.args[0], ast.Constant) and isinstance(c.args[0].value, str)}


def _kw(c: ast.Call, name: str):
    return next((k.value for k in c.keywords if k.arg == name), None)


def _glm_archs():
    small = {"architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe", "hidden_size": 64,
             "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4,
             "num_key_value_heads": 2, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
             "first_k_dense_replace": 1, "use_qk_norm": True, "attention_bias": True,
             "num_nextn_predict_layers": 1, "vocab_size": 50, "torch_dtype": "bfloat16"}
    return [load_architecture("glm-4.5-air"), architecture_from_config(small, "glm-small")]


def test_glm_prefixes_are_sglang_module_names(sglang_sources):
    main, nextn = sglang_sources["glm4_moe.py"], sglang_sources["glm4_moe_nextn.py"]
    names = _prefix_names(ast.parse(main)) | _prefix_names(ast.parse(nextn))
    for arch in _glm_archs():
        for t in arch.tensors:
            if t.sglang_prefix is None:
                continue
            if t.mtp is not None:
                if t.role == "mtp.lm_head":
                    assert t.sglang_prefix == "model.shared_head.head"
                    assert "model.shared_head.head" in names
                    continue
                assert t.sglang_prefix.startswith("model.decoder.")
                parts = t.sglang_prefix.split(".")[1:]
            elif t.sglang_prefix == "lm_head":
                parts = ["lm_head"]
            else:
                m = re.match(r"^model\.layers\.(\d+)\.(.*)$", t.sglang_prefix)
                assert m, t.sglang_prefix
                parts = m.group(2).split(".")
            assert {"model", "layers"} <= names  # Glm4MoeForCausalLM / Glm4MoeModel prefixes
            missing = [p for p in parts if p not in names]
            assert not missing, f"{t.hf_name}: {t.sglang_prefix} uses {missing}, not module names of SGLang"


def test_glm_quantized_modules_take_quant_config_and_gate_does_not(sglang_sources):
    cls = _classes(sglang_sources["glm4_moe.py"])
    attn = {_callee(c): c for c in _calls(cls["Glm4MoeAttention"])}
    qkv, o = attn["QKVParallelLinear"], attn["RowParallelLinear"]
    assert ast.unparse(_kw(qkv, "bias")) == "attention_bias" and ast.unparse(_kw(o, "bias")) == "False"
    for c in (qkv, o):
        assert ast.unparse(_kw(c, "quant_config")) == "quant_config"
    mlp = {_callee(c): c for c in _calls(cls["Glm4MoeMLP"])}
    for k in ("MergedColumnParallelLinear", "RowParallelLinear"):
        assert ast.unparse(_kw(mlp[k], "quant_config")) == "quant_config"
    gate_src = ast.unparse(cls["Glm4MoeGate"])
    assert "quant_config" not in gate_src and "e_score_correction_bias" in gate_src
    # the catalog: router tensors carry no SGLang prefix (nothing a serving config could exempt or quantize)
    for arch in _glm_archs():
        assert all(t.sglang_prefix is None for t in arch.tensors if t.role.startswith("router."))
        assert all(t.sglang_prefix is None for t in arch.tensors if t.role == "bias.attn")


def test_glm_nextn_draft_model(sglang_sources):
    cls = _classes(sglang_sources["glm4_moe_nextn.py"])
    model = cls["Glm4MoeModelNextN"]
    assert "decoder" in _prefix_names(model)
    eh = [c for c in _calls(model) if ast.unparse(c.func) == "nn.Linear"]
    assert eh, "eh_proj is a plain nn.Linear"
    for arch in _glm_archs():
        by = arch.by_name()
        t = by[f"model.layers.{arch.num_layers}.eh_proj.weight"]
        assert t.sglang_prefix is None and t.role == "mtp.eh_proj"


def test_the_sglang_wheel_is_downloaded_and_stored_once(tmp_path, monkeypatch):
    """One cache, one download: every test that reads SGLang takes its wheel from sglang_oracle.wheel (the oracle's
    site is unpacked from that same file); no test module downloads a wheel of its own: the one pip download call
    of the tests is oracles/_wheels.py's, which every oracle (SGLang, vLLM, verl, megatron-core, TE) goes through."""
    from unittest import mock

    from oracles import _wheels

    tests = Path(__file__).resolve().parent
    needle = '"pip", ' + '"download"'  # a pip download call (split here so this file does not hold it)
    downloaders = sorted(p.relative_to(tests).as_posix() for p in tests.rglob("*.py") if needle in p.read_text())
    assert downloaders == ["oracles/_wheels.py"], downloaders
    monkeypatch.setenv("POLICYC_ORACLE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    whl = tmp_path / "wheels" / f"sglang-{SGLANG_VERSION}-cp311-cp311-manylinux_2_34_x86_64.whl"
    whl.write_bytes(b"")
    with mock.patch.object(_wheels.subprocess, "run", side_effect=AssertionError("downloaded again")):
        assert sglang_wheel() == whl
