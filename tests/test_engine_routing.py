"""Routing replay (R3): the rollout records every MoE layer's top-k experts per fed token; the trainer's log-prob
pass can replay them. Checked on the bundled tiny MoE (8 experts, top-2, 4 MoE layers)."""

from __future__ import annotations

import torch

from precision_dsl.engine.model import bundled_model_dir, load_model
from precision_dsl.engine.routing import RoutingRecorder, RoutingReplay
from precision_dsl.engine.sampling import sample, sequence_logprobs


def _batch(model):
    with torch.no_grad():
        rec = RoutingRecorder()
        model.routing = rec
        b = sample(model, [[1, 5, 14, 6, 18], [1, 7, 18]], max_new_tokens=4, eos_id=2, pad_id=0,
                   generator=torch.Generator().manual_seed(0))
        model.routing = None
    b.routing = rec.result()
    return b


def test_recorded_routing_covers_every_fed_token_and_replays_exactly():
    model = load_model(bundled_model_dir("tiny-moe")).eval()
    b = _batch(model)
    fed = b.tokens.shape[1] - 1
    assert len(b.routing) == 4 and all(v.shape == (2, fed, 2) for v in b.routing.values())
    with torch.no_grad():
        own = sequence_logprobs(model, b)
        replay = RoutingReplay(b.routing, b.attention_mask[:, :-1], replay=True)
        model.routing = replay
        replayed = sequence_logprobs(model, b)
        model.routing = None
    assert replay.disagreement() == 0.0  # same model, same numerics: the full forward routes as the sampler did
    assert torch.allclose(own, replayed, atol=1e-5)
    assert torch.allclose(own * b.response_mask, b.logprobs, atol=1e-4)


def test_replay_forces_the_recorded_experts_and_counts_disagreement():
    model = load_model(bundled_model_dir("tiny-moe")).eval()
    b = _batch(model)
    layer = sorted(b.routing)[1]
    forced = dict(b.routing)
    forced[layer] = (b.routing[layer] + 3) % 8  # route every token of one layer to other experts
    with torch.no_grad():
        own = sequence_logprobs(model, b)
        compare = RoutingReplay(forced, b.attention_mask[:, :-1], replay=False)
        model.routing = compare
        same = sequence_logprobs(model, b)
        replay = RoutingReplay(forced, b.attention_mask[:, :-1], replay=True)
        model.routing = replay
        replayed = sequence_logprobs(model, b)
        model.routing = None
    assert torch.equal(own, same)  # compare-only mode leaves the trainer's routing alone
    assert not torch.allclose(own, replayed, atol=1e-4)  # replay really changes which experts compute
    assert 0.2 < replay.disagreement() <= 0.25 + 1e-9  # 1 of 4 MoE layers differs on every real token


def test_run_with_routing_replay_reports_disagreement():
    from precision_dsl.engine.loop import RunConfig, run

    res = run(RunConfig(steps=1, prompts_per_step=4, samples_per_prompt=4, routing_replay=True))
    m = res.steps[0]
    assert m.routing_disagreement is not None and 0 <= m.routing_disagreement < 0.2
    assert m.quantized_weights_identical
