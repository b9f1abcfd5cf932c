"""The NVFP4 kernels' element coder and block-scale reciprocal, run on their own, and per-row / per-tensor NVFP4 on
edge-case inputs (ties, subnormals, saturation, signed zeros, K = 7168), against the readable reference.

    TRITON_INTERPRET=1 python tests/kernels_e2m1.py          # one JSON line per case (driven by tests/test_kernels.py)

On the GPU tests/test_kernels.py imports this module and runs the same checks compiled, plus every fp32 bit pattern
through `e2m1_word` and `rcp_rn` (`exhaustive_*`). Under the interpreter NaN is left out (numpy's min/max propagate
it, the GPU's min.f32/max.f32 ignore it) and the fp32 -> e4m3 cast gets the hardware's rule (kernels_interpreted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from precision_dsl.kernels._common import LAUNCH_OPTS, e2m1_code, e2m1_word, rcp_rn  # noqa: E402

BLOCK = 1024


@triton.jit
def _e2m1_probe_kernel(y_ptr, word_ptr, code_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    y = tl.load(y_ptr + offs, mask=m, other=0.0)
    tl.store(word_ptr + offs, e2m1_word(y) & 255, mask=m)
    tl.store(code_ptr + offs, e2m1_code(y), mask=m)


@triton.jit
def _rcp_probe_kernel(x_ptr, rcp_ptr, div_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    x = tl.load(x_ptr + offs, mask=m, other=1.0)
    tl.store(rcp_ptr + offs, rcp_rn(x), mask=m)
    tl.store(div_ptr + offs, tl.math.div_rn(tl.full(x.shape, 1.0, tl.float32), x), mask=m)


def e2m1_probe(y):
    """(low byte of e2m1_word(y), e2m1_code(y)) as int32 tensors, computed by a kernel on y's device."""
    import torch

    word, code = torch.empty(y.shape, dtype=torch.int32, device=y.device), torch.empty(y.shape, dtype=torch.int32,
                                                                                    device=y.device)
    n = y.numel()
    _e2m1_probe_kernel[(triton.cdiv(n, BLOCK),)](y, word, code, n, BLOCK=BLOCK, **LAUNCH_OPTS)
    return word, code


def rcp_probe(x):
    import torch

    r, d = torch.empty_like(x), torch.empty_like(x)
    n = x.numel()
    _rcp_probe_kernel[(triton.cdiv(n, BLOCK),)](x, r, d, n, BLOCK=BLOCK, **LAUNCH_OPTS)
    return r, d


def reference_codes(y):
    import torch

    from precision_dsl.formats import nvfp4

    r, neg = nvfp4.e2m1_round(y.clone())
    return nvfp4.e2m1_codes(r, neg).to(torch.int32)


def e2m1_edge_values(nan: bool):
    """Every E2M1 tie and grid point with its fp32 neighbours, both signs, zeros, subnormals, values past 6, inf
    (and NaN when asked), plus a dense random sweep of [-8, 8]."""
    import torch

    base = [0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0, 8.0, 1e30,
            2.0 ** -126, 2.0 ** -149, 3 * 2.0 ** -140, 2.0 ** -127, float("inf"), 3.4028234663852886e38]
    t = torch.tensor(base, dtype=torch.float32)
    near = torch.cat([t, torch.nextafter(t, torch.full_like(t, float("inf"))),
                      torch.nextafter(t, torch.zeros_like(t))])
    vals = torch.cat([near, -near, torch.linspace(-8, 8, 20001),
                      torch.randn(20000, generator=torch.Generator().manual_seed(5)) * 3])
    if nan:
        vals = torch.cat([vals, torch.tensor([float("nan"), -float("nan")])])
    return vals.contiguous()


def edge_input(m: int, k: int, dtype, seed: int):
    """[m, k] input whose blocks hit the coder's edges: a block of every E2M1 tie scaled so that amax = 6 (enc is
    then exactly 1 when S_enc's block scale is a power of two), saturating rows (block amax past 448 * 6 / S_enc),
    bf16/fp32 subnormals next to normal values, signed zeros, a heavy-tailed row, an all-zero row."""
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * 3
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0,
                         -6.0])
    x[0] = ties.repeat(k // 16)
    if m > 1:
        x[1] = ties.repeat(k // 16) * 2.0 ** -20
    if m > 2:
        x[2] = 0.0
        x[2, 1::3] = -0.0
    if m > 3:
        x[3] = torch.randn(k, generator=g) * 2.0 ** -130  # subnormal
        x[3, ::16] = 1.0
    if m > 4:
        x[4] *= torch.exp(torch.randn(k, generator=g) * 6)
    if m > 5:
        x[5, ::5] = 1e30
    if m > 6:
        x[6] = torch.randn(k, generator=g) * 2.0 ** -140
    return x.to(dtype)


def kernel_checks(x, configs, tensor_configs=None) -> dict:
    """Row-scaled NVFP4 under each launch config, per-tensor under every TENSOR_CONFIGS config (or tensor_configs;
    G given; G computed by each amax config) and 16x16 under every TILE2D_CONFIGS config (G given), vs the
    reference."""
    from precision_dsl.formats import nvfp4
    from precision_dsl.kernels import triton_nvfp4 as kn

    from kernels_interpreted import _same

    out = {}
    ref = nvfp4.quantize(x.cpu(), scope="row")
    for cfg in configs:
        d, s, sd, g = kn.row_scaled(x, **cfg)
        out[f"row {cfg} data"] = _same(d.cpu(), ref.data)
        out[f"row {cfg} scale"] = _same(s.cpu(), ref.scale)
        out[f"row {cfg} S_dec"] = _same(sd.cpu(), ref.global_scale)
        out[f"row {cfg} amax"] = _same(g.cpu(), ref.global_amax)
    reft = nvfp4.quantize(x.cpu(), scope="tensor")
    for cfg in kn.TENSOR_CONFIGS if tensor_configs is None else tensor_configs:
        d, s, sd, g = kn.per_tensor(x, reft.global_amax.to(x.device), **cfg)
        out[f"tensor {cfg} data"], out[f"tensor {cfg} scale"] = _same(d.cpu(), reft.data), _same(s.cpu(), reft.scale)
        out[f"tensor {cfg} S_dec"] = _same(sd.cpu(), reft.global_scale)
    for cfg in kn.AMAX_CONFIGS + (dict(flat_block=1024),):  # the amax pass: flat (even or masked tail) and tiled
        out[f"amax {cfg}"] = _same(kn.tensor_amax(x, **cfg).cpu(), reft.global_amax)
    d, s, sd, g = kn.per_tensor(x)
    out["tensor incl. amax data"], out["tensor incl. amax G"] = _same(d.cpu(), reft.data), _same(g.cpu(),
                                                                                               reft.global_amax)
    if x.shape[0] % 16 == 0:
        ref2 = nvfp4.quantize(x.cpu(), scope="tensor", tile_2d=True)
        for cfg in kn.TILE2D_CONFIGS:
            d, s, sd, g = kn.per_tensor(x, ref2.global_amax.to(x.device), tile_2d=True, **cfg)
            out[f"2d {cfg} data"], out[f"2d {cfg} scale"] = _same(d.cpu(), ref2.data), _same(s.cpu(), ref2.scale)
    return out


# (shape, launch configs of row_scaled): K = 7168 (448 blocks: padded whole row, 7 chunks of 64) and short rows
# (default = 7 chunks of 64 at K = 7168, 2-row tiles at K = 2048; chunk=0 / block_m=1 the whole-row alternatives)
ROW_CASES = [((16, 7168), [{}, dict(chunk=0), dict(chunk=128)]),
             ((32, 2048), [{}, dict(block_m=1), dict(block_m=4, num_warps=4), dict(chunk=64)]),
             ((30, 5120), [{}, dict(chunk=0)]),
             ((16, 96), [{}, dict(chunk=2)])]


def run_interpreted() -> None:
    import torch

    import kernels_interpreted as ki

    ki.exact_fp8_cast()
    ki.exact_bf16_widening()
    y = e2m1_edge_values(nan=False)
    word, code = e2m1_probe(y)
    want = reference_codes(y)
    print(json.dumps({"case": "e2m1_word", "checks": {"word == reference": bool(torch.equal(word, want)),
                                                      "code == reference": bool(torch.equal(code, want))},
                      "n": y.numel()}), flush=True)
    xs = torch.cat([e2m1_edge_values(nan=False).abs(), torch.tensor([0.0, 2.0 ** -149, 2.0 ** -127, 2.0 ** 126,
                                                                      2.0 ** 127, 3.0e38])])
    r, d = rcp_probe(xs)
    print(json.dumps({"case": "rcp_rn", "checks": {"rcp == div": bool(torch.equal(r.view(torch.int32),
                                                                                   d.view(torch.int32)))}}),
          flush=True)
    from precision_dsl.kernels import triton_nvfp4 as kn

    # the packed-block-max rows (packed=True) only on the short rows here: the interpreter runs max.bf16x2's model
    # once per block and reduction step (~4 minutes more at K = 2048..7168); tests/kernels_interpreted.py's
    # nvfp4_tensor_packed cases and the GPU tests cover them further
    unpacked = tuple(cfg for cfg in kn.TENSOR_CONFIGS if not cfg.get("packed"))
    for (m, k), cfgs in ROW_CASES:
        for dtype in (torch.bfloat16, torch.float32):
            x = edge_input(m, k, dtype, seed=m * 7 + k)
            checks = kernel_checks(x, cfgs, None if m * k <= 4096 else unpacked)
            print(json.dumps({"case": f"{m}x{k} {dtype}", "checks": checks}), flush=True)


if __name__ == "__main__":
    run_interpreted()
