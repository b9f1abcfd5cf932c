"""What a finished run leaves behind: metrics.jsonl, summary.json and run.png (used by `policyc run` and `ablate`)."""

from __future__ import annotations

from pathlib import Path

EMULATED_NOTE = ("numerics: MXFP8/NVFP4 are emulated (quantize -> dequantize -> FP32 GEMM) with the bit-exact "
                 "reference quantizers; times are NOT Blackwell speeds")


def write_run(result, out: Path) -> dict:
    from .metrics import JsonlWriter, read_jsonl, write_json_atomic
    from .plots import plot_run

    w = JsonlWriter(out / "metrics.jsonl")
    for m in result.steps:
        w.write(m)
    w.close()
    summary = run_summary(result)
    write_json_atomic(out / "summary.json", summary)
    title = f"{result.policy_name}{' [BROKEN ' + result.config.broken_contract + ']' if result.config.broken_contract else ''}"
    plot_run(read_jsonl(out / "metrics.jsonl"), out, title + " — tiny-moe GRPO (emulated numerics)")
    return summary


def run_summary(result) -> dict:
    s = result.steps
    k = max(1, min(10, len(s) // 4))

    def avg(key, xs):
        return sum(getattr(m, key) for m in xs) / max(len(xs), 1)

    return {
        "policy": result.policy_name, "plan_hash": result.plan_hash, "rollout_plan_hash": result.rollout_plan_hash,
        "broken_contract": result.config.broken_contract, "steps": len(s), "seed": result.config.seed,
        "reward_start": avg("reward_mean", s[:k]), "reward_end": avg("reward_mean", s[-k:]),
        "mismatch_abs_logp_mean": avg("mismatch_abs_logp", s), "mismatch_k3_mean": avg("mismatch_k3", s),
        "kl_ref_k3_end": avg("kl_ref_k3", s[-k:]), "grad_spikes": sum(m.grad_spike for m in s),
        "time_rollout_s": sum(m.time_rollout_s for m in s), "time_train_s": sum(m.time_train_s for m in s),
        "time_weight_update_s": sum(m.time_weight_update_s for m in s),
        "rollout_tokens_per_s": sum(m.response_tokens for m in s) / max(sum(m.time_rollout_s for m in s), 1e-9),
        "quantized_weights_identical_every_step": all(m.quantized_weights_identical is not False for m in s),
        "wall_s": result.wall_s, "note": EMULATED_NOTE,
    }
