"""Reproducible warm start of the bundled tiny Qwen3-MoE: seeded SFT on the arithmetic task.

Writes precision_dsl/models/tiny-moe/model.safetensors (BF16, ~4 MB) so that `policyc run` starts RL from a policy
with non-zero but clearly improvable reward. SFT stops at the first evaluation whose *sampled* (temperature 1)
accuracy reaches --target (default 0.3), so RL has room to climb. Same seed -> same weights (CPU, fp32).

    python examples/warmstart_tiny_moe.py            # ~1-3 min on 2 CPU cores

Other Qwen3-MoE configs (e.g. the H200 ablation's benchmarks/models/moe-48m): `--model-dir DIR` takes config.json +
vocab.json from DIR and writes DIR/model.safetensors (or --out); `--device cuda` trains on a GPU (not bitwise
reproducible there); `--max-seconds` bounds the wall time.
"""

from __future__ import annotations

import argparse
import random
import time
from pathlib import Path

import torch

from precision_dsl.engine.model import Qwen3MoeConfig, Qwen3MoeForCausalLM, bundled_model_dir, save_model
from precision_dsl.engine.sampling import sample
from precision_dsl.engine.task import ArithmeticTask, load_tokenizer


def sft_batch(task, tok, rng, n):
    probs = task.sample(rng, n)
    seqs, loss_from = [], []
    for p in probs:
        prompt = [tok.bos_id] + tok.encode(p.prompt)
        seqs.append(prompt + tok.encode(p.answer) + [tok.eos_id])
        loss_from.append(len(prompt))
    t = max(len(s) for s in seqs)
    ids = torch.full((n, t), tok.pad_id)
    tgt_mask = torch.zeros((n, t))
    att = torch.zeros((n, t), dtype=torch.long)
    for i, (s, k) in enumerate(zip(seqs, loss_from)):
        ids[i, : len(s)] = torch.tensor(s)
        att[i, : len(s)] = 1
        tgt_mask[i, k: len(s)] = 1  # loss on answer + EOS only
    return ids, att, tgt_mask


@torch.no_grad()
def sampled_accuracy(model, task, tok, seed, n=256):
    rng = random.Random(seed)
    probs = task.sample(rng, n)
    g = torch.Generator().manual_seed(seed)
    b = sample(model, [[tok.bos_id] + tok.encode(p.prompt) for p in probs], max_new_tokens=task.max_new_tokens,
               eos_id=tok.eos_id, pad_id=tok.pad_id, generator=g)
    return sum(task.reward(p, tok.decode(r)) for p, r in zip(probs, b.responses())) / n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--digits", type=int, default=2)
    ap.add_argument("--operators", default="+")
    ap.add_argument("--target", type=float, default=0.3, help="stop when sampled accuracy reaches this")
    ap.add_argument("--max-steps", type=int, default=3000)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--eval-every", type=int, default=25)
    ap.add_argument("--model-dir", type=Path, default=bundled_model_dir("tiny-moe"))
    ap.add_argument("--out", type=Path, default=None, help="default: MODEL_DIR/model.safetensors")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--max-seconds", type=float, default=None)
    a = ap.parse_args()

    torch.manual_seed(a.seed)
    if a.device == "cpu":
        torch.use_deterministic_algorithms(True)
    mdir = a.model_dir
    out = a.out or mdir / "model.safetensors"
    cfg = Qwen3MoeConfig.from_file(mdir / "config.json")
    tok = load_tokenizer(mdir)
    task = ArithmeticTask(digits=a.digits, operators=a.operators)
    model = Qwen3MoeForCausalLM(cfg)
    model.reset_parameters(seed=a.seed)
    model.to(a.device)
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0, betas=(0.9, 0.95))
    rng = random.Random(a.seed)
    t0 = time.time()
    acc = 0.0
    for step in range(1, a.max_steps + 1):
        ids, att, tmask = (t.to(a.device) for t in sft_batch(task, tok, rng, a.batch))
        logits = model(ids[:, :-1], attention_mask=att[:, :-1])
        lp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
        loss = -(lp * tmask[:, 1:]).sum() / tmask[:, 1:].sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % a.eval_every == 0:
            acc = sampled_accuracy(model, task, tok, seed=10_000 + a.seed)
            print(f"step {step:5d}  loss {loss.item():.4f}  sampled acc {acc:.3f}  ({time.time() - t0:.0f}s)",
                  flush=True)
            if acc >= a.target or (a.max_seconds and time.time() - t0 > a.max_seconds):
                break
    save_model(model.cpu(), out)
    print(f"wrote {out} (sampled accuracy {acc:.3f} on {task.name}, seed {a.seed}, {time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
