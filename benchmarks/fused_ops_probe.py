"""Probe: what the engine's fp32 non-GEMM ops cost per trainer micro-batch, and what fused alternatives would cost.

    python3 benchmarks/fused_ops_probe.py --out fused_ops.json     # H200 (is the BF16 step GEMM-bound?)

Shapes are one moe-h3072 micro-batch (2048 sequences x 24 tokens, hidden 3072, 24 heads x 128, 4 KV heads). Each
candidate runs forward + backward; the table gives its median time (CUDA events, after warm-up), its result's max
abs difference from the engine's eager op, and the kernel launches of one forward + backward (torch.profiler).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _time(fn, reps: int = 10) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def _launches(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as p:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in p.events() if e.device_type.name == "CUDA")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, default=Path("fused_ops.json"))
    ap.add_argument("--batch", type=int, default=2048)
    ap.add_argument("--seq", type=int, default=24)
    a = ap.parse_args()
    from precision_dsl.engine import model as M

    dev = "cuda"
    torch.manual_seed(0)
    b, t, h, nh, nkv, d = a.batch, a.seq, 3072, 24, 4, 128
    rows = []

    def case(name, fn, ref_out=None):
        out = fn()
        diff = float((out.detach().float() - ref_out.detach().float()).abs().max()) if ref_out is not None else 0.0
        g = torch.randn_like(out)

        def fb():
            y = fn()
            y.backward(g)

        ms = _time(fb)
        n = _launches(fb)
        rows.append({"op": name, "ms_fwd_bwd": ms, "max_abs_diff": diff, "kernels": n})
        print(f"{name:58s} {ms:8.3f} ms  diff {diff:.2e}  kernels {n}", flush=True)
        return out

    # -- RMSNorm over [B*T, hidden] --------------------------------------------------------------------------------
    x = torch.randn(b * t, h, device=dev, requires_grad=True)
    w = torch.ones(h, device=dev, requires_grad=True)
    eps = 1e-6

    def rms_eager():
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + eps) * w

    ref = case("rmsnorm eager (x * rsqrt(mean(x^2) + eps) * w)", rms_eager)
    case("rmsnorm F.rms_norm", lambda: F.rms_norm(x, (h,), w, eps), ref)
    try:
        comp = torch.compile(rms_eager, dynamic=True)
        case("rmsnorm torch.compile(dynamic)", comp, ref)
    except Exception as e:  # noqa: BLE001
        print("compile failed:", type(e).__name__, str(e)[:300])

    # -- q/k norm + RoPE on [B, H, T, D] (transposed view, as the engine does) -----------------------------------------
    qf = torch.randn(b, t, nh, d, device=dev, requires_grad=True)
    wq = torch.ones(d, device=dev, requires_grad=True)
    pos = torch.arange(t, device=dev)[None].expand(b, t)

    def eager_rope(x):  # RoPE with its tables computed per call, on the [B, H, T, D] view
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        ang = pos.to(torch.float32)[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)[:, None]
        x1, x2 = x[..., : d // 2], x[..., d // 2:]
        return (x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()).to(x.dtype)

    def qnorm_rope_eager():
        var = qf.pow(2).mean(-1, keepdim=True)
        return eager_rope((qf * torch.rsqrt(var + eps) * wq).transpose(1, 2))

    ref = case("q_norm + rope eager (tables per call)", qnorm_rope_eager)
    cos, sin = M.rope_tables(pos, d, 1e6)
    case("q_norm + rope (engine now: F.rms_norm, shared tables, _Rope)",
         lambda: M._rope(F.rms_norm(qf, (d,), wq, eps), cos, sin).transpose(1, 2), ref)

    def qnorm_rope_contig():
        q = F.rms_norm(qf, (d,), wq, eps)
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, device=dev, dtype=torch.float32) / d))
        ang = pos.to(torch.float32)[..., None] * inv
        emb = torch.cat([ang, ang], dim=-1)[:, :, None]  # [B, T, 1, D]
        cos, sin = emb.cos(), emb.sin()
        q1, q2 = q[..., : d // 2], q[..., d // 2:]
        return (q * cos + torch.cat([-q2, q1], dim=-1) * sin).transpose(1, 2)

    case("q_norm (F.rms_norm) + rope in [B,T,H,D]", qnorm_rope_contig, ref)
    try:
        case("q_norm + rope torch.compile(dynamic)", torch.compile(qnorm_rope_eager, dynamic=True), ref)
    except Exception as e:  # noqa: BLE001
        print("compile failed:", type(e).__name__, str(e)[:300])

    # -- attention core -------------------------------------------------------------------------------------------
    q = torch.randn(b, nh, t, d, device=dev, requires_grad=True)
    k = torch.randn(b, nkv, t, d, device=dev, requires_grad=True)
    v = torch.randn(b, nkv, t, d, device=dev, requires_grad=True)
    lens = torch.randint(t // 2, t + 1, (b,), device=dev)
    key_mask = (torch.arange(t, device=dev)[None] >= (t - lens)[:, None]).long()  # left padding

    def att_eager():
        rep = nh // nkv
        kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        qi = torch.arange(t, device=dev)[:, None]
        ki = torch.arange(t, device=dev)[None, :]
        allowed = (ki <= qi)[None, None] & key_mask[:, None, None, :].bool()
        att = (q.float() @ kk.float().transpose(-1, -2)) / math.sqrt(d)
        att = att.masked_fill(~allowed, float("-inf"))
        att = torch.where(allowed.any(-1, keepdim=True), att, torch.zeros_like(att))
        return torch.softmax(att, dim=-1).to(vv.dtype) @ vv

    ref = case("attention eager fp32 (engine)", att_eager)
    valid = key_mask[:, None, :, None].bool()  # query rows that are real tokens

    def att_sdpa(dtype, gqa):
        def fn():
            qi = torch.arange(t, device=dev)[:, None]
            ki = torch.arange(t, device=dev)[None, :]
            allowed = (ki <= qi)[None, None] & key_mask[:, None, None, :].bool()
            allowed = allowed | ~allowed.any(-1, keepdim=True)
            if gqa:
                kk, vv = k, v
            else:
                kk, vv = k.repeat_interleave(nh // nkv, dim=1), v.repeat_interleave(nh // nkv, dim=1)
            y = F.scaled_dot_product_attention(q.to(dtype), kk.to(dtype), vv.to(dtype), attn_mask=allowed,
                                               enable_gqa=gqa)
            return y.float() * valid  # compare real query rows only
        return fn

    for dtype in (torch.float32, torch.bfloat16):
        for gqa in (False, True):
            try:
                case(f"attention SDPA {str(dtype)[6:]} mask gqa={gqa}", att_sdpa(dtype, gqa), ref * valid)
            except Exception as e:  # noqa: BLE001
                print(f"sdpa {dtype} gqa={gqa} failed:", type(e).__name__, str(e)[:300])
    a.out.write_text(json.dumps({"rows": rows, "shape": [b, t, h, nh, nkv, d], "torch": torch.__version__}, indent=1))


if __name__ == "__main__":
    main()
