"""Per-step metrics: the record written to metrics.jsonl, the estimators, and gradient-spike detection."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Optional

import torch
from pydantic import BaseModel


class StepMetrics(BaseModel):
    step: int
    reward_mean: float
    reward_std: float
    # train-rollout mismatch on the sampled tokens (trainer full forward vs rollout sampler, same weights)
    mismatch_abs_logp: float  # mean |logp_train - logp_rollout|
    mismatch_k3: float  # k3 estimate of KL(rollout || train)
    kl_ref_k3: float  # k3 estimate of KL(train || BF16 reference policy = frozen initial weights)
    loss: float
    grad_norm: float
    grad_spike: bool
    clip_frac: float
    response_tokens: int
    time_rollout_s: float
    time_train_s: float
    time_reference_s: float
    time_weight_update_s: float
    rollout_tokens_per_s: float
    weight_update_bytes: int
    quantized_weights_identical: Optional[bool] = None  # trainer vs rollout bytes, every quantized tensor
    quantized_weights_differing: int = 0
    # fraction of (real token, MoE layer) pairs whose trainer top-k expert set differs from the rollout's
    routing_disagreement: Optional[float] = None


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> float:
    m = mask.to(x.dtype)
    return float((x * m).sum() / m.sum().clamp(min=1))


def k3(logp_p: torch.Tensor, logp_q: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(p || q) for samples drawn from p: r - 1 - log r with r = q/p (always >= 0)."""
    log_r = (logp_q - logp_p).clamp(-20, 20)
    return log_r.exp() - 1 - log_r


class SpikeDetector:
    """A grad norm is a spike when it exceeds `factor` x the median of the previous `window` norms."""

    def __init__(self, factor: float = 3.0, window: int = 20):
        self.factor, self.window, self.history = factor, window, []

    def __call__(self, norm: float) -> bool:
        hist = sorted(self.history[-self.window:])
        spike = len(hist) >= 5 and (not math.isfinite(norm) or norm > self.factor * hist[len(hist) // 2])
        self.history.append(norm)
        return spike


class JsonlWriter:
    """Appends one JSON object per line, flushed every step (a crashed run keeps its metrics)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w")

    def write(self, record: BaseModel | dict) -> None:
        d = record.model_dump() if isinstance(record, BaseModel) else record
        self._f.write(json.dumps(d) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class StepLog(JsonlWriter):
    """The metrics.jsonl of a resumable run: the first `keep` records of an earlier, interrupted run of it are kept
    (`kept`, as dicts) and the rest dropped (steps after its last checkpoint run again), then every new step is
    appended and flushed."""

    def __init__(self, path: Path, keep: int = 0):
        from .resume import ResumeError

        self.path = Path(path)
        self.kept: list[dict] = []
        if keep:
            try:
                self.kept = [json.loads(line) for line in self.path.read_text().splitlines()[:keep]]
            except (OSError, ValueError) as err:
                raise ResumeError(f"{self.path}: the metrics of the checkpointed steps are unreadable ({err})",
                                  "pass --overwrite to start the run over") from None
            if len(self.kept) < keep or not all(isinstance(d, dict) and d.get("step") == i + 1
                                                for i, d in enumerate(self.kept)):
                raise ResumeError(f"{self.path}: holds {len(self.kept)} of the {keep} checkpointed steps' metrics",
                                  "pass --overwrite to start the run over")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name("." + self.path.name + ".tmp")
        tmp.write_text("".join(json.dumps(d) + "\n" for d in self.kept))
        os.replace(tmp, self.path)
        self._f = open(self.path, "a")


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def write_json_atomic(path: Path, obj) -> None:
    path = Path(path)
    tmp = path.with_name("." + path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)
