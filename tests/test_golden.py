"""Byte-for-byte check of the reference quantizers against the shared golden vectors (TE reference outputs).

Cases are discovered from the manifests in $POLICYC_GOLDEN_DIR (default <repo>/../shared/golden/quantizers):
index.json if present, else every *.json manifest. Every variant of every case and every stored tensor is compared
through the format-generic API (precision_dsl.formats.quantize with a TensorFormat built from the manifest's recipe),
so the production dispatch path is what is tested. fp32 tensors are compared bitwise. A tensor kind this test does
not know fails the test (a new golden set cannot pass silently); `*.data_alt_signed_zero` (torchao's alternative
sign-of-zero bytes) is checked to be an alternative, i.e. NOT what we produce where it differs from TE's data.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from precision_dsl import formats
from precision_dsl.formats import nvfp4, swizzle
from precision_dsl.precision import TensorFormat

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(os.environ.get("POLICYC_GOLDEN_DIR", REPO_ROOT.parent / "shared" / "golden" / "quantizers"))
FP8_ELEMENTS = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}

COUNTS = {"cases": 0, "variants": 0, "tensors": 0, "bytes": 0, "alt_checked": 0}


def _discover() -> list[dict]:
    if not GOLDEN_DIR.is_dir():
        return []
    index = GOLDEN_DIR / "index.json"
    if index.is_file():
        entries = json.loads(index.read_text())["files"]
        return [{"file": e["file"], "manifest": e["manifest"]} for e in entries]
    out = []
    for man in sorted(GOLDEN_DIR.glob("*.json")):
        data = json.loads(man.read_text())
        if "variants" in data and "file" in data:
            out.append({"file": data["file"], "manifest": man.name})
    return out


CASES = _discover()


@pytest.fixture(scope="module", autouse=True)
def _report_counts(request):
    yield
    line = (f"golden quantizers ({GOLDEN_DIR}): {COUNTS['cases']} cases / {COUNTS['variants']} variants passed; "
            f"{COUNTS['tensors']} tensors ({COUNTS['bytes']} bytes) byte-identical; "
            f"{COUNTS['alt_checked']} alternative-sign-of-zero tensors checked")
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    capture = request.config.pluginmanager.get_plugin("capturemanager")
    if reporter is not None and capture is not None and COUNTS["cases"]:
        with capture.global_and_fixture_disabled():
            reporter.write_line("")
            reporter.write_line(line)
    print(line)


# --- recipe -> (TensorFormat, axis, how to find the input block of an output position) ------------------------------

def _as_bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t


def _first_mismatch(mine: torch.Tensor, ref: torch.Tensor) -> tuple[int, ...]:
    diff = (_as_bits(mine) != _as_bits(ref)).nonzero()
    return tuple(int(v) for v in diff[0])


def _fail(name: str, mine: torch.Tensor, ref: torch.Tensor, block_of, x: torch.Tensor) -> None:
    if mine.shape != ref.shape:
        pytest.fail(f"{name}: shape {tuple(mine.shape)} != golden {tuple(ref.shape)}")
    pos = _first_mismatch(mine, ref)
    n_bad = int((_as_bits(mine) != _as_bits(ref)).sum())
    where = block_of(pos) if block_of else None
    msg = [f"{name}: {n_bad} of {ref.numel()} entries differ; first at {pos}: ours {mine[pos].item()!r} "
           f"(bits {_as_bits(mine)[pos].item():#x}) vs golden {ref[pos].item()!r} (bits {_as_bits(ref)[pos].item():#x})"]
    if where is not None:
        desc, vals = where
        msg.append(f"input block {desc}: values {vals.flatten().tolist()}")
    pytest.fail("\n".join(msg))


def _mxfp8_plan(recipe: dict):
    element = FP8_ELEMENTS[recipe["element"]]
    block = tuple(recipe["block"])
    if block == (1, 32):
        fmt, axis = formats.mxfp8.make_format(element), "row"
    elif block == (32, 1):
        fmt, axis = formats.mxfp8.make_format(element), "col"
    elif block == (32, 32):
        fmt, axis = formats.mxfp8.make_format(element, tile_2d=True), "row"
    else:
        pytest.fail(f"unknown MXFP8 block {block} in manifest")

    def block_of_data(x, pos):
        r, c = pos
        if block == (1, 32):
            return f"x[{r}, {c // 32 * 32}:{c // 32 * 32 + 32}]", x[r, c // 32 * 32:c // 32 * 32 + 32]
        if block == (32, 1):
            return f"x[{r // 32 * 32}:{r // 32 * 32 + 32}, {c}]", x[r // 32 * 32:r // 32 * 32 + 32, c]
        r0, c0 = r // 32 * 32, c // 32 * 32
        return f"x[{r0}:{r0 + 32}, {c0}:{c0 + 32}]", x[r0:r0 + 32, c0:c0 + 32]

    def block_of_scale(x, pos):
        r, c = pos
        if block == (1, 32):
            return block_of_data(x, (r, c * 32))
        if block == (32, 1):
            return block_of_data(x, (r * 32, c))
        return block_of_data(x, (r * 32, c * 32))

    return fmt, axis, {"data": block_of_data, "scale": block_of_scale}


def _check_recipe_flags(recipe: dict) -> None:
    for flag in ("rht", "stochastic_rounding", "four_over_six"):
        if recipe.get(flag):
            pytest.fail(f"golden recipe uses {flag}=true, which the reference quantizers do not implement")


def _nvfp4_fmt(recipe: dict) -> TensorFormat:
    _check_recipe_flags(recipe)
    scope_text = recipe["global_scale"]
    if scope_text.startswith("per-row"):
        scope = "row"
    elif scope_text.startswith("per-tensor"):
        scope = "tensor"
    else:
        pytest.fail(f"unknown NVFP4 global_scale {scope_text!r} in manifest")
    return nvfp4.make_format(scope, tile_2d=tuple(recipe["block"]) == (16, 16))


def _matrix_block(m: torch.Tensor, block: tuple[int, int], r: int, c: int, label: str):
    br, bc = block
    r0, c0 = r // br * br, c // bc * bc
    return f"{label}[{r0}:{r0 + br}, {c0}:{c0 + bc}]", m[r0:r0 + br, c0:c0 + bc]


def _compare(name: str, mine: torch.Tensor, ref: torch.Tensor, x: torch.Tensor, block_of=None) -> None:
    mine = mine.contiguous()
    if mine.dtype != ref.dtype:
        pytest.fail(f"{name}: dtype {mine.dtype} != golden {ref.dtype}")
    if mine.shape != ref.shape or not torch.equal(_as_bits(mine), _as_bits(ref)):
        _fail(name, mine, ref, (lambda pos: block_of(x, pos)) if block_of else None, x)
    COUNTS["tensors"] += 1
    COUNTS["bytes"] += ref.numel() * ref.element_size()


def _run_mxfp8(variant: dict, t: dict, x: torch.Tensor) -> None:
    fmt, axis, block_of = _mxfp8_plan(variant["recipe"])
    q = formats.quantize(x, fmt, axis=axis)
    for name, ref in ((n, t[n]) for n in variant["tensors"]):
        kind = name[len(variant["name"]) + 1:]
        if kind == "data":
            _compare(name, q.data, ref, x, block_of["data"])
        elif kind == "scale":
            _compare(name, q.scale, ref, x, block_of["scale"])
        elif kind == "scale_swizzled_128x4":
            _compare(name, swizzle.swizzled_scale(q), ref, x)
        else:
            pytest.fail(f"{name}: unknown MXFP8 golden tensor kind {kind!r}")


def _run_nvfp4(variant: dict, t: dict, x: torch.Tensor) -> None:
    fmt = _nvfp4_fmt(variant["recipe"])
    tile = (16, 16) if fmt.block == (16, 16) else (1, 16)
    parts = sorted({n[len(variant["name"]) + 1:].split(".", 1)[0] for n in variant["tensors"]})
    for part in parts:
        if part not in ("rowwise", "colwise"):
            pytest.fail(f"{variant['name']}: unknown NVFP4 golden part {part!r}")
        axis = "row" if part == "rowwise" else "col"
        m = x.float() if axis == "row" else x.float().t()
        label = "x" if axis == "row" else "x.T"
        q = formats.quantize(x, fmt, axis=axis)
        prefix = f"{variant['name']}.{part}."
        block_data = lambda x_, pos: _matrix_block(m, tile, pos[0], pos[1] * 2, label)  # noqa: E731
        block_scale = lambda x_, pos: _matrix_block(m, tile, pos[0] * tile[0], pos[1] * 16, label)  # noqa: E731
        block_row = lambda x_, pos: (f"{label}[{pos[0]}, :]" if q.global_amax.numel() > 1 else label,  # noqa: E731
                                     m[pos[0]] if q.global_amax.numel() > 1 else m)
        for name in (n for n in variant["tensors"] if n.startswith(prefix)):
            kind, ref = name[len(prefix):], t[name]
            if kind == "data":
                _compare(name, q.data, ref, x, block_data)
            elif kind == "scale":
                _compare(name, q.scale, ref, x, block_scale)
            elif kind == "amax":
                _compare(name, q.global_amax, ref, x, block_row)
            elif kind == "global_encode_scale":
                _compare(name, nvfp4.global_encode_scale(q.global_amax), ref, x, block_row)
            elif kind == "global_decode_scale":
                _compare(name, q.global_scale, ref, x, block_row)
            elif kind == "scale_swizzled_128x4":
                _compare(name, swizzle.swizzled_scale(q), ref, x)
            elif kind == "data_alt_signed_zero":
                # torchao's sign-preserving bytes: must differ from ours exactly where the TE data differs from it
                differs_from_te = ref != t[prefix + "data"]
                assert torch.equal(differs_from_te, ref != q.data), f"{name}: alternative bytes not understood"
                COUNTS["alt_checked"] += 1
            else:
                pytest.fail(f"{name}: unknown NVFP4 golden tensor kind {kind!r}")


def _run_fp8block(variant: dict, t: dict, x: torch.Tensor) -> None:
    recipe = variant["recipe"]
    if recipe.get("amax_epsilon", 0.0) != 0.0:
        pytest.fail(f"{variant['name']}: amax_epsilon != 0 is not implemented")
    block = tuple(recipe["block"])
    fmt = formats.fp8_block.make_format(FP8_ELEMENTS[recipe["element"]], block, bool(recipe["pow2_scales"]))
    parts = sorted({n[len(variant["name"]) + 1:].split(".", 1)[0] for n in variant["tensors"]})
    for part in parts:
        if part not in ("rowwise", "colwise"):
            pytest.fail(f"{variant['name']}: unknown FP8-block golden part {part!r}")
        axis = "row" if part == "rowwise" else "col"
        m = x.float() if axis == "row" else x.float().t()
        label = "x" if axis == "row" else "x.T"
        q = formats.quantize(x, fmt, axis=axis)
        prefix = f"{variant['name']}.{part}."
        block_data = lambda x_, pos: _matrix_block(m, block, pos[0], pos[1], label)  # noqa: E731
        block_scale = lambda x_, pos: _matrix_block(m, block, pos[0] * block[0], pos[1] * block[1], label)  # noqa
        for name in (n for n in variant["tensors"] if n.startswith(prefix)):
            kind, ref = name[len(prefix):], t[name]
            if kind == "data":
                _compare(name, q.data, ref, x, block_data)
            elif kind == "scale_inv":
                _compare(name, q.scale, ref, x, block_scale)
            else:
                pytest.fail(f"{name}: unknown FP8-block golden tensor kind {kind!r}")


RUNNERS = {"mxfp8": _run_mxfp8, "nvfp4": _run_nvfp4, "fp8block": _run_fp8block}


@pytest.mark.parametrize("case", CASES, ids=[c["file"].removesuffix(".safetensors") for c in CASES])
def test_golden_case(case):
    from safetensors.torch import load_file

    manifest = json.loads((GOLDEN_DIR / case["manifest"]).read_text())
    tensors = load_file(str(GOLDEN_DIR / case["file"]))
    x = tensors[manifest["input"]["tensor"]]
    fmt_name = manifest["format"]
    if fmt_name not in RUNNERS:
        pytest.fail(f"{case['file']}: unknown golden format {fmt_name!r}")
    assert manifest["variants"], f"{case['file']}: manifest lists no variants"
    for variant in manifest["variants"]:
        missing = [n for n in variant["tensors"] if n not in tensors]
        assert not missing, f"{case['file']}: manifest tensors missing from the file: {missing}"
        RUNNERS[fmt_name](variant, tensors, x)
        COUNTS["variants"] += 1
    COUNTS["cases"] += 1


def test_golden_summary(request):
    """Runs after the cases: the golden set must exist (else skip) and every selected case must have passed.
    Prints the counts (also written to the terminal at the end of this module)."""
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN_DIR}; set POLICYC_GOLDEN_DIR to the directory holding "
                    f"index.json and the *.safetensors files")
    assert CASES, f"no golden cases discovered in {GOLDEN_DIR}"
    selected = sum(1 for item in request.session.items if item.originalname == "test_golden_case")
    assert COUNTS["cases"] == selected, (
        f"only {COUNTS['cases']} of {selected} selected golden cases passed (see the failures above)")
    print(f"compared {COUNTS['cases']} cases / {COUNTS['variants']} variants / {COUNTS['tensors']} tensors")

