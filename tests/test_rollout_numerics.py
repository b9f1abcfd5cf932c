"""The rollout's own activation quantizers (engine/rollout_quant.py, written from the golden README's spec, no code
shared with precision_dsl.formats) against the golden vectors, byte for byte; and the rollout's quantized-domain
GEMMs against the trainer's dequantize-then-FP32 GEMM (close, not identical: different accumulation / precision).

Golden discovery is test_golden.py's ($POLICYC_GOLDEN_DIR, default <repo>/../shared/golden/quantizers). The 2-D
weight-tile variants (MXFP8 32x32, NVFP4 16x16) are weight-only recipes: the rollout never quantizes weights (it
receives their bytes), so they are listed and skipped by name; any other unknown variant fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from precision_dsl.engine import rollout_quant as rq

REPO_ROOT = Path(__file__).resolve().parents[1]
GOLDEN_DIR = Path(os.environ.get("POLICYC_GOLDEN_DIR", REPO_ROOT.parent / "shared" / "golden" / "quantizers"))
WEIGHT_ONLY = {"mxfp8_e4m3_32x32", "nvfp4_16x16_pertensor"}
ELEM = {"float8_e4m3fn": "e4m3", "float8_e5m2": "e5m2"}


def _cases() -> list[str]:
    if not GOLDEN_DIR.is_dir():
        return []
    index = GOLDEN_DIR / "index.json"
    if index.is_file():
        return [e["manifest"] for e in json.loads(index.read_text())["files"]]
    return sorted(p.name for p in GOLDEN_DIR.glob("*.json") if "variants" in json.loads(p.read_text()))


CASES = _cases()


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32) if t.dtype == torch.float32 else t.contiguous()


def _same(name: str, mine: torch.Tensor, ref: torch.Tensor) -> None:
    assert mine.shape == ref.shape, f"{name}: shape {tuple(mine.shape)} != golden {tuple(ref.shape)}"
    bad = _bits(mine) != _bits(ref)
    assert not bad.any(), f"{name}: {int(bad.sum())} of {ref.numel()} entries differ, first at " \
                          f"{tuple(bad.nonzero()[0].tolist())}"


def _check_variant(fmt: str, v: dict, t: dict, x: torch.Tensor) -> int:
    name, recipe, n = v["name"], v["recipe"], 0
    if fmt == "mxfp8":
        block = tuple(recipe["block"])
        data, scale = rq.mxfp8(x if block == (1, 32) else x.t(), ELEM[recipe["element"]])
        if block == (32, 1):  # TE keeps columnwise data in [M, K] order; scales [M/32, K]
            data, scale = data.t(), scale.t()
        for tname in v["tensors"]:
            kind = tname[len(name) + 1:]
            if kind == "scale_swizzled_128x4":
                continue  # a layout of .scale (checked by test_golden/test_swizzle); the rollout's GEMM reads .scale
            _same(tname, {"data": data, "scale": scale}[kind], t[tname])
            n += 1
        return n
    for part in sorted({tn[len(name) + 1:].split(".", 1)[0] for tn in v["tensors"]}):
        m = x if part == "rowwise" else x.t()
        if fmt == "nvfp4":
            data, scale, amax, s_dec = rq.nvfp4(m, per_token=recipe["global_scale"].startswith("per-row"))
            s_enc, _ = rq.nvfp4_global(amax)
            got = {"data": data, "scale": scale, "amax": amax, "global_encode_scale": s_enc,
                   "global_decode_scale": s_dec}
        else:
            data, scale_inv = rq.fp8_block(m, ELEM[recipe["element"]], tuple(recipe["block"]),
                                           bool(recipe["pow2_scales"]))
            got = {"data": data, "scale_inv": scale_inv}
        for tname in (tn for tn in v["tensors"] if tn.startswith(f"{name}.{part}.")):
            kind = tname[len(name) + len(part) + 2:]
            if kind in ("scale_swizzled_128x4", "data_alt_signed_zero"):
                continue  # layout / alternative-bytes checks belong to test_golden
            _same(tname, got[kind], t[tname])
            n += 1
    return n


@pytest.mark.parametrize("manifest", CASES, ids=[c.removesuffix(".json") for c in CASES])
def test_rollout_quantizers_match_golden_bytes(manifest):
    from safetensors.torch import load_file

    man = json.loads((GOLDEN_DIR / manifest).read_text())
    t = load_file(str(GOLDEN_DIR / man["file"]))
    x = t[man["input"]["tensor"]]
    checked = 0
    for v in man["variants"]:
        if v["name"] in WEIGHT_ONLY:
            continue
        assert man["format"] in ("mxfp8", "nvfp4", "fp8block"), f"unknown golden format {man['format']}"
        assert v["name"].startswith(("mxfp8_e4m3_1x32", "mxfp8_e5m2_1x32", "mxfp8_e4m3_32x1", "mxfp8_e5m2_32x1",
                                     "nvfp4_1x16_", "fp8block_")), f"unknown variant {v['name']}"
        checked += _check_variant(man["format"], v, t, x)
    assert checked > 0


def test_golden_set_present_or_skip():
    if not GOLDEN_DIR.is_dir():
        pytest.skip(f"golden vectors not found at {GOLDEN_DIR} (set POLICYC_GOLDEN_DIR)")
    assert len(CASES) >= 30


def test_e2m1_coder_ties_and_sign():
    y = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -0.0, 0.26])
    assert rq.e2m1_codes(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 8, 0, 1]
