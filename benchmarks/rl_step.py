"""RL step time of every seed policy relative to BF16, in one process, plus rollout tokens/s.

    python benchmarks/rl_step.py --device cuda --steps 6 --prompts 64     # H200 (numerics emulated on Hopper)
    python benchmarks/rl_step.py --device cpu --steps 3 --prompts 8       # smoke run

Each config runs `--steps` GRPO steps of the embedded engine (tiny-moe, arithmetic) after `--warmup` steps; the
median per-phase time is reported. MXFP8/NVFP4 are EMULATED (quantize -> dequantize -> FP32 GEMM) on Hopper and
CPU, so the ratios measure the emulation overhead of each contract, NOT Blackwell tensor-core speed-ups.
Writes a JSON report (--out) and prints a table.

`--curves-steps N --curves-seeds S --curves-dir DIR` additionally runs the seed ablation (6 policies + one NVFP4 run
with a broken per-tensor contract) and writes one metrics JSONL per config/seed under DIR, without rich/matplotlib
(the device image may lack them); plot them anywhere with `precision_dsl.engine.plots.plot_ablation`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precision_dsl.engine.plans import SEED_POLICIES  # noqa: E402


def bench(policy: str, device: str, steps: int, warmup: int, prompts: int, samples: int) -> dict:
    from precision_dsl.engine.loop import RunConfig, run

    res = run(RunConfig(policy=policy, steps=warmup + steps, device=device, prompts_per_step=prompts,
                        samples_per_prompt=samples, check_weight_bytes=True))
    ms = res.steps[warmup:]
    med = lambda k: statistics.median(getattr(m, k) for m in ms)  # noqa: E731
    return {
        "policy": policy,
        "rollout_s": med("time_rollout_s"), "train_s": med("time_train_s"),
        "reference_s": med("time_reference_s"), "weight_update_s": med("time_weight_update_s"),
        "step_s": statistics.median(m.time_rollout_s + m.time_train_s + m.time_weight_update_s for m in ms),
        "rollout_tokens_per_s": sum(m.response_tokens for m in ms) / sum(m.time_rollout_s for m in ms),
        "mismatch_abs_logp": statistics.fmean(m.mismatch_abs_logp for m in ms),
        "weights_identical": all(m.quantized_weights_identical is not False for m in ms),
        "update_bytes": ms[-1].weight_update_bytes,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--policies", nargs="*", default=list(SEED_POLICIES))
    ap.add_argument("--out", type=Path, default=Path("rl_step.json"))
    ap.add_argument("--curves-steps", type=int, default=0)
    ap.add_argument("--curves-seeds", type=int, default=2)
    ap.add_argument("--curves-prompts", type=int, default=16)
    ap.add_argument("--curves-dir", type=Path, default=Path("rl_curves"))
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device (hint: --device cpu)")
    env = {"device": torch.cuda.get_device_name() if a.device == "cuda" else f"cpu x{os.cpu_count()}",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "prompts": a.prompts,
           "samples": a.samples, "steps": a.steps, "warmup": a.warmup,
           "note": "MXFP8/NVFP4 emulated (quantize->dequantize->FP32 GEMM); ratios = emulation overhead"}
    rows = []
    t0 = time.time()
    for p in a.policies:
        rows.append(bench(p, a.device, a.steps, a.warmup, a.prompts, a.samples))
        print(f"  {p}: done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    base = next((r for r in rows if r["policy"] == "bf16"), rows[0])
    for r in rows:
        r["step_vs_bf16"] = r["step_s"] / base["step_s"]
        r["train_vs_bf16"] = r["train_s"] / base["train_s"]
        r["rollout_vs_bf16"] = r["rollout_s"] / base["rollout_s"]
    print(f"{env['device']}  ({env['note']})")
    print(f"{'policy':34s} {'step s':>8s} {'xBF16':>6s} {'rollout':>8s} {'train':>8s} {'update':>8s} "
          f"{'tok/s':>8s} {'|dlogp|':>9s} bytes==")
    for r in rows:
        print(f"{r['policy']:34s} {r['step_s']:8.3f} {r['step_vs_bf16']:6.2f} {r['rollout_s']:8.3f} "
              f"{r['train_s']:8.3f} {r['weight_update_s']:8.3f} {r['rollout_tokens_per_s']:8.0f} "
              f"{r['mismatch_abs_logp']:9.2e} {r['weights_identical']}")
    a.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
    print(f"wrote {a.out}")
    if a.curves_steps:
        curves(a)


def curves(a) -> None:
    from precision_dsl.engine.loop import RunConfig, run

    configs = [(p, None) for p in a.policies] + [("nvfp4-pertoken-dequant-backward", "per_tensor")]
    a.curves_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    for policy, broken in configs:
        for seed in range(a.curves_seeds):
            res = run(RunConfig(policy=policy, steps=a.curves_steps, seed=seed, device=a.device,
                                prompts_per_step=a.curves_prompts, broken_contract=broken))
            name = f"{policy}{'__broken-' + broken if broken else ''}__s{seed}.jsonl"
            (a.curves_dir / name).write_text("".join(m.model_dump_json() + "\n" for m in res.steps))
            print(f"  curves {name}: reward {res.steps[0].reward_mean:.2f}->{res.steps[-1].reward_mean:.2f} "
                  f"({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
