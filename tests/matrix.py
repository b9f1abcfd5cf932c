"""The matrix every engine oracle and the check/emit gate test run over: each shipped policy x the three bundled
model families x parallel layouts (none, an uneven pipeline split, TP+EP). Plans are cached per process so the
oracles and the gate share one resolve per cell."""

from __future__ import annotations

import functools
from pathlib import Path

from conftest import DENSE_RECIPES

REPO = Path(__file__).resolve().parents[1]
POLICIES = sorted(p.stem for p in (REPO / "policies").glob("*.policy") if p.stem not in DENSE_RECIPES)
MODELS = ["tiny-moe", "qwen3-30b-a3b", "deepseek-v3"]
# uneven: 4 layers on pp=3, 48 on pp=5, 61 on pp=4 (none of them divides)
UNEVEN = {"tiny-moe": "trainer:pp=3", "qwen3-30b-a3b": "trainer:pp=5", "deepseek-v3": "trainer:pp=4"}
TP_EP = "trainer:tp=2,ep=4,etp=1 rollout:tp=4,ep=4"
LAYOUTS = ["none", "uneven-pp", "tp-ep"]


def layout(model: str, name: str):
    return {"none": None, "uneven-pp": UNEVEN[model], "tp-ep": TP_EP}[name]


def policy_file(policy: str) -> Path:
    return REPO / "policies" / f"{policy}.policy"


@functools.lru_cache(maxsize=None)
def arch_of(model: str):
    from precision_dsl.arch import load_architecture

    return load_architecture(model)


@functools.lru_cache(maxsize=None)
def _resolved(policy: str, model: str):
    from precision_dsl.resolve import resolve

    return resolve(policy_file(policy), arch_of(model), None)


@functools.lru_cache(maxsize=None)
def plan_of(policy: str, model: str, layout_name: str):
    """resolve() only records the layout in the plan (checks/backends read it), so one resolve per policy x model
    serves every layout (DeepSeek-V3 resolves in ~1-3 s on the CI box)."""
    from precision_dsl.parallel import parse_parallel

    plan = _resolved(policy, model)
    lay = parse_parallel(layout(model, layout_name))
    return plan if lay is None else plan.model_copy(update={"parallel": lay})


def cells():
    return [(p, m, lay) for m in MODELS for p in POLICIES for lay in LAYOUTS]
