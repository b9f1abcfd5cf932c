"""PNG plots of one run or of an ablation (matplotlib, Agg backend; written atomically)."""

from __future__ import annotations

import os
import statistics
from pathlib import Path
from typing import Sequence

PHASES = (("time_rollout_s", "rollout"), ("time_train_s", "train"), ("time_weight_update_s", "weight update"))


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(xs: Sequence[float], k: int = 10) -> list[float]:
    """Trailing moving average (reward is a Bernoulli mean over one step's samples: noisy)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x
        if i >= k:
            acc -= xs[i - k]
        out.append(acc / min(i + 1, k))
    return out


def _save(fig, path: Path) -> None:
    path = Path(path)
    tmp = path.with_name("." + path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110, bbox_inches="tight")
    os.replace(tmp, path)


def plot_run(records: list[dict], out_dir: Path, title: str) -> list[Path]:
    plt = _plt()
    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(1, 3, figsize=(15, 4))
    ax[0].plot(steps, [r["reward_mean"] for r in records], alpha=0.35, label="per step")
    ax[0].plot(steps, smooth([r["reward_mean"] for r in records]), label="moving avg (10)")
    ax[0].set(title="reward (exact match)", xlabel="step", ylim=(0, 1))
    ax[0].legend()
    ax[1].plot(steps, [r["mismatch_abs_logp"] for r in records], label="mean |Δlogp| train-rollout")
    ax[1].plot(steps, [r["mismatch_k3"] for r in records], label="k3 KL(rollout‖train)")
    ax[1].plot(steps, [r["kl_ref_k3"] for r in records], label="k3 KL(train‖BF16 ref)", linestyle="--")
    ax[1].set(title="mismatch / KL", xlabel="step", yscale="symlog")
    ax[1].set_yscale("symlog", linthresh=1e-6)
    ax[1].legend(fontsize=8)
    bottom = [0.0] * len(steps)
    for key, label in PHASES:
        vals = [r[key] for r in records]
        ax[2].bar(steps, vals, bottom=bottom, label=label, width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals)]
    totals = sorted(bottom)
    if totals:  # a shared CPU produces rare 10x outliers: keep the typical step readable
        ax[2].set_ylim(0, 3 * totals[len(totals) // 2])
    ax[2].set(title="time per phase (s; y clipped at 3x median)", xlabel="step")
    ax[2].legend()
    fig.suptitle(title)
    path = Path(out_dir) / "run.png"
    _save(fig, path)
    plt.close(fig)
    return [path]


def plot_ablation(runs: dict[str, list[list[dict]]], out_path: Path, title: str,
                  mismatch_bound: float | None = None, concurrent: bool = False) -> Path:
    """runs: config label -> list (one per seed) of metric records. Mean curve with min-max band across seeds; every
    panel has its own legend; the documented mismatch bound for consistent contracts is drawn."""
    plt = _plt()
    fig, ax = plt.subplots(1, 3, figsize=(19, 5.2))
    labels = list(runs)
    for label in labels:
        seeds = runs[label]
        n = min(len(s) for s in seeds)
        steps = [r["step"] for r in seeds[0][:n]]
        style = "--" if "broken" in label else "-"
        for i, key in enumerate(("reward_mean", "mismatch_abs_logp")):
            curves = [smooth([r[key] for r in s[:n]]) for s in seeds]
            mean = [sum(c[j] for c in curves) / len(curves) for j in range(n)]
            (line,) = ax[i].plot(steps, mean, style, label=label)
            if len(curves) > 1:
                lo = [min(c[j] for c in curves) for j in range(n)]
                hi = [max(c[j] for c in curves) for j in range(n)]
                ax[i].fill_between(steps, lo, hi, alpha=0.15, color=line.get_color())
    ax[0].set(title="reward (moving avg 10; band = min-max over seeds)", xlabel="step", ylabel="reward")
    ax[1].set(title="train-rollout mismatch: mean |Δlogp| of sampled tokens", xlabel="step")
    ax[1].set_yscale("log")
    if mismatch_bound is not None:
        ax[1].axhline(mismatch_bound, color="k", linestyle=":", linewidth=1.2,
                      label=f"documented bound, consistent contracts ({mismatch_bound:g})")
    ax[0].legend(fontsize=7)
    ax[1].legend(fontsize=7)
    width = 0.8 / len(PHASES)
    for k, (key, name) in enumerate(PHASES):
        vals = []
        for label in labels:
            recs = [r for s in runs[label] for r in s]
            vals.append(statistics.median(r[key] for r in recs) if recs else 0.0)  # one stalled step: not a mean
        ax[2].bar([i + k * width for i in range(len(labels))], vals, width=width, label=name)
    ax[2].set_xticks([i + width for i in range(len(labels))], labels, rotation=30, ha="right", fontsize=7)
    ax[2].set(title="median time per step and phase (s)" + ("\nruns shared the machine: not a speed comparison"
                                                          if concurrent else ""), ylabel="s")
    ax[2].legend(fontsize=7)
    fig.suptitle(title)
    _save(fig, Path(out_path))
    plt.close(fig)
    return Path(out_path)
