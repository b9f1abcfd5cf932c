"""Checkpoint converter benchmark: `policyc convert` vs a plain safetensors read+write of the same bytes.

    python benchmarks/convert.py [--layers 6 | --shard-gb 2] [--shards 3] [--policies bf16,bf16:buffered,mxfp8-e2e]
                                 [--device cpu|cuda] [--repeat 3] [--no-verify] [--workdir /tmp/policyc-bench]
                                 [--results benchmarks/RESULTS.md]

What it does (all on this machine, same run, warm page cache for both sides):
  1. writes a synthetic multi-shard BF16 Qwen3-MoE checkpoint (hidden 1024, 16 experts x 512, `--layers` layers;
     ~57 MB per layer + 67 MB embeddings/head; `--shard-gb G` picks the layer count that makes each of the
     `--shards` shards ~G GB) with precision_dsl.backends.synthetic;
  2. baselines, the same bytes read and written, no quantization: safetensors.torch.load_file + save_file per shard
     (+ fsync, like the converter; and without fsync), and a raw byte copy of the shard files (16 MB os.read/os.write
     + fsync: what the page cache and the disk allow) -> MB/s of source bytes;
  3. for each policy: precision_dsl.backends.converter.convert(...) -> MB/s of source bytes, and `verify` once
     (unless --no-verify). `POLICY:buffered` runs the converter with POLICYC_DIRECT_IO=0 (page-cache writes
     instead of O_DIRECT);
  4. every measured step runs in a fresh subprocess so its peak RSS (ru_maxrss) is its own; the RSS of a subprocess
     that only imports torch + policyc is reported as the floor. Imports (torch, the quantizers; for cuda the CUDA
     context and the Triton kernels of every (format, shape) the plan quantizes) happen before the clock starts,
     as the baseline imports safetensors/torch before its clock; the warm-up time is reported. Outputs of an
     earlier run are deleted before each run, outside the clock. CPU seconds (user+sys of the measured section,
     all threads) are reported beside wall seconds: on a shared box they move less than wall time.

Goals from the brief: converter throughput >= 0.7x the plain read+write; peak RSS <= 1.5x the largest shard.
`--results` replaces (or appends) only the "## Checkpoint converter" section of that markdown file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
SECTION = "## Checkpoint converter"


def arch_config(layers: int) -> dict:
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 1024,
            "intermediate_size": 2048, "moe_intermediate_size": 512, "num_experts": 16, "num_experts_per_tok": 2,
            "num_hidden_layers": layers, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 128,
            "vocab_size": 16384, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "torch_dtype": "bfloat16",
            "attention_bias": False, "rope_theta": 10000.0}


# ---- steps run in subprocesses -------------------------------------------------------------------------------
class _Clock:
    """Wall and CPU (user+sys, all threads of this process) seconds of the measured section."""

    def __enter__(self):
        self.t, self.c = time.perf_counter(), os.times()
        return self

    def __exit__(self, *exc):
        c = os.times()
        self.seconds = time.perf_counter() - self.t
        self.cpu = (c.user - self.c.user) + (c.system - self.c.system)

    def result(self, **kw) -> dict:
        return {"seconds": self.seconds, "cpu_seconds": self.cpu, **kw}


def _step_floor(_args) -> dict:
    import torch  # noqa: F401

    from precision_dsl.backends import converter  # noqa: F401
    from precision_dsl.formats import quantize  # noqa: F401

    return {}


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _step_plain(args) -> dict:
    from safetensors.torch import load_file, save_file

    src, scratch = Path(args["src"]), Path(args["scratch"])
    scratch.mkdir(parents=True, exist_ok=True)
    with _Clock() as clk:
        for f in sorted(src.glob("*.safetensors")):
            tensors = load_file(str(f))
            save_file(tensors, str(scratch / f.name), metadata={"format": "pt"})
            del tensors
            if args.get("fsync", True):  # the converter fsyncs every shard; so does this baseline
                _fsync(scratch / f.name)
    return clk.result()


def _step_rawcopy(args) -> dict:
    """The shard files copied byte for byte (16 MB reads and writes into one reused buffer) + fsync: no parsing, no
    tensors; the page cache + disk floor of any read+write of these bytes."""
    src, scratch = Path(args["src"]), Path(args["scratch"])
    scratch.mkdir(parents=True, exist_ok=True)
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    with _Clock() as clk:
        for f in sorted(src.glob("*.safetensors")):
            fi = os.open(f, os.O_RDONLY)
            fo = os.open(scratch / f.name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                while True:
                    n = os.readv(fi, [buf])
                    if not n:
                        break
                    w = 0
                    while w < n:
                        w += os.write(fo, view[w:n])
                os.fsync(fo)
            finally:
                os.close(fi)
                os.close(fo)
    return clk.result()


def _warm_kernels(plan, device: str) -> None:
    """Compile / load from Triton's cache the kernels of every (format, shape) the plan quantizes, outside the clock
    (a conversion of a real model runs them thousands of times; the first call's JIT is a fixed cost)."""
    import torch

    from precision_dsl import kernels

    torch.zeros(1, device=device)
    seen = set()
    for t in plan.quantized():
        w = t.precision.weight
        key = (id(w), tuple(t.shape))
        if key in seen or not t.is_linear or len(t.shape) != 2:
            continue
        seen.add(key)
        x = torch.randn(t.shape, dtype=torch.bfloat16, device=device)
        ga = torch.ones((), device=device) if getattr(w, "global_scale", None) == "group" else None
        try:
            kernels.quantize(x, w, axis="row", global_amax=ga)
        except Exception:  # a format the kernels do not take runs the reference; nothing to warm
            pass
    torch.cuda.synchronize()


def _step_convert(args) -> dict:
    import torch  # noqa: F401  (imported before the clock starts, like the baseline's safetensors/torch)

    import precision_dsl.backends.quantize  # noqa: F401
    from precision_dsl import formats, kernels  # noqa: F401
    from precision_dsl.backends import converter, fp8_source  # noqa: F401
    from precision_dsl.arch import load_architecture
    from precision_dsl.resolve import resolve

    src, dst = Path(args["src"]), Path(args["dst"])
    plan = resolve(REPO / "policies" / f"{args['policy']}.policy", load_architecture(str(src)), None)
    device = args.get("device", "cpu")
    warm_s = 0.0
    if device.startswith("cuda"):
        t = time.perf_counter()
        _warm_kernels(plan, device)
        warm_s = time.perf_counter() - t
    prof = None
    if args.get("profile"):  # --profile: where the converter's time goes (top functions by own time)
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    with _Clock() as clk:
        rep = converter.convert(src, plan, dst, force=True, device=device)
    out = clk.result(bytes_out=rep.bytes_out, quantized_tensors=len(plan.quantized()), warmup_seconds=warm_s)
    if prof is not None:
        import io
        import pstats

        prof.disable()
        text = io.StringIO()
        stats = pstats.Stats(prof, stream=text)
        stats.sort_stats("tottime").print_stats(12)
        stats.sort_stats("cumulative").print_stats(18)
        out["profile"] = "\n".join(ln for ln in text.getvalue().splitlines()
                                    if ln.strip() and "Ordered by" not in ln and "List reduced" not in ln)[-5000:]
    return out


def _step_verify(args) -> dict:
    import torch  # noqa: F401

    import precision_dsl.backends.quantize  # noqa: F401
    from precision_dsl import formats, kernels  # noqa: F401
    from precision_dsl.backends import converter, fp8_source  # noqa: F401

    with _Clock() as clk:
        problems = converter.verify(Path(args["dst"]), Path(args["src"]))
    return clk.result(problems=len(problems))


def _step_make(args) -> dict:
    from precision_dsl.backends.synthetic import write_synthetic_checkpoint
    from precision_dsl.arch import load_architecture

    src = Path(args["src"])
    write_synthetic_checkpoint(load_architecture(str(src)), src, shards=args["shards"], seed=0)
    return {}


STEPS = {"make": _step_make, "floor": _step_floor, "plain": _step_plain, "rawcopy": _step_rawcopy,
         "convert": _step_convert, "verify": _step_verify}


def _child(step: str, payload: str) -> None:
    import resource

    out = STEPS[step](json.loads(payload))
    out["max_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    print("RESULT " + json.dumps(out))


def best_of(n: int, step: str, clean: Optional[Path] = None, env: Optional[dict] = None, **payload) -> dict:
    """Fastest of n runs (the machine is shared: the minimum is the least disturbed), max of their peak RSS. `clean`
    (the step's output) is deleted before every run, outside the clock, so no run pays for replacing the last."""
    import shutil

    runs = []
    for _ in range(n):
        if clean is not None:
            shutil.rmtree(clean, ignore_errors=True)
        runs.append(run_step(step, env=env, **payload))
    best = min(runs, key=lambda r: r.get("seconds", 0.0))
    best["max_rss_bytes"] = max(r["max_rss_bytes"] for r in runs)
    best["cpu_min"] = min(r.get("cpu_seconds", 0.0) for r in runs)
    return best


def run_step(step: str, env: Optional[dict] = None, **payload) -> dict:
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""),
               PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run([sys.executable, __file__, "--child", step, json.dumps(payload)], capture_output=True,
                          text=True, env=env, cwd=str(REPO))
    if proc.returncode != 0:
        raise SystemExit(f"step {step} failed:\n{proc.stderr[-3000:]}")
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
    return json.loads(line[len("RESULT "):])


def layers_for(shard_gb: float, shards: int) -> int:
    """Layer count whose synthetic checkpoint splits into `shards` shards of ~`shard_gb` GB (torch-free)."""
    import tempfile

    from precision_dsl.arch import load_architecture

    sizes = []
    for n in (1, 2):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(arch_config(n)))
            sizes.append(sum(t.numel * 2 for t in load_architecture(d).tensors))  # BF16
    per_layer, base = sizes[1] - sizes[0], 2 * sizes[0] - sizes[1]
    return max(1, -(-(int(shard_gb * 1e9) * shards - base) // per_layer))


def warm(path: Path) -> None:
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:
            while fh.read(1 << 24):
                pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--shard-gb", type=float, default=None,
                    help="size each of the --shards shards ~this many GB (overrides --layers)")
    ap.add_argument("--shards", type=int, default=3)
    ap.add_argument("--policies", default="bf16,mxfp8-e2e,nvfp4-pertoken-hp-backward",
                    help="comma-separated; POLICY:buffered = converter with POLICYC_DIRECT_IO=0")
    ap.add_argument("--workdir", default="/tmp/policyc-bench-convert")
    ap.add_argument("--results", default=None, help="markdown file: the run's table is inserted at the top of its "
                                                    "converter section (earlier figures are kept)")
    ap.add_argument("--repeat", type=int, default=3, help="runs per step; the fastest is reported")
    ap.add_argument("--device", default="cpu", help="cpu | cuda: where the converter quantizes (cuda = Triton kernels)")
    ap.add_argument("--no-verify", action="store_true", help="skip `verify` (it re-derives every byte on the CPU)")
    ap.add_argument("--profile", default="", help="POLICY[,POLICY]: one extra profiled convert run of each (cProfile "
                                                  "top functions printed; not part of the figures)")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        _child(*a.child)
        return

    # The parent never imports torch: Linux keeps ru_maxrss across fork+exec, so a big parent would put a floor
    # under every child's peak RSS. The checkpoint is made in a subprocess too.
    import shutil

    layers = layers_for(a.shard_gb, a.shards) if a.shard_gb else a.layers
    work = Path(a.workdir)
    shutil.rmtree(work, ignore_errors=True)
    src = work / "src"
    src.mkdir(parents=True)
    (src / "config.json").write_text(json.dumps(arch_config(layers)))
    t = time.perf_counter()
    run_step("make", src=str(src), shards=a.shards)
    make_s = time.perf_counter() - t
    shard_sizes = [f.stat().st_size for f in sorted(src.glob("*.safetensors"))]
    total, largest = sum(shard_sizes), max(shard_sizes)
    print(f"checkpoint: {layers} layers, {total / 1e6:.0f} MB in {len(shard_sizes)} shards (largest "
          f"{largest / 1e6:.0f} MB), written in {make_s:.0f} s", flush=True)
    warm(src)

    load_before, started = os.getloadavg(), time.gmtime()
    floor = run_step("floor")
    base = []
    for label, step, kw in (("plain safetensors load_file+save_file+fsync", "plain", {"fsync": True}),
                            ("plain safetensors load_file+save_file, no fsync", "plain", {"fsync": False}),
                            ("raw byte copy of the shard files + fsync", "rawcopy", {})):
        warm(src)
        scratch = work / "plain"
        base.append((label, best_of(a.repeat, step, clean=scratch, src=str(src), scratch=str(scratch), **kw)))
        shutil.rmtree(scratch, ignore_errors=True)
        r = base[-1][1]
        print(f"{label}: {r['seconds']:.2f} s (CPU {r['cpu_seconds']:.2f} s), {total / r['seconds'] / 1e6:.0f} MB/s, "
              f"peak RSS {r['max_rss_bytes'] / 1e6:.0f} MB", flush=True)
    rows = []
    for spec in a.policies.split(","):
        pol, _, mode = spec.partition(":")
        env = {"POLICYC_DIRECT_IO": "0"} if mode == "buffered" else None
        dst = work / f"out-{pol}"
        warm(src)
        conv = best_of(a.repeat, "convert", clean=dst, env=env, src=str(src), dst=str(dst), policy=pol,
                       device=a.device)
        print(f"convert {spec}: {conv['seconds']:.2f} s (CPU {conv['cpu_seconds']:.2f} s), "
              f"{total / conv['seconds'] / 1e6:.0f} MB/s = {base[0][1]['seconds'] / conv['seconds']:.2f}x plain, "
              f"peak RSS {conv['max_rss_bytes'] / 1e6:.0f} MB = {conv['max_rss_bytes'] / largest:.2f}x largest shard",
              flush=True)
        if spec in a.profile.split(","):
            shutil.rmtree(dst, ignore_errors=True)
            prof = run_step("convert", env=env, src=str(src), dst=str(dst), policy=pol, device=a.device,
                            profile=True)
            print(f"profile of convert {spec} ({prof['seconds']:.2f} s profiled):\n{prof['profile']}", flush=True)
        ver = None if a.no_verify else best_of(min(a.repeat, 2), "verify", src=str(src), dst=str(dst))
        rows.append((spec, conv, ver))
        shutil.rmtree(dst, ignore_errors=True)

    mb = 1e6
    plain_mbs = total / base[0][1]["seconds"] / mb
    load_after = os.getloadavg()

    def rss(r) -> str:
        return (f"{r['max_rss_bytes'] / mb:.0f} | {r['max_rss_bytes'] / largest:.2f}x | "
                f"{(r['max_rss_bytes'] - floor['max_rss_bytes']) / largest:.2f}x")

    lines = [f"Measured {time.strftime('%Y-%m-%d %H:%M UTC', started)} on {os.uname().nodename.split('.')[0]} "
             f"({os.cpu_count()} cores; load average 1/5 min {load_before[0]:.1f}/{load_before[1]:.1f} before, "
             f"{load_after[0]:.1f}/{load_after[1]:.1f} after), `python benchmarks/convert.py "
             + (f"--shard-gb {a.shard_gb:g}" if a.shard_gb else f"--layers {layers}")
             + f" --shards {a.shards} --device {a.device} --repeat {a.repeat} --policies {a.policies}"
             + (" --no-verify" if a.no_verify else "") + "`. Synthetic BF16 Qwen3-MoE checkpoint: "
             f"{layers} layers, {total / mb:.0f} MB in {len(shard_sizes)} shards (largest {largest / mb:.0f} MB). "
             f"Each step in its own subprocess (peak RSS = its ru_maxrss), fastest of {a.repeat} runs (CPU s: the "
             "fastest run's user+sys, all threads); page cache warm; outputs deleted before each run.", "",
             "| step | wall s | CPU s | source MB/s | vs plain (load+save+fsync) | peak RSS MB | RSS / largest shard "
             "| RSS above import floor / largest shard |",
             "|---|---:|---:|---:|---:|---:|---:|---:|",
             f"| import floor (torch + policyc) | - | - | - | - | {floor['max_rss_bytes'] / mb:.0f} | - | - |"]
    for label, r in base:
        mbs = total / r["seconds"] / mb
        lines.append(f"| {label} | {r['seconds']:.2f} | {r['cpu_seconds']:.2f} | {mbs:.0f} | "
                     f"{mbs / plain_mbs:.2f}x | {rss(r)} |")
    for spec, conv, ver in rows:
        mbs = total / conv["seconds"] / mb
        warm_note = f", kernels warmed {conv['warmup_seconds']:.1f} s before the clock" if conv.get(
            "warmup_seconds") else ""
        lines.append(f"| convert `{spec}` ({conv['quantized_tensors']} quantized tensors, out "
                     f"{conv['bytes_out'] / mb:.0f} MB{warm_note}) | {conv['seconds']:.2f} | "
                     f"{conv['cpu_seconds']:.2f} | {mbs:.0f} | **{mbs / plain_mbs:.2f}x** | {rss(conv)} |")
        if ver is not None:
            lines.append(f"| verify `{spec}` ({ver['problems']} problems) | {ver['seconds']:.2f} | "
                         f"{ver['cpu_seconds']:.2f} | {total / ver['seconds'] / mb:.0f} | - | {rss(ver)} |")
    table = "\n".join(lines) + "\n"
    print(table)
    if a.results:
        path = Path(a.results)
        text = path.read_text() if path.exists() else "# Benchmark results\n\n"
        if SECTION not in text:
            text = text.rstrip("\n") + "\n\n" + SECTION + "\n\n"
        at = text.index(SECTION) + len(SECTION) + 1
        text = text[:at] + "\n" + table + text[at:]
        path.write_text(text)
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
