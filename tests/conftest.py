"""Shared test vocabulary: the seed policies every backend / engine test runs over, written down once here (from
the product card, independently of precision_dsl.engine.plans.SEED_POLICIES, which test_engine_rollout checks
against it). `record_figure(name, figures)` prints a measured figure (cases, mutation points, seconds) as one
`FIGURE name {json}` line and appends it to $POLICYC_FIGURES when set, so benchmarks/RESULTS.md quotes numbers the
suites actually produced (see the commands there)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

# The six seed recipes of the product card: BF16, MXFP8 (three backward modes), NVFP4 per-token (two).
SEED_POLICIES = ("bf16", "mxfp8-e2e", "mxfp8-hp-backward", "mxfp8-dequant-backward", "nvfp4-pertoken-hp-backward",
                 "nvfp4-pertoken-dequant-backward")
# Shipped policies every backend must emit (the others are refused by name: tests/test_emit_shipped.py).
EMITTING_POLICIES = SEED_POLICIES + ("fp8-blockwise-hopper", "miles-nvfp4")
# Shipped recipes for dense models: their `mlp` rule matches nothing on tiny-moe / Qwen3-MoE (no dense MLP layers),
# so the MoE matrices leave them out; tests/test_policies.py and test_emit_shipped.py cover them on dense models.
DENSE_RECIPES = ("mxfp8-dense", "nvfp4-dense")


class StrictCliRunner(CliRunner):
    """typer's CliRunner with catch_exceptions=False by default: an unexpected exception propagates and fails the
    test (a clean user error is typer.Exit -> SystemExit, which the runner still turns into an exit code)."""

    def invoke(self, *args, catch_exceptions: bool = False, **kwargs):
        return super().invoke(*args, catch_exceptions=catch_exceptions, **kwargs)


@pytest.fixture
def record_figure():
    def record(name: str, figures: dict) -> None:
        line = f"FIGURE {name} {json.dumps(figures, sort_keys=True)}"
        print(line)
        path = os.environ.get("POLICYC_FIGURES")
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")

    return record

@pytest.fixture(scope="session")
def sglang_oracle():
    """SGLang 0.5.23 itself (tests/oracles/sglang_oracle.py), loaded once per session. Fails - never skips - with
    the reason when the wheel cannot be downloaded or its code cannot be loaded."""
    from oracles.sglang_oracle import OracleUnavailable, SGLangOracle, fetch_site

    try:
        return SGLangOracle(fetch_site())
    except OracleUnavailable as err:
        pytest.fail(f"SGLang oracle unavailable: {err}", pytrace=False)


def cat_words(path) -> list[str]:
    """The words `cmd $(cat PATH)` hands `cmd`: bash's own word splitting and pathname expansion of the file, run
    in the file's directory (users paste the argv files whole)."""
    import subprocess
    from pathlib import Path

    path = Path(path)
    out = subprocess.run(["bash", "-c", 'printf "%s\\0" $(cat "$1")', "cat_words", path.name], cwd=path.parent,
                         capture_output=True, check=True)
    return out.stdout.decode().split("\0")[:-1]


@pytest.fixture(scope="module")
def vllm_033():
    """vLLM 0.33.0's oracle (tests/oracles/vllm_oracle.py) for one test module; the vLLM process group that models
    built there keep is torn down after the module, so the rest of the session never sees it."""
    from oracles import vllm_loader
    from oracles.vllm_oracle import OracleUnavailable, oracle

    try:
        o = oracle(vllm_loader.VERSION)
    except OracleUnavailable as err:
        pytest.fail(f"vLLM oracle unavailable: {err}", pytrace=False)
    yield o
    with o.sandbox:
        o._teardown_parallel()
