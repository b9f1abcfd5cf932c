"""THE BACKEND INTERFACE (backends/registry.py): the registry is the one list of backends the gate and the CLI read;
every backend records all its problems in a Problems; every backend reads back what it emitted (derive_formats) as
the plan's weight formats; the plan hash and per-plan derived values are cached on the plan instance."""

from __future__ import annotations

import copy
import functools
import pickle
import textwrap
from pathlib import Path

import pytest

from precision_dsl.arch import load_architecture
from precision_dsl.backends.common import Artifact, Problems, UnsupportedByBackend
from precision_dsl.backends.registry import (Backend, EmitOptions, backend_names, backends, get_backend,
                                             register_backend, unregister_backend)
from precision_dsl.resolve import resolve

from conftest import DENSE_RECIPES, StrictCliRunner

REPO = Path(__file__).resolve().parents[1]
SHIPPED = sorted(p.stem for p in (REPO / "policies").glob("*.policy") if p.stem not in DENSE_RECIPES)


@functools.lru_cache(maxsize=None)
def arch_of(name):
    return load_architecture(name)


@functools.lru_cache(maxsize=None)
def plan_of(policy, model="tiny-moe"):
    return resolve(REPO / "policies" / f"{policy}.policy", arch_of(model), None)


def plan_from_text(tmp_path, text, model="tiny-moe"):
    p = tmp_path / "p.policy"
    p.write_text(textwrap.dedent(text))
    return resolve(p, arch_of(model), None)


@pytest.fixture
def dummy_backend():
    @register_backend
    class Dummy(Backend):
        name = "dummy"
        description = "a test backend: one file, and a refusal for NVFP4 plans"

        def emit(self, plan, options, problems):
            for t in plan.quantized():
                if t.weight.kind.value == "nvfp4":
                    problems.add(UnsupportedByBackend(self.name, t.hf_name, "no NVFP4 here"))
            return [Artifact("dummy/out.txt", plan.content_hash() + "\n", "the dummy's file")]

        def derive_formats(self, artifacts, arch):
            return {}

    yield Dummy
    unregister_backend("dummy")


# ---------------------------------------------------------------------------------------------------------------
# the registry
# ---------------------------------------------------------------------------------------------------------------
def test_registry_lists_every_backend_in_emit_order():
    assert backend_names()[:5] == ["megatron", "sglang", "vllm", "converter", "weight_update"]
    for b in backends():
        assert isinstance(b, Backend) and b.name and b.description
        assert get_backend(b.name) is b
    with pytest.raises(KeyError, match="megatron"):
        get_backend("nope")


def test_unknown_backend_is_a_user_error_listing_the_registry_names(tmp_path):
    from precision_dsl.backends.cli import chosen_backends
    from precision_dsl.cli import app
    from precision_dsl.console import UserError

    with pytest.raises(UserError) as ei:
        chosen_backends(["megatron", "nope"])
    assert "unknown backend 'nope'" in str(ei.value)
    assert ei.value.hint == "choose from " + ", ".join(backend_names())
    pol = str(REPO / "policies" / "mxfp8-e2e.policy")
    for cmd in (["check", pol], ["emit", pol, "--out", str(tmp_path / "o")]):
        r = StrictCliRunner().invoke(app, cmd + ["--model", "tiny-moe", "-b", "nope"])
        assert r.exit_code == 2 and "unknown backend" in r.output, r.output
        assert all(n in r.output for n in backend_names()), r.output


def test_a_registered_backend_appears_in_the_gate_and_the_cli(dummy_backend, tmp_path):
    from precision_dsl.backends.cli import backend_help, chosen_backends
    from precision_dsl.cli import app
    from precision_dsl.engine.gate import run_gate

    assert backend_names()[-1] == "dummy" and "dummy" in backend_help()
    assert chosen_backends(["dummy"]) == ["dummy"]
    plan = plan_of("mxfp8-e2e")
    res = run_gate(plan, arch_of("tiny-moe"))
    assert res.ok() and "dummy/out.txt" in {a.path for a in res.artifacts}
    assert {"megatron/flags.json", "sglang/server_args.json"} <= {a.path for a in res.artifacts}
    only = run_gate(plan, arch_of("tiny-moe"), ["dummy"])
    assert [a.path for a in only.artifacts] == ["policyc_plan.json", "dummy/out.txt"]
    refused = run_gate(plan_of("nvfp4-pertoken-hp-backward"), arch_of("tiny-moe"), ["dummy"])
    codes = {d.code for d in refused.errors()}
    assert codes == {"unsupported-by-dummy"} and "no NVFP4 here" in refused.errors()[0].message
    pol = str(REPO / "policies" / "mxfp8-e2e.policy")
    r = StrictCliRunner().invoke(app, ["emit", pol, "--model", "tiny-moe", "-b", "dummy", "--out",
                                       str(tmp_path / "o")])
    assert r.exit_code == 0, r.output
    assert (tmp_path / "o" / "dummy/out.txt").read_text() == plan.content_hash() + "\n"


def test_register_backend_wants_a_named_backend_class():
    class Nameless(Backend):
        pass

    with pytest.raises(TypeError):
        register_backend(Nameless)
    with pytest.raises(TypeError):
        register_backend(object)


# ---------------------------------------------------------------------------------------------------------------
# every backend collects its problems
# ---------------------------------------------------------------------------------------------------------------
def test_sglang_reports_two_different_problems_together(tmp_path):
    from precision_dsl.engine.gate import run_gate

    # lm_head quantized (ParallelLMHead is never quantized) AND NVFP4 without per-token activations: two causes
    plan = plan_from_text(tmp_path, """
        policy "two-problems" {
            target blackwell
            default bf16
            lm_head: mxfp8
            routed_experts: nvfp4 backward=high_precision
        }""")
    problems = Problems()
    assert get_backend("sglang").emit(plan, EmitOptions(), problems) == []
    caps = [e.capability for e in problems.folded()]
    assert any(c.startswith("quantized lm_head") for c in caps), caps
    assert any(c.startswith("NVFP4 activations") for c in caps), caps
    assert any("mixing" in c for c in caps), caps  # mxfp8 + nvfp4 in one checkpoint: a third cause
    res = run_gate(plan, arch_of("tiny-moe"), ["sglang"])
    msgs = [d.message for d in res.errors()]
    assert len(msgs) == len(caps) and all(d.code == "unsupported-by-sglang" for d in res.errors())


def test_every_backend_records_refusals_instead_of_raising():
    plan = plan_of("language-tour")  # refused by every backend
    for b in backends():
        problems = Problems()
        arts = b.emit(plan, EmitOptions(), problems)
        assert problems.items and arts == [], b.name
        assert all(e.backend == b.name for e in problems.items), b.name


def test_emit_options_reach_the_backends():
    plan = plan_of("nvfp4-pertoken-hp-backward")
    problems = Problems()
    get_backend("megatron").emit(plan, EmitOptions(te_version="2.0.0"), problems)
    assert problems.items and all("--te-version is 2.0.0" in e.capability for e in problems.items)
    import json

    small = get_backend("weight_update").emit(plan, EmitOptions(bucket_bytes=1 << 10), Problems())
    big = get_backend("weight_update").emit(plan, EmitOptions(), Problems())
    n_small, n_big = (json.loads(a[0].data())["buckets"] for a in (small, big))
    assert n_small > n_big == 1


# ---------------------------------------------------------------------------------------------------------------
# derive_formats: what each engine reads from its own artifacts is the plan's weight format
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", SHIPPED)
def test_derive_formats_of_own_artifacts_is_the_plan(policy):
    plan = plan_of(policy)
    arch = arch_of("tiny-moe")
    want = {t.hf_name: t.weight.short() for t in plan.tensors if t.is_linear}
    emitted = 0
    for b in backends():
        problems = Problems()
        arts = b.emit(plan, EmitOptions(), problems)
        if problems.items:
            continue  # a refusal: nothing to read back (tests/test_emit_shipped.py names the reasons)
        emitted += 1
        got = b.derive_formats({a.path: a.data() for a in arts}, arch)
        diff = {n: (got.get(n), f) for n, f in want.items() if got.get(n) != f}
        assert not diff, f"{policy}: {b.name} reads {sorted(diff.items())[:3]}"
    assert emitted or policy in ("language-tour", "nvfp4-weight-only")


def test_derive_formats_reads_the_artifacts_not_the_plan():
    from precision_dsl.backends.common import ArtifactError

    arch = arch_of("tiny-moe")
    plan = plan_of("mxfp8-e2e")
    sg = get_backend("sglang")
    arts = {a.path: a.data() for a in sg.emit(plan, EmitOptions(), Problems())}
    import json

    doc = json.loads(arts["sglang/quantization_config.json"])
    doc["quantization_config"]["modules_to_not_convert"].append("model.layers.1.mlp.experts")
    edited = dict(arts, **{"sglang/quantization_config.json": json.dumps(doc).encode()})
    got = sg.derive_formats(edited, arch)
    assert got["model.layers.1.mlp.experts.0.gate_proj.weight"] == "bf16"
    assert got["model.layers.0.mlp.experts.0.gate_proj.weight"] == "mxfp8/e4m3[1x32]"
    for b in backends():
        with pytest.raises(ArtifactError):
            b.derive_formats({}, arch)


# ---------------------------------------------------------------------------------------------------------------
# the plan hash and per-plan caches live on the plan instance
# ---------------------------------------------------------------------------------------------------------------
def test_content_hash_is_cached_on_the_instance_and_not_part_of_it():
    a = resolve(REPO / "policies" / "mxfp8-e2e.policy", arch_of("tiny-moe"), None)
    b = resolve(REPO / "policies" / "mxfp8-e2e.policy", arch_of("tiny-moe"), None)
    h = a.content_hash()
    assert a.content_hash() is h and a == b and hash(a) == hash(b)  # b has no cached hash yet
    assert b.content_hash() == h
    calls = []
    assert a.memo("k", lambda: calls.append(1) or 7) == 7 and a.memo("k", lambda: calls.append(1) or 8) == 7
    assert calls == [1]
    changed = a.model_copy(update={"target": "hopper"})
    assert changed.content_hash() != h and changed.memo("k", lambda: 9) == 9  # a copy starts with no cache
    for other in (copy.deepcopy(a), pickle.loads(pickle.dumps(a))):
        assert other == a and other.memo("k", lambda: 10) == 10 and other.content_hash() == h
