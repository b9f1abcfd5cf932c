"""How often an RL step moves a weight's NVFP4 second-level amax: the bet of the weight update's predicted NVFP4
kernel (triton_segments.nvfp4_segment_predicted quantizes with the previous update's group amax and redoes only the
groups whose amax changed; the bytes are exact either way, the share of groups redone is the cost).

    python benchmarks/amax_stability.py --steps 30 --lr 3e-4,1e-6

Runs the embedded RL loop (`policyc run`'s, CPU, tiny-moe, the default NVFP4 policy) and after every optimizer step
takes max|bf16(w)| of every 2-D weight (the routed experts' and the rest separately; the update sends BF16 weights
and NVFP4's amax is taken on them); prints, per learning rate, the share of (tensor, step) pairs whose amax bits
changed since the previous step. lr 3e-4 is this loop's default (a toy task, large steps); 1e-6 is the order of
LLM RL learning rates.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def measure(steps: int, lr: float, seed: int = 0) -> dict:
    import torch

    from precision_dsl.engine.loop import RunConfig, run

    hist: list = []
    orig = torch.optim.AdamW.step
    names: dict = {}

    def step(self, *args, **kwargs):
        out = orig(self, *args, **kwargs)
        with torch.no_grad():
            hist.append({id(p): int(p.detach().to(torch.bfloat16).abs().max().float().view(torch.int32))
                         for g in self.param_groups for p in g["params"] if p.ndim >= 2})
        return out

    torch.optim.AdamW.step = step
    try:
        run(RunConfig(steps=steps, lr=lr, seed=seed))
    finally:
        torch.optim.AdamW.step = orig
    import gc

    for obj in gc.get_objects():  # name the parameters: the trainer is the model the optimizer stepped
        if isinstance(obj, torch.nn.Module) and not names:
            ids = {id(p): n for n, p in obj.named_parameters()}
            if hist and set(hist[0]) <= set(ids):
                names = ids
    rows = {"experts": [0, 0], "other": [0, 0]}
    for a, b in zip(hist, hist[1:]):
        for pid, bits in b.items():
            kind = "experts" if "experts" in names.get(pid, "") else "other"
            rows[kind][0] += bits != a[pid]
            rows[kind][1] += 1
    return {"lr": lr, "steps": steps, "tensors": len(hist[0]) if hist else 0,
            **{k: {"changed": c, "pairs": n, "share": c / n if n else None} for k, (c, n) in rows.items()}}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", default="3e-4,1e-6")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    results = []
    for lr in (float(v) for v in args.lr.split(",")):
        r = measure(args.steps, lr)
        results.append(r)
        print(f"lr {lr:g}: {r['tensors']} weights, {r['steps']} steps: amax changed in "
              + "; ".join(f"{k} {r[k]['changed']}/{r[k]['pairs']} ({(r[k]['share'] or 0):.1%})"
                          for k in ("experts", "other")) + " of (tensor, step) pairs", flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
