"""policyc's verl worker extension (precision_dsl/engine/verl_worker.py) on the bytes: the BF16 weights verl's sync
sends, in verl's buckets (a share-scale group split across buckets, out of order), become exactly what
`policyc convert --rollout vllm` writes under vLLM's names (the vLLM live update's pairs,
backends/weight_update/vllm_transport.py), and vLLM 0.33's own model (built on the CPU from the vllm backend's
serving args, tests/oracles/vllm_loader.py) loads them into every parameter byte for byte."""

from __future__ import annotations

import json

import pytest
import torch

from oracles import vllm_loader
from precision_dsl.backends.weight_update import vllm_named_tensors
from precision_dsl.engine import verl_worker as vw
from test_weight_update_vllm import config_of, converted, engine_args, hf_weights, plan_of

CASES = [("miles-nvfp4", "deepseek-v3-mini"), ("nvfp4-pertoken-hp-backward", "tiny-moe"),
         ("fp8-blockwise-hopper", "deepseek-v3-mini")]


def _verl_buckets(weights: dict, size: int = 7) -> list[list[tuple[str, torch.Tensor]]]:
    """verl's sync in buckets of `size` tensors, last tensor first: every share-scale group arrives split."""
    items = list(reversed(list(weights.items())))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _bytes(x: torch.Tensor) -> bytes:
    return x.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("policy,model", CASES)
def test_extension_loads_the_converters_bytes_into_vllm(policy, model, tmp_path_factory, vllm_033):
    root = tmp_path_factory.getbasetemp()
    plan = plan_of(policy, model)
    _, ckpt = converted(policy, model, root)
    expected = dict(vllm_named_tensors(plan, ckpt))
    q = vw.PlanQuantizer(plan, kernel="reference")
    pairs: list = []
    for bucket in _verl_buckets(hf_weights(model, root)):
        pairs += q.feed(bucket)
    q.finish()
    got = dict(pairs)
    assert len(got) == len(pairs) and set(got) == set(expected)
    wrong = [n for n in expected if got[n].dtype != expected[n].dtype or got[n].shape != expected[n].shape
             or _bytes(got[n]) != _bytes(expected[n])]
    assert not wrong, wrong[:5]
    vm = vllm_loader.build(vllm_loader.model_dir(tmp_path_factory.mktemp("cfg"), json.loads(config_of(model))),
                           engine_args(plan), target=plan.target)
    vm.load_weights(pairs)
    assert vllm_loader.mismatches(vm, expected) == []


def test_extension_refuses_what_is_not_the_plans(tmp_path_factory):
    root = tmp_path_factory.getbasetemp()
    plan = plan_of("miles-nvfp4", "deepseek-v3-mini")
    weights = hf_weights("deepseek-v3-mini", root)
    with pytest.raises(vw.VerlWorkerError, match="not a tensor of the plan"):
        vw.PlanQuantizer(plan).feed([("model.layers.99.mlp.gate.weight", torch.zeros(1))])
    half = {n: x for n, x in weights.items() if not n.endswith("up_proj.weight")}
    q = vw.PlanQuantizer(plan, kernel="reference")
    q.feed(half.items())
    with pytest.raises(vw.VerlWorkerError, match="share-scale group is incomplete|did not send"):
        q.finish()
