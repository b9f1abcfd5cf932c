"""Rollout routing replay (Miles' R3: `--use-rollout-routing-replay` in radixark/miles 31f1ca9
miles/utils/arguments.py).

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
        # counted on the device and read once, when asked (two int() per MoE layer were two host syncs, each draining
        # the GPU queue in the middle of the trainer's forward)
        self._differ: Optional[torch.Tensor] = None
        self._total: Optional[torch.Tensor] = None

    @property
    def differ(self) -> int:
        return 0 if self._differ is None else int(self._differ)

    @property
    def total(self) -> int:
        return 0 if self._total is None else int(self._total)

    def __call__(self, prefix: str, topi: torch.Tensor) -> torch.Tensor:
        rec: Optional[torch.Tensor] = self.recorded.get(prefix)
        if rec is None or rec.shape != topi.shape:
            raise RuntimeError(f"routing replay: no recorded routing of shape {tuple(topi.shape)} for {prefix} "
                               f"(got {None if rec is None else tuple(rec.shape)})")
        rec = rec.to(topi.device)
        same = (rec.sort(-1).values == topi.sort(-1).values).all(-1)
        m = self.mask.to(topi.device)
        d, t = (~same & m).sum(), m.sum()
        self._differ = d if self._differ is None else self._differ + d
        self._total = t if self._total is None else self._total + t
        return rec if self.replay else topi

    def disagreement(self) -> Optional[float]:
        total = self.total
        return self.differ / total if total else None
