"""TransformerEngine's own sources judge the TE side of every Megatron artifact:

* each capability's declared first version (backends/versions.py) is TRUE: present in that release's sources,
  absent in the release before it;
* every NVTE_* variable any emitted env.sh of the shipped policies x layouts exports (the variables depend on the
  policy's formats, not on the model: tiny-moe rows of the matrix; test_megatron_oracle runs the other models) is
  read by the declared minimum TE of that very artifact, and still by the newest release.
Wheels are downloaded once (pip download --no-deps, ~1 MB each) into ~/.cache/policyc-oracles/te."""

from __future__ import annotations

import json

import pytest

import te_oracle as te
from precision_dsl.backends import versions
from matrix import cells, plan_of


def _need(fn, *a):
    try:
        return fn(*a)
    except te.OracleUnavailable as err:  # fail with the reason, never skip
        pytest.fail(str(err))


def _previous(v: str) -> str:
    i = te.RELEASES.index(v)
    assert i > 0, v
    return te.RELEASES[i - 1]


TE_CAPS = {c: v for c, (engine, v) in versions.CAPABILITIES.items() if engine == "transformer-engine"}
ENV_OF = {}
for var, cap in versions.ENV_CAPABILITY.items():
    ENV_OF.setdefault(cap, []).append(var)


@pytest.mark.parametrize("capability", sorted(TE_CAPS))
def test_declared_first_version_is_true(capability):
    v = TE_CAPS[capability]
    if capability in te.BEHAVIOUR:
        assert _need(te.has_behaviour, v, capability), f"{capability} not in TE {v}"
        assert not _need(te.has_behaviour, _previous(v), capability), f"{capability} already in TE {_previous(v)}"
        assert _need(te.has_behaviour, te.NEWEST, capability)
    for var in ENV_OF.get(capability, []):
        assert _need(te.reads_env, v, var), f"{var} is not read by TE {v}"
        assert _need(te.reads_env, te.NEWEST, var), f"{var} is no longer read by TE {te.NEWEST}"
        if capability not in te.BEHAVIOUR and v != te.RELEASES[0]:
            assert not _need(te.reads_env, _previous(v), var), f"{var} is already read by TE {_previous(v)}"


def test_every_exported_nvte_variable_is_read_by_the_declared_minimum():
    from precision_dsl.backends import megatron as mg
    from precision_dsl.backends.common import UnsupportedByBackend

    pairs: dict[tuple[str, str], str] = {}
    for policy, model, lay in cells():
        if model != "tiny-moe":
            continue
        try:
            arts = {a.path: a.content for a in mg.emit(plan_of(policy, model, lay))}
        except UnsupportedByBackend:
            continue
        flags = json.loads(arts["megatron/flags.json"])
        minimum = flags["requires"]["transformer-engine"]
        assert f"transformer-engine>={minimum}" in arts["megatron/env.sh"]
        for var in flags["env"]:
            assert var.startswith("NVTE_"), var
            pairs.setdefault((var, minimum), f"{policy} x {model} x {lay}")
    assert len({v for v, _ in pairs}) >= 5, pairs
    for (var, minimum), where in sorted(pairs.items()):
        assert var in versions.ENV_CAPABILITY, f"{var} ({where}) has no declared capability"
        assert _need(te.reads_env, minimum, var), f"{where}: {var} is not read by TE {minimum}, the declared minimum"
        assert _need(te.reads_env, te.NEWEST, var), f"{where}: {var} is not read by TE {te.NEWEST}"
