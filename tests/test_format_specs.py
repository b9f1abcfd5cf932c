"""The format unit (precision_dsl/format_specs.py): one spec per kind, read by the language, the byte accounting,
both quantize dispatchers and the backends; the per-token scope has one code name."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from precision_dsl import formats, kernels
from precision_dsl.format_specs import NVFP4_SPEC, PER_TOKEN, SPECS, FormatInputError, Scope, spec_of
from precision_dsl.lang.formats import FORMAT_ARGS, FORMAT_NAMES
from precision_dsl.precision import FormatKind, TensorFormat, storage_bytes

ROOT = Path(__file__).resolve().parents[1]


def test_one_spec_per_kind_in_kind_order():
    assert list(SPECS) == list(FormatKind)
    assert FORMAT_NAMES == tuple(k.value for k in FormatKind)
    assert FORMAT_ARGS["nvfp4"]["act_scale"] == ("per_tensor", "per_token")
    assert spec_of("mxfp8") is spec_of(FormatKind.MXFP8) is SPECS[FormatKind.MXFP8]


def test_every_quantized_kind_has_a_reference_and_the_kernels_cover_a_subset():
    quantized = {k for k, s in SPECS.items() if not s.high_precision}
    assert set(formats.REFERENCES) == quantized
    assert set(kernels.ENTRIES) <= quantized and FormatKind.FP8 not in kernels.ENTRIES


def test_the_per_token_scope_keeps_its_serialized_literal():
    # "row" enters every plan's content hash (tests/data/baseline_hashes.json): it must not change.
    assert PER_TOKEN == Scope.PER_TOKEN == "row"
    fmt = TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale=PER_TOKEN)
    assert fmt.short() == "nvfp4[1x16,per_token]"
    assert fmt.model_dump(mode="json")["global_scale"] == "row"


@pytest.mark.parametrize("scope,weight_ok,act_ok", [
    (None, True, True), (Scope.TENSOR, True, True), (Scope.GROUP, True, False), (Scope.EXPERT, False, False),
    (Scope.PER_TOKEN, False, True)])
def test_nvfp4_global_scale_legality(scope, weight_ok, act_ok):
    assert NVFP4_SPEC.one_weight_scale_per_tensor(scope) is weight_ok
    assert NVFP4_SPEC.activation_scale_supported(scope) is act_ok


@pytest.mark.parametrize("fmt,axis", [
    (TensorFormat(kind="nvfp4", element="e2m1", block=(1, 16), scale_dtype="e4m3", global_scale="row"), "row"),
    (TensorFormat(kind="nvfp4", element="e2m1", block=(16, 16), scale_dtype="e4m3", global_scale="tensor"), "col"),
    (TensorFormat(kind="mxfp8", element="e5m2", block=(32, 1), scale_dtype="e8m0"), "row"),
    (TensorFormat(kind="fp8_block", element="e4m3", block=(128, 128), scale_dtype="fp32"), "col"),
    (TensorFormat(kind="fp8", element="e4m3", scale_dtype="fp32", global_scale="tensor"), "row"),
])
def test_one_argument_mapping_for_both_dispatchers(fmt, axis):
    x = torch.randn(64, 128, dtype=torch.bfloat16)
    ref = formats.quantize(x, fmt, axis=axis)
    via_entry = kernels.quantize(x, fmt, axis=axis, kernel="reference")
    assert ref.fmt == via_entry.fmt == fmt
    for name, t in ref.tensors().items():
        assert torch.equal(t, via_entry.tensors()[name]), name
    assert ref.nbytes == storage_bytes(fmt, x.shape, axis=axis) == formats.nbytes_of(fmt, x.shape, axis=axis)
    assert formats.quantizer_kwargs(fmt, axis) == {**fmt.spec.quantizer_kwargs(fmt, axis),
                                                   **({"global_amax": None} if fmt.spec.takes_global_amax else {})}


def test_the_mapping_refuses_what_no_quantizer_takes():
    with pytest.raises(FormatInputError, match="MXFP8 blocks are"):
        formats.quantizer_kwargs(TensorFormat(kind="mxfp8", element="e4m3", block=(1, 16)), "row")
    with pytest.raises(FormatInputError, match="high-precision format"):
        formats.quantize(torch.zeros(4, 16), TensorFormat(kind="bf16", element="bf16"))
    with pytest.raises(FormatInputError, match="global_amax only applies"):
        formats.quantizer_kwargs(TensorFormat(kind="fp8", element="e4m3", scale_dtype="fp32"), "row", 1.0)


def test_no_code_compares_a_scope_against_the_raw_row_literal():
    """"row" as a scope value is spelled Scope.PER_TOKEN / PER_TOKEN / is_per_token outside the spec module."""
    pattern = re.compile(r"""(global_scale|scope)\s*(==|!=|in)\s*\(?[^)\n]*["']row["']""")
    bad = []
    for base in (ROOT / "precision_dsl", ROOT / "backends"):
        for path in sorted(base.rglob("*.py")):
            if path.name == "format_specs.py":
                continue
            for i, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line):
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


# Where a branch on a format kind may live: the format unit itself. Backends dispatch through their one kind-keyed
# format table (module-level dicts, allowed everywhere), the engines through `FormatSpec` facts and kind sets.
_KIND_BRANCH_ALLOWED = {
    "precision_dsl/format_specs.py",
}


def _kind_branches(source: str) -> list[tuple[int, str]]:
    """(line, code) of every comparison against a `FormatKind.X` member or a `.kind.value`, and of every dict keyed
    by `FormatKind.X` built inside a function (an ad-hoc dispatch instead of a table)."""
    import ast

    def is_member(n) -> bool:
        return isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "FormatKind"

    def is_kind_value(n) -> bool:
        return isinstance(n, ast.Attribute) and n.attr == "value" and isinstance(n.value, ast.Attribute) \
            and n.value.attr == "kind"

    found = []
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            flat = [e for o in operands for e in (o.elts if isinstance(o, (ast.Tuple, ast.List, ast.Set)) else [o])]
            if any(is_member(e) or is_kind_value(e) for e in flat):
                found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            for sub in ast.walk(node):
                if isinstance(sub, ast.Dict) and any(k is not None and is_member(k) for k in sub.keys):
                    found.append((sub.lineno, ast.unparse(sub)[:80]))
    return found


def test_the_scan_finds_kind_branches():
    src = ("from x import FormatKind\nT = {FormatKind.MXFP8: 1}\n"
           "def f(w, k):\n    if w.kind == FormatKind.NVFP4: pass\n"
           "    if k in (FormatKind.BF16, FormatKind.FP16): pass\n"
           "    if w.kind.value != 'fp8': pass\n    return {FormatKind.FP8: 2}[k]\n")
    assert sorted(line for line, _ in _kind_branches(src)) == [4, 5, 6, 7]


def test_no_format_kind_branch_outside_the_spec_and_the_backend_tables():
    bad = []
    for base in (ROOT / "precision_dsl", ROOT / "backends"):
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _KIND_BRANCH_ALLOWED:
                continue
            bad += [f"{rel}:{line}: {code}" for line, code in _kind_branches(path.read_text())]
    assert not bad, "branch through format_specs (a FormatSpec fact / kinds_where) or the backend's format table:\n" \
                    + "\n".join(bad)
