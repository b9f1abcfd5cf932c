"""What a finished run leaves behind: metrics.jsonl, summary.json and run.png (used by `policyc run` and `ablate`)."""

from __future__ import annotations

import statistics
from pathlib import Path

# how a run names the formats it emulates (FormatKind values -> the names the docs use)
FORMAT_NAMES = {"fp8": "FP8", "fp8_block": "FP8-block", "mxfp8": "MXFP8", "nvfp4": "NVFP4"}
BLACKWELL_ONLY = ("MXFP8", "NVFP4")


def emulated_note(formats) -> str:
    """`formats`: the names the run quantizes to (emulated_formats), or True when they are not known."""
    if isinstance(formats, bool):
        names, verb, speed = "low-precision formats", "are", "native"
    else:
        names, verb = "/".join(formats), "is" if len(formats) == 1 else "are"
        speed = "Blackwell" if set(formats) <= set(BLACKWELL_ONLY) else "native"
    return (f"numerics: {names} {verb} emulated (bit-exact quantizers -> dequantized operands -> GEMM with fp32 "
            "accumulation: FP32 on CPU, BF16 tensor cores over bf16-exact operands on CUDA); times are NOT "
            f"{speed} speeds")


ROLLOUT_NOTES = {
    "independent": "rollout: its own quantizers + quantized-domain bf16-input/fp32-accumulate GEMMs over the received "
                   "bytes, bf16 model (engine/rollout_gemm.py)",
    "mirror": "rollout: the trainer's reference quantizers and fp32 GEMM (mirror)",
}


def numerics_note(emulated, rollout_numerics: str = "independent", gemm_paths: dict | None = None) -> str:
    """What a run's numbers are: `emulated` = the formats the plan quantizes to (emulated_formats; a BF16 plan has
    none and is not 'emulated'); `gemm_paths` (trainer GEMM calls per path, qlinear.TrainerExecutor.gemm_report)
    says which ran natively (fastgemm.PATH_NOTES)."""
    trainer = emulated_note(emulated) if emulated else "numerics: BF16 (trainer: fp32 model, GEMMs over bf16 operands)"
    if gemm_paths:
        trainer += "; trainer GEMM calls by path: " + ", ".join(f"{k} {v}" for k, v in gemm_paths.items())
        if gemm_paths.get("native-fp8"):
            trainer += " (native-fp8 = FP8 tensor cores via torch._scaled_mm on our quantizers' bytes)"
    return f"{trainer}; {ROLLOUT_NOTES.get(rollout_numerics, rollout_numerics)}"


def plan_is_emulated(plan) -> bool:
    return bool(emulated_formats(plan))


def emulated_formats(plan) -> tuple[str, ...]:
    """The low-precision formats of the plan's weights and activations, by name (FP8-block, MXFP8, ...), in
    FORMAT_NAMES order: what a run's note says it emulates."""
    kinds = {f.kind.value for t in plan.tensors for f in (t.precision.weight, t.precision.activation)
             if f.is_quantized}
    return tuple(name for kind, name in FORMAT_NAMES.items() if kind in kinds)


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
        "model": result.config.model, "resumed_from_step": result.resumed_from_step,
        "gemm_paths": result.gemm_paths,
        "emulated_formats": list(result.emulated) if not isinstance(result.emulated, bool) else None,
        "wall_s": result.wall_s, "note": numerics_note(result.emulated, result.config.rollout_numerics,
                                                        result.gemm_paths),
    }
