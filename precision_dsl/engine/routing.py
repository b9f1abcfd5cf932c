"""Rollout routing replay (Miles' R3, `--use-rollout-routing-replay`; ../shared/research/miles.md section 1.2).

An MoE rollout engine and the trainer compute router logits with different kernels and precisions, so near-ties
between experts can be broken differently: the trainer then scores a token with experts the sampler never used,
and the train-rollout mismatch grows. R3 records the rollout's top-k expert indices for every token and MoE layer
and makes the trainer's log-prob pass use them (gate weights are still the trainer's own softmax probabilities at
those experts, so gradients flow through the router as usual).

`RoutingRecorder` is installed on the rollout model while it samples (prefill + every decode step, appended along
time); `RoutingReplay` is installed on the trainer for its log-prob forward over tokens[:, :-1], which is exactly
the sequence the rollout fed (the last sampled token is never fed). Either way the disagreement between the
trainer's own top-k and the rollout's is counted over real (non-pad) tokens: `disagreement()` = fraction of
(token, MoE layer) pairs whose top-k expert SETS differ.
"""

from __future__ import annotations

from typing import Optional

import torch


class RoutingRecorder:
    def __init__(self):
        self.steps: dict[str, list[torch.Tensor]] = {}

    def __call__(self, prefix: str, topi: torch.Tensor) -> torch.Tensor:
        self.steps.setdefault(prefix, []).append(topi.detach())
        return topi

    def result(self) -> dict[str, torch.Tensor]:
        """prefix -> [B, T_fed, k] expert indices (int64)."""
        return {p: torch.cat(chunks, dim=1) for p, chunks in self.steps.items()}


class RoutingReplay:
    """Replays (replay=True) or only compares against (replay=False) the rollout's recorded routing."""

    def __init__(self, recorded: dict[str, torch.Tensor], mask: torch.Tensor, replay: bool = True):
        self.recorded, self.replay = recorded, replay
        self.mask = mask.bool()
        self.differ = 0
        self.total = 0

    def __call__(self, prefix: str, topi: torch.Tensor) -> torch.Tensor:
        rec: Optional[torch.Tensor] = self.recorded.get(prefix)
        if rec is None or rec.shape != topi.shape:
            raise RuntimeError(f"routing replay: no recorded routing of shape {tuple(topi.shape)} for {prefix} "
                               f"(got {None if rec is None else tuple(rec.shape)})")
        rec = rec.to(topi.device)
        same = (rec.sort(-1).values == topi.sort(-1).values).all(-1)
        m = self.mask.to(topi.device)
        self.differ += int((~same & m).sum())
        self.total += int(m.sum())
        return rec if self.replay else topi

    def disagreement(self) -> Optional[float]:
        return self.differ / self.total if self.total else None
