"""What a finished run leaves behind: metrics.jsonl, summary.json and run.png (used by `policyc run` and `ablate`)."""

from __future__ import annotations

import statistics
from pathlib import Path

EMULATED_NOTE = ("numerics: MXFP8/NVFP4 are emulated (bit-exact quantizers -> dequantized operands -> GEMM with fp32 "
                 "accumulation: FP32 on CPU, BF16 tensor cores over bf16-exact operands on CUDA); times are NOT "
                 "Blackwell speeds")
ROLLOUT_NOTES = {
    "independent": "rollout: its own quantizers + quantized-domain bf16-input/fp32-accumulate GEMMs over the received "
                   "bytes, bf16 model (engine/rollout_gemm.py)",
    "mirror": "rollout: the trainer's reference quantizers and fp32 GEMM (mirror)",
}


def numerics_note(emulated: bool, rollout_numerics: str = "independent", gemm_paths: dict | None = None) -> str:
    """What a run's numbers are: a BF16 plan is not 'emulated' (nothing is quantized); `gemm_paths` (trainer GEMM
    calls per path, qlinear.TrainerExecutor.gemm_report) says which ran natively (fastgemm.PATH_NOTES)."""
    trainer = EMULATED_NOTE if emulated else "numerics: BF16 (trainer: fp32 model, GEMMs over bf16 operands)"
    if gemm_paths:
        trainer += "; trainer GEMM calls by path: " + ", ".join(f"{k} {v}" for k, v in gemm_paths.items())
        if gemm_paths.get("native-fp8"):
            trainer += " (native-fp8 = FP8 tensor cores via torch._scaled_mm on our quantizers' bytes)"
    return f"{trainer}; {ROLLOUT_NOTES.get(rollout_numerics, rollout_numerics)}"


def plan_is_emulated(plan) -> bool:
    return any(t.precision.weight.is_quantized or t.precision.activation.is_quantized for t in plan.tensors)


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
    model = Path(result.config.model).name
    kind = "emulated numerics" if result.emulated else "BF16"
    plot_run(read_jsonl(out / "metrics.jsonl"), out,
             f"{title} — {model} GRPO ({kind}; rollout numerics: {result.config.rollout_numerics})")
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
        "routing_disagreement_mean": (statistics.fmean(r) if (r := [m.routing_disagreement for m in s
                                                                      if m.routing_disagreement is not None]) else None),
        "routing_replay": result.config.routing_replay, "rollout_numerics": result.config.rollout_numerics,
        "model": result.config.model,
        "gemm_paths": result.gemm_paths,
        "wall_s": result.wall_s, "note": numerics_note(result.emulated, result.config.rollout_numerics,
                                                        result.gemm_paths),
    }
