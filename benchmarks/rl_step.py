"""RL step time of every seed policy (+ fp8-blockwise-hopper) relative to BF16, in one process, plus rollout tokens/s.

    # H200: the hidden-3072 Qwen3-MoE (1024 prompts x 8, trainer micro-batches of 2048 sequences)
    # and the tiny model side by side (benchmarks/device_rl.sh)
    python benchmarks/rl_step.py --device cuda --steps 4 --warmup 1 \
        --model benchmarks/models/moe-h3072:1024:6:2048 --model tiny-moe:64:2 --profile-bf16
    # the larger hidden-4096 MoE (8 experts top-2 x 6144, 2.57B GEMM params; benchmarks/device_s11e.sh)
    python benchmarks/rl_step.py --device cuda --steps 3 --warmup 1 --model benchmarks/models/moe-h4096:512:6:512 \
        --policies bf16 fp8-blockwise-hopper bf16
    # where a step's time goes: kernel time per loop phase, top kernels per phase, host-side syncs
    python benchmarks/rl_step.py ... --profile bf16 fp8-blockwise-hopper --profile-top 20
    python benchmarks/rl_step.py --device cpu --steps 2 --warmup 1 --model tiny-moe:8:2 --policies bf16 mxfp8-e2e
    # A/B of a kernel variant in one run: POLICY+unpacked = per-token NVFP4 block max on fp32 lanes (not packed halves)
    python benchmarks/rl_step.py ... --policies bf16 nvfp4-pertoken-dequant-backward \
        nvfp4-pertoken-dequant-backward+unpacked bf16

`--model NAME[:PROMPTS[:DIGITS[:MICRO]]]` (repeatable): a bundled model or HF config directory, prompts per step (x
`--samples`), the arithmetic task's digits (longer numbers = longer sequences = more tokens per step) and the
sequences per trainer micro-batch (gradient accumulation; default the whole batch). Each
(model, policy) runs `--steps` GRPO steps of the embedded engine after `--warmup` steps; the median per-phase time
is reported. On CUDA the trainer's GEMMs run on tensor cores (engine/fastgemm.py): BF16 operands and bf16-exact
dequantized MXFP8/NVFP4 operands on BF16 tensor cores (the formats stay EMULATED: quantize -> dequantize -> GEMM,
so their ratios measure emulation overhead, NOT Blackwell speed-ups), fp8_block (fp8-blockwise-hopper) as NATIVE
FP8 GEMMs (torch._scaled_mm). Each row reports the trainer's GEMM calls per path and its GEMM TFLOP/s over the
train phase (GEMM FLOPs of forward + backward / train time: near the GPU's peak = GEMM-bound).
Writes a JSON report (--out) and prints a table.

`--curves-steps N --curves-seeds S --curves-dir DIR` additionally runs the seed ablation (6 policies + one NVFP4 run
with a broken per-tensor contract) and writes one metrics JSONL per config/seed under DIR, without rich/matplotlib
(the device image may lack them); plot them anywhere with `precision_dsl.engine.plots.plot_ablation`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from precision_dsl.engine.plans import SEED_POLICIES  # noqa: E402


def _release(device: str) -> None:
    """Free the previous run's models before the next one (the model <-> executor references form cycles that only
    the cyclic GC frees): policies run one after another in one process."""
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


KERNEL_VARIANTS = ("unpacked",)


@contextlib.contextmanager
def _variant(spec: str):
    """`POLICY+unpacked`: that policy with the per-token NVFP4 kernel's block max on fp32 lanes instead of packed
    bf16/fp16 halves (triton_nvfp4.DEFAULT_PACKED = False), for an A/B of the two in one run; the bytes are the
    same either way (tests/test_kernels.py), only the speed differs."""
    policy, _, variant = spec.partition("+")
    if not variant:
        yield policy
        return
    if variant not in KERNEL_VARIANTS:
        raise SystemExit(f"unknown policy variant +{variant} (known: {', '.join(KERNEL_VARIANTS)})")
    from precision_dsl.kernels import triton_nvfp4 as knv

    saved = knv.DEFAULT_PACKED
    knv.DEFAULT_PACKED = False
    try:
        yield policy
    finally:
        knv.DEFAULT_PACKED = saved


def bench(policy: str, device: str, steps: int, warmup: int, prompts: int, samples: int, model: str = "tiny-moe",
          digits: int = 2, micro_batch: Optional[int] = None) -> dict:
    from precision_dsl.engine.loop import RunConfig, run

    _release(device)
    res = run(RunConfig(policy=policy, model=model, digits=digits, steps=warmup + steps, device=device,
                        prompts_per_step=prompts, samples_per_prompt=samples, check_weight_bytes=True,
                        train_micro_batch=micro_batch))
    ms = res.steps[warmup:]
    med = lambda k: statistics.median(getattr(m, k) for m in ms)  # noqa: E731
    flops_per_step = res.train_gemm_flops / len(res.steps)  # same batch shape every step (+- sequence length)
    errors = res.native_fp8_errors  # native FP8 refusals (torch's messages), if any
    if errors:
        print(f"  {policy}: native FP8 refusals: {errors}", file=sys.stderr, flush=True)
    return {
        "policy": policy, "model": model, "prompts": prompts, "digits": digits, "micro_batch": micro_batch,
        "gemm_paths": res.gemm_paths, "rollout_gemm_paths": res.rollout_gemm_paths, "native_fp8_errors": errors,
        "weight_update_path": res.weight_update_path, "train_gemm_tflop_per_step": flops_per_step / 1e12,
        "train_gemm_tflops": flops_per_step / med("time_train_s") / 1e12,
        "rollout_s": med("time_rollout_s"), "train_s": med("time_train_s"),
        "reference_s": med("time_reference_s"), "weight_update_s": med("time_weight_update_s"),
        "step_s": statistics.median(m.time_rollout_s + m.time_train_s + m.time_weight_update_s for m in ms),
        "rollout_tokens_per_s": sum(m.response_tokens for m in ms) / sum(m.time_rollout_s for m in ms),
        "mismatch_abs_logp": statistics.fmean(m.mismatch_abs_logp for m in ms),
        "weights_identical": all(m.quantized_weights_identical is not False for m in ms),
        "update_bytes": ms[-1].weight_update_bytes,
    }


# cuBLAS / cuBLASLt / CUTLASS kernel names; the aten GEMM ops for a CPU profile
GEMM_KERNEL_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "matmul", "aten::mm", "aten::bmm", "aten::addmm")


def profile_step(policy: str, device: str, prompts: int, samples: int, model: str, digits: int,
                 top: int = 0, micro_batch: Optional[int] = None) -> dict:
    """GPU kernel time of ONE RL step (after one warm-up step) by kind: GEMM kernels (cuBLAS/cuBLASLt, incl. the
    FP8 block-scaled ones) vs everything else, against the step's wall time - the evidence for 'GEMM-bound' or not.
    `top` > 0 also lists the `top` most expensive kernels and the host-side CUDA runtime calls that stall (syncs,
    copies), which say where a policy's extra time goes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from precision_dsl.engine.loop import RunConfig, run

    cuda = device == "cuda"
    acts = [ProfilerActivity.CUDA, ProfilerActivity.CPU] if cuda else [ProfilerActivity.CPU]
    prof = profile(activities=acts)
    sync = torch.cuda.synchronize if cuda else (lambda: None)

    def on_step(m):
        if m.step == 1:
            sync()
            prof.start()
        elif m.step == 2:
            sync()
            prof.stop()

    _release(device)
    res = run(RunConfig(policy=policy, model=model, digits=digits, steps=2, device=device, prompts_per_step=prompts,
                        samples_per_prompt=samples, train_micro_batch=micro_batch), on_step=on_step)
    from torch.autograd import DeviceType

    events = list(prof.events())
    # the loop's phase ranges (record_function "policyc.<phase>", nested: reference inside train). A kernel belongs to
    # the innermost range open on the host when it STARTED on the device. The phases end in host syncs except the
    # train phase, whose optimizer-step kernels (launched after its last sync) start while the host is already in
    # the weight update and are counted there (a few ms of multi_tensor_apply kernels).
    ranges = sorted(((e.time_range.start, e.time_range.end, e.name.split(".", 1)[1]) for e in events
                     if e.device_type != DeviceType.CUDA and e.name.startswith("policyc.")), key=lambda r: r[0])

    def phase_of(t0: float) -> str:
        inner = "other"
        for a, b, name in ranges:
            if a > t0:
                break
            if t0 <= b:
                inner = name
        return inner

    by_kernel: dict = {}
    runtime: dict = {}
    for e in events:
        if cuda and e.device_type != DeviceType.CUDA:
            # a CPU op: its device time is the kernels it launched (counted once, below); host stalls are listed
            if e.name.startswith("cuda") and e.name != "cudaLaunchKernel":
                ms, n = runtime.get(e.name, (0.0, 0))
                runtime[e.name] = (ms + e.self_cpu_time_total / 1e3, n + 1)
            continue
        if e.name.startswith("policyc.") or (not cuda and e.cpu_parent is not None
                                               and not e.cpu_parent.name.startswith("policyc.")):
            continue  # CPU profile: the ops directly under a phase range (their children's time is in theirs)
        t = (e.time_range.end - e.time_range.start) / 1e3
        key = (phase_of(e.time_range.start), e.name[:90])
        ms, n = by_kernel.get(key, (0.0, 0))
        by_kernel[key] = (ms + t, n + 1)
    phases: dict = {}
    for (ph, name), (ms, n) in by_kernel.items():
        d = phases.setdefault(ph, {"gemm_ms": 0.0, "other_ms": 0.0, "kernels": []})
        d["gemm_ms" if any(k in name.lower() for k in GEMM_KERNEL_MARKS) else "other_ms"] += ms
        d["kernels"].append((ms, n, name))
    gemm = sum(d["gemm_ms"] for d in phases.values())
    other = sum(d["other_ms"] for d in phases.values())
    m = res.steps[1]
    wall = (m.time_rollout_s + m.time_train_s + m.time_reference_s + m.time_weight_update_s) * 1e3
    out = {"policy": policy, "gemm_kernel_ms": gemm, "other_kernel_ms": other, "step_wall_ms": wall,
           "gemm_share_of_kernel_time": gemm / max(gemm + other, 1e-9),
           "gemm_share_of_wall": gemm / max(wall, 1e-9),
           "phases_ms": {k: 1e3 * getattr(m, f"time_{k}_s") for k in ("rollout", "train", "reference",
                                                                       "weight_update")},
           "kernel_ms_by_phase": {ph: {"gemm_ms": d["gemm_ms"], "other_ms": d["other_ms"]}
                                  for ph, d in sorted(phases.items())}}
    if top:
        out["top_kernels_by_phase"] = {
            ph: [{"ms": ms, "calls": n, "name": k} for ms, n, k in sorted(d["kernels"], reverse=True)[:top]]
            for ph, d in sorted(phases.items())}
        out["runtime_calls"] = [{"cpu_ms": ms, "calls": n, "name": k}
                                for k, (ms, n) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:8]]
    return out


def host_profile_step(policy: str, device: str, prompts: int, samples: int, model: str, digits: int,
                      micro_batch: Optional[int] = None, top: int = 30) -> list[dict]:
    """Python-side time of ONE RL step (after one warm-up step) under cProfile: the functions with the most own
    time, which say where a policy's host overhead goes when its phases wait on the host rather than the GPU."""
    import cProfile
    import pstats

    from precision_dsl.engine.loop import RunConfig, run

    prof = cProfile.Profile()

    def on_step(m):
        if m.step == 1:
            prof.enable()
        elif m.step == 2:
            prof.disable()

    _release(device)
    run(RunConfig(policy=policy, model=model, digits=digits, steps=2, device=device, prompts_per_step=prompts,
                  samples_per_prompt=samples, train_micro_batch=micro_batch), on_step=on_step)
    st = pstats.Stats(prof)
    rows = [{"tottime_ms": tt * 1e3, "cumtime_ms": ct * 1e3, "calls": nc, "fn": f"{Path(f).name}:{ln} {fn}"}
            for (f, ln, fn), (cc, nc, tt, ct, _) in st.stats.items()]
    rows.sort(key=lambda r: -r["tottime_ms"])
    total = sum(r["tottime_ms"] for r in rows)
    print(f"{policy} host profile (one step, cProfile): {total:.0f} ms of Python-side time; top {top} by own time")
    for r in rows[:top]:
        print(f"  {r['tottime_ms']:9.1f} {r['cumtime_ms']:9.1f} {r['calls']:8d}  {r['fn'][:110]}")
    return rows[:top]


def print_profile(name: str, pr: dict) -> None:
    print(f"{pr['policy']} step on {name}, one step profiled: GEMM kernels {pr['gemm_kernel_ms']:.1f} ms, other "
          f"kernels {pr['other_kernel_ms']:.1f} ms, step wall {pr['step_wall_ms']:.1f} ms (GEMMs "
          f"{100 * pr['gemm_share_of_kernel_time']:.0f}% of kernel time, {100 * pr['gemm_share_of_wall']:.0f}% of "
          f"wall); phases ms " + " ".join(f"{k} {v:.0f}" for k, v in pr["phases_ms"].items()), flush=True)
    for ph, d in pr.get("kernel_ms_by_phase", {}).items():
        print(f"  {ph}: GEMM kernels {d['gemm_ms']:.1f} ms, other kernels {d['other_ms']:.1f} ms")
        for k in pr.get("top_kernels_by_phase", {}).get(ph, []):
            print(f"    {k['ms']:8.2f} ms {k['calls']:6d}x  {k['name']}")
    for k in pr.get("runtime_calls", []):
        print(f"    host {k['cpu_ms']:8.2f} ms {k['calls']:6d}x  {k['name']}")


def model_info(model: str) -> dict:
    """Shape summary of a Qwen3-MoE config: parameters in GEMM weights, total and active per token."""
    from precision_dsl.engine.model import Qwen3MoeConfig, resolve_model_dir

    c = Qwen3MoeConfig.from_file(resolve_model_dir(model) / "config.json")
    h, hd = c.hidden_size, c.head_dim
    attn = h * hd * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
    expert = 3 * h * c.moe_intermediate_size
    total = c.num_hidden_layers * (attn + c.num_experts * expert) + h * c.vocab_size
    active = c.num_hidden_layers * (attn + c.num_experts_per_tok * expert) + h * c.vocab_size
    return {"hidden": h, "layers": c.num_hidden_layers, "experts": c.num_experts, "top_k": c.num_experts_per_tok,
            "moe_intermediate": c.moe_intermediate_size, "gemm_params": total, "active_gemm_params": active,
            "summary": f"hidden {h}, {c.num_hidden_layers} layers, {c.num_experts} experts top-{c.num_experts_per_tok} "
                       f"x {c.moe_intermediate_size}, {total / 1e6:.0f}M GEMM params, {active / 1e6:.0f}M active"}


def materialize(model: str, work: Path) -> str:
    """A config-only model directory (benchmarks/models/moe-h3072: config.json + vocab.json) gets a random-weights
    checkpoint (the model's own seeded init, BF16) in a copy under `work`: step time does not depend on the values,
    and the arithmetic task's rewards are then ~0 (say so when reporting)."""
    import shutil

    src = Path(model)
    if not src.is_dir() or any(src.glob("*.safetensors")):
        return model
    dst = work / src.name
    if not (dst / "model.safetensors").exists():
        from precision_dsl.engine.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, save_model

        dst.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file():
                shutil.copy(f, dst / f.name)
        t0 = time.time()
        save_model(Qwen3MoeForCausalLM(Qwen3MoeConfig.from_file(dst / "config.json")), dst / "model.safetensors")
        print(f"  {model}: random-init checkpoint -> {dst} ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    return str(dst)


def _table(env: dict, rows: list, mrows: list, name, prompts: int, digits: int, micro, samples: int) -> None:
    """Ratios against the model's first BF16 row, appended to `rows`, and the printed table."""
    base = next((r for r in mrows if r["policy"] == "bf16"), mrows[0])
    for r in mrows:
        r["step_vs_bf16"] = r["step_s"] / base["step_s"]
        r["train_vs_bf16"] = r["train_s"] / base["train_s"]
        r["rollout_vs_bf16"] = r["rollout_s"] / base["rollout_s"]
    rows += mrows
    info = model_info(name)
    env.setdefault("models", {})[name] = info
    print(f"{env['device']} · {name} ({info['summary']}) · {prompts} prompts x {samples} samples, digits "
          f"{digits}" + (f", trainer micro-batches of {micro} sequences" if micro else "")
          + f" · trainer GEMM {mrows[0]['train_gemm_tflop_per_step']:.2f} TFLOP/step  ({env['note']})")
    print(f"{'policy':32s} {'step s':>7s} {'xBF16':>6s} {'rollout':>7s} {'train':>7s} {'xBF16':>6s} "
          f"{'update':>7s} {'TFLOP/s':>7s} {'tok/s':>7s} {'|dlogp|':>8s} bytes== trainer GEMMs")
    for r in mrows:
        print(f"{r['policy']:32s} {r['step_s']:7.3f} {r['step_vs_bf16']:6.2f} {r['rollout_s']:7.3f} "
              f"{r['train_s']:7.3f} {r['train_vs_bf16']:6.2f} {r['weight_update_s']:7.3f} "
              f"{r['train_gemm_tflops']:7.1f} {r['rollout_tokens_per_s']:7.0f} {r['mismatch_abs_logp']:8.1e} "
              f"{r['weights_identical']!s:7s} {r['gemm_paths']}"
              + ("" if r["weight_update_path"] in ("device", "host") else f" update: {r['weight_update_path']}"),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--policies", nargs="*", default=list(SEED_POLICIES) + ["fp8-blockwise-hopper"])
    ap.add_argument("--model", action="append", default=None, help="NAME[:PROMPTS[:DIGITS[:MICRO]]] (repeatable; "
                    "MICRO = sequences per trainer micro-batch, default the whole batch)")
    ap.add_argument("--out", type=Path, default=Path("rl_step.json"))
    ap.add_argument("--profile-bf16", action="store_true", help="also profile one BF16 step per model (kernel time "
                    "in GEMMs vs the rest)")
    ap.add_argument("--profile", nargs="*", default=[], help="also profile one step of these policies per model "
                    "(kernel time by kind, top kernels, host-side syncs)")
    ap.add_argument("--host-profile", nargs="*", default=[], help="also run one step of these policies per model "
                    "under cProfile and list the Python functions with the most own time")
    ap.add_argument("--profile-top", type=int, default=0, help="with --profile/--profile-bf16: list this many of the "
                    "most expensive kernels")
    ap.add_argument("--work", type=Path, default=Path("/tmp/rl_step_models"), help="random-init checkpoints go here")
    ap.add_argument("--curves-steps", type=int, default=0)
    ap.add_argument("--curves-seeds", type=int, default=2)
    ap.add_argument("--curves-prompts", type=int, default=16)
    ap.add_argument("--curves-dir", type=Path, default=Path("rl_curves"))
    a = ap.parse_args()
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device cuda but no CUDA device (hint: --device cpu)")
    env = {"device": torch.cuda.get_device_name() if a.device == "cuda" else f"cpu x{os.cpu_count()}",
           "torch": torch.__version__, "threads": torch.get_num_threads(), "samples": a.samples, "steps": a.steps,
           "warmup": a.warmup,
           "note": "MXFP8/NVFP4 emulated (quantize->dequantize->GEMM with fp32 accumulation; tensor cores on CUDA); "
                   "fp8_block native FP8 on sm_90; ratios = emulation overhead / native speed"}
    models = []
    for spec in a.model or [f"tiny-moe:{a.prompts}:2"]:
        name, *rest = spec.split(":")
        models.append((materialize(name, a.work), int(rest[0]) if rest else a.prompts,
                       int(rest[1]) if len(rest) > 1 else 2, int(rest[2]) if len(rest) > 2 else None))
    rows = []
    t0 = time.time()
    for name, prompts, digits, micro in models:
        mrows = []
        failed = []
        for p in a.policies:
            try:
                with _variant(p) as policy:
                    row = bench(policy, a.device, a.steps, a.warmup, prompts, a.samples, name, digits, micro)
                row["policy"] = p
                mrows.append(row)
            except Exception as e:  # noqa: BLE001 - one failing policy must not lose the others' numbers
                import traceback

                traceback.print_exc()
                failed.append({"policy": p, "model": name, "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(f"  {name} {p}: FAILED {failed[-1]['error']}", flush=True)
                continue
            print(f"  {name} {p}: done ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
        env.setdefault("failed", []).extend(failed)
        if mrows:  # `--policies` with no names: profiles only
            _table(env, rows, mrows, name, prompts, digits, micro, a.samples)
        for pol in (["bf16"] if a.profile_bf16 else []) + [p for p in a.profile if p != "bf16" or not a.profile_bf16]:
            try:
                pr = profile_step(pol, a.device, prompts, a.samples, name, digits, top=a.profile_top,
                                  micro_batch=micro)
            except Exception as e:  # noqa: BLE001 - the profile is an extra; the table above stands without it
                print(f"{pol} profile failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            env.setdefault("profile", {}).setdefault(name, {})[pol] = pr
            print_profile(name, pr)
        for pol in a.host_profile:
            env.setdefault("host_profile", {}).setdefault(name, {})[pol] = host_profile_step(
                pol, a.device, prompts, a.samples, name, digits, micro_batch=micro)
        a.out.write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")  # after each model: partial runs
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
