"""`emit` then `audit` for every shipped policy x bundled model x rollout engine (sglang, vllm): the round trip of
tests/test_audit.py over the models too slow for CI (DeepSeek-V3, Kimi-K2, GLM-4.5-Air, Qwen3-235B: 5-15 s a case).
Each case prints OK (agreement and the recovered trainer plan has the emitted plan's hash), DISAGREE, or why it has
no deployment (the policy does not resolve on the model / a backend refuses it). Exit 1 on any DISAGREE or ERROR.

    python benchmarks/audit_roundtrip.py [--models deepseek-v3,kimi-k2,...]      (~15 min on 2 cores for all)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

MODELS = ["tiny-moe", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2", "glm-4.5-air", "qwen3-8b",
          "qwen3-0.6b", "llama-3.2-1b"]


def main() -> int:
    import test_audit as T
    from precision_dsl.backends.common import UnsupportedByBackend
    from precision_dsl.diagnostics import PolicyError

    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=",".join(MODELS))
    models = ap.parse_args().models.split(",")
    bad = 0
    for m in models:
        for rollout in ("sglang", "vllm"):
            for p in T.POLICIES:
                t0 = time.time()
                try:
                    plan = T.plan_of(p, m)
                except PolicyError:
                    print(f"{m} {rollout} {p}: does not resolve on this model", flush=True)
                    continue
                try:
                    out = T.emitted(plan, Path(tempfile.mkdtemp()) / "out", rollout)
                except UnsupportedByBackend:
                    print(f"{m} {rollout} {p}: refused by a backend", flush=True)
                    continue
                try:
                    res = T.audit([out], T.arch_of(m))
                except Exception as e:  # noqa: BLE001 - reported, counted
                    bad += 1
                    print(f"{m} {rollout} {p}: ERROR {type(e).__name__}: {e}", flush=True)
                    continue
                ok = res.agree and res.trainer.content_hash() == plan.content_hash()
                bad += not ok
                print(f"{m} {rollout} {p}: {'OK' if ok else 'DISAGREE'} ({time.time() - t0:.1f} s)", flush=True)
    print(f"{bad} case(s) disagree or fail")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
