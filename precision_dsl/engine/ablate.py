"""`policyc ablate`: several policies x seeds (+ optionally one broken-contract run) -> one figure + a table, like the
MXFP8/NVFP4 RL blog's ablation (reward per config, mismatch per config, phase times)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Optional, Sequence

from rich.console import Console
from rich.table import Table

from .loop import RunConfig, run
from .metrics import read_jsonl, write_json_atomic
from .plans import DEFAULT_POLICY, policy_path
from .plots import plot_ablation
from .report import EMULATED_NOTE, run_summary, write_run


def _label(policy: str, broken: Optional[str]) -> str:
    name = policy_path(policy).stem
    return f"{name} (broken {broken})" if broken else name


def ablate(policies: Sequence[str], *, seeds: int, steps: int, out: Path, broken_contract: Optional[str] = None,
           device: str = "cpu", prompts: int = 16, lr: float = 3e-4, quiet: bool = False) -> dict:
    con = Console(stderr=True, highlight=False, quiet=quiet, markup=False)
    configs: list[tuple[str, Optional[str]]] = [(p, None) for p in policies]
    if broken_contract:
        nvfp4 = [p for p in policies if "nvfp4" in p]
        target = next((p for p in nvfp4 if DEFAULT_POLICY in p), nvfp4[0] if nvfp4 else policies[-1])
        configs.append((target, broken_contract))
    runs: dict[str, list[list[dict]]] = {}
    summaries: dict[str, list[dict]] = {}
    for policy, broken in configs:
        label = _label(policy, broken)
        for seed in range(seeds):
            cfg = RunConfig.checked(None, policy=policy, steps=steps, seed=seed, device=device,
                                    prompts_per_step=prompts, lr=lr, broken_contract=broken)
            con.print(f"{label} seed {seed}: {steps} steps", markup=False)
            res = run(cfg)
            run_dir = out / (label.replace(" (broken ", "__broken-").replace(")", "") + f"-s{seed}")
            run_dir.mkdir(parents=True, exist_ok=True)
            write_run(res, run_dir)
            runs.setdefault(label, []).append(read_jsonl(run_dir / "metrics.jsonl"))
            summaries.setdefault(label, []).append(run_summary(res))

    fig = plot_ablation(runs, out / "ablation.png", f"tiny-moe GRPO ablation ({seeds} seed(s), {steps} steps; "
                                                   "emulated numerics)")
    rows = []
    table = Table(title="final reward (mean of last steps) and train-rollout mismatch")
    for col in ("config", "reward start", "reward end mean±std", "mean |Δlogp|", "k3 KL(rollout‖train)",
                "KL vs BF16 ref", "grad spikes", "s/step"):
        table.add_column(col)
    for label, ss in summaries.items():
        ends = [s["reward_end"] for s in ss]
        row = {
            "config": label,
            "reward_start": statistics.fmean(s["reward_start"] for s in ss),
            "reward_end_mean": statistics.fmean(ends),
            "reward_end_std": statistics.stdev(ends) if len(ends) > 1 else 0.0,
            "mismatch_abs_logp": statistics.fmean(s["mismatch_abs_logp_mean"] for s in ss),
            "mismatch_k3": statistics.fmean(s["mismatch_k3_mean"] for s in ss),
            "kl_ref_k3_end": statistics.fmean(s["kl_ref_k3_end"] for s in ss),
            "grad_spikes": sum(s["grad_spikes"] for s in ss),
            "s_per_step": statistics.fmean((s["time_rollout_s"] + s["time_train_s"] + s["time_weight_update_s"])
                                           / max(s["steps"], 1) for s in ss),
        }
        rows.append(row)
        table.add_row(label, f"{row['reward_start']:.3f}", f"{row['reward_end_mean']:.3f}±{row['reward_end_std']:.3f}",
                      f"{row['mismatch_abs_logp']:.2e}", f"{row['mismatch_k3']:.2e}", f"{row['kl_ref_k3_end']:.2e}",
                      str(row["grad_spikes"]), f"{row['s_per_step']:.2f}")
    out_con = Console(highlight=False, quiet=quiet, markup=False)
    if not out_con.is_terminal:
        out_con.width = 160  # logs: do not squeeze the table to 80 columns
    out_con.print(table)
    con.print(EMULATED_NOTE)
    result = {"seeds": seeds, "steps": steps, "rows": rows, "figure": str(fig)}
    write_json_atomic(out / "ablation.json", result)
    con.print(f"wrote {fig} and {out / 'ablation.json'}")
    return result
