"""megatron-core 0.16.1's own code reads policyc's Megatron artifacts (tests/megatron_oracle.py) for every shipped
policy x {tiny-moe, qwen3-30b-a3b, deepseek-v3} x {no parallelism, uneven PP, TP+EP}: per TE module and per pipeline
rank, format / recipe / FP8 gradient format must be the plan's; the process-wide TE settings (backward mode, NVFP4
activation scale scope and weight blocks, FP8-block scale dtype) must be each quantized module's. A plan the trainer
cannot run is refused by name (tensor + capability); the check/emit gate test makes sure `check` says so first."""

from __future__ import annotations

import pytest

import megatron_oracle as mo
from matrix import MODELS, arch_of, cells, plan_of

try:
    mo.load()
    LOAD_ERROR = None
except mo.OracleUnavailable as err:  # fail every test with the reason, never skip
    LOAD_ERROR = str(err)


def _env(text: str) -> dict[str, str]:
    return dict(line[len("export "):].split("=", 1) for line in text.splitlines() if line.startswith("export "))


@pytest.mark.parametrize("model", MODELS)
def test_megatron_core_runs_the_plan(model, tmp_path):
    if LOAD_ERROR:
        pytest.fail(LOAD_ERROR)
    from precision_dsl.backends import megatron as mg
    from precision_dsl.engine.gate import run_gate

    arch = arch_of(model)
    checked = refused = 0
    for policy, m, lay in cells():
        if m != model:
            continue
        plan = plan_of(policy, model, lay)
        where = f"{policy} x {model} x {lay}"
        # the check/emit gate with the Megatron backend: static checks + this emitter, every problem named
        res = run_gate(plan, arch, ["megatron"])
        if not res.ok():
            assert all(d.tensor and d.message for d in res.errors()), where
            refused += 1
            continue
        arts = {a.path: a for a in res.artifacts}
        d = tmp_path / policy / lay
        d.mkdir(parents=True)
        for p, a in arts.items():
            if p.endswith(".yaml"):
                (d / p.split("/")[-1]).write_text(a.content)
        flags = mg.read_args(arts["megatron/args.txt"].content)
        assert plan.content_hash() in arts["megatron/flags.json"].content, where
        config = mo.build_config(arch, flags, d)  # megatron-core's own validation runs here
        expected = mo.plan_modules(plan)
        got = mo.read_modules(config, sorted(expected))
        wrong = {mod: (got[mod][1], mo.plan_reading(ts[0])) for mod, ts in expected.items()
                 if got[mod][1] != mo.plan_reading(ts[0])}
        assert not wrong, f"{where}: megatron-core runs (got, plan) {dict(list(wrong.items())[:4])}"
        # process-wide TE settings as every quantized module sees them
        env = _env(arts["megatron/env.sh"].content)
        for mod, ts in expected.items():
            for t in ts:
                if not t.precision.is_quantized:
                    continue
                assert env.get("NVTE_BACKWARD_OVERRIDE", "quantized") == t.backward.value, (where, mod)
                if t.weight.kind.value == "nvfp4":
                    row = env.get("NVTE_NVFP4_ROW_SCALED_ACTIVATION", "0") == "1"
                    assert row == (t.activation.global_scale == "row"), (where, mod)
                    two_d = env.get("NVTE_NVFP4_DISABLE_2D_QUANTIZATION", "0") == "0"
                    assert two_d == (t.weight.block == (16, 16)), (where, mod)
                    assert env.get("NVTE_NVFP4_DISABLE_RHT") == "1" and \
                        env.get("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING") == "1", (where, mod)
                if t.weight.kind.value == "fp8_block":
                    fp32 = env.get("NVTE_FP8_BLOCK_SCALING_FP32_SCALES", "0") == "1"
                    assert fp32 == ((t.weight.scale_dtype or "fp32") == "fp32"), (where, mod)
        # the emitter's layout is megatron-core's layout
        stages = mo.stages(config)
        assert [[r.start, r.stop] for r in stages] == [[r.start, r.stop] for r in mg.stage_ranges(
            plan.num_layers, plan.parallel.trainer.pp if plan.parallel else 1)], where
        checked += 1
    assert checked >= 20, (checked, refused)


def _jobs(model: str, tmp_path) -> tuple[list, dict]:
    """One megatron_oracle.Job per cell of `model` the Megatron gate accepts, and the plan of each."""
    from precision_dsl.backends import megatron as mg
    from precision_dsl.engine.gate import run_gate

    arch = arch_of(model)
    jobs, plans = [], {}
    for policy, m, lay in cells():
        if m != model:
            continue
        plan = plan_of(policy, model, lay)
        res = run_gate(plan, arch, ["megatron"])
        if not res.ok():
            continue
        arts = {a.path: a for a in res.artifacts}
        d = tmp_path / model / policy / lay
        d.mkdir(parents=True)
        for p, a in arts.items():
            if p.endswith(".yaml"):
                (d / p.split("/")[-1]).write_text(a.content)
        key = f"{policy} x {model} x {lay}"
        jobs.append(mo.Job(key, model, mg.read_args(arts["megatron/args.txt"].content), str(d),
                           sorted(mo.plan_modules(plan))))
        plans[key] = plan
    return jobs, plans


@pytest.mark.parametrize("version", [v for v in mo.VERSIONS if v != mo.MEGATRON_CORE_VERSION])
def test_newer_megatron_core_agrees(version, tmp_path):
    """megatron-core `version` (its own wheel, its own process) runs every accepted cell as the plan says, module by
    module and rank by rank, exactly as the installed 0.16.1 does: the `megatron-core>=0.16.0` every Megatron artifact
    declares holds for it too."""
    if LOAD_ERROR:
        pytest.fail(LOAD_ERROR)
    from precision_dsl.backends import megatron as mg

    jobs, plans = [], {}
    for model in MODELS:
        j, p = _jobs(model, tmp_path)
        jobs += j
        plans.update(p)
    newer = mo.judge_in_process(jobs, version)
    installed = mo.judge(jobs)
    assert newer.keys() == installed.keys() == plans.keys()
    for key, plan in plans.items():
        assert "error" not in newer[key], f"{key}: megatron-core {version} refuses: {newer[key]['error']}"
        assert newer[key] == installed[key], f"{key}: megatron-core {version} differs from {mo.MEGATRON_CORE_VERSION}"
        want = {mod: mo.plan_reading(ts[0]) for mod, ts in mo.plan_modules(plan).items()}
        got = {mod: mo.Reading(kind, fmt) for mod, (_, kind, fmt) in newer[key]["modules"].items()}
        wrong = {m: (got[m], w) for m, w in want.items() if got[m] != w}
        assert not wrong, f"{key}: megatron-core {version} runs (got, plan) {dict(list(wrong.items())[:4])}"
        assert newer[key]["stages"] == [[r.start, r.stop] for r in mg.stage_ranges(
            plan.num_layers, plan.parallel.trainer.pp if plan.parallel else 1)], key
    assert len(plans) >= 60, len(plans)
