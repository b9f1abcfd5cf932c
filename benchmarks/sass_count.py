"""SASS instructions per input element of the NVFP4 quantize kernels (and, to compare, the flat / 2-D rowwise MXFP8
and FP8-block 1x128 kernels: --kernels mxfp8flat,mxfp8row,fp8block), without a GPU (the issue-bound kernels' proxy).

    python benchmarks/sass_count.py [--shapes 16384x7168,8192x2048] [--kernels row,tensor,2d,amax,tensorpdl]
                                    [--opcodes]
                                    [--variant 'row:chunk=64,num_warps=2' ...] [--tables] [--json OUT.json]

--tables: every launch config of triton_nvfp4's ROW_CONFIGS / TENSOR_CONFIGS / TILE2D_CONFIGS / AMAX_CONFIGS of
the --kernels kinds (the rows benchmarks/quantize.py measures), instead of their defaults alone.

Each host wrapper of precision_dsl/kernels/triton_nvfp4.py is called on `meta` tensors of the shape with its
kernels swapped for recorders, so the launch configuration (grid, constexprs, num_warps, LAUNCH_OPTS) is exactly the
one the wrapper would launch. Each recorded launch is compiled offline for sm_90 (triton.compile with
GPUTarget("cuda", 90, 32): ptxas ships with triton) and disassembled with triton's own cuobjdump/nvdisasm.

Reported per launch: instructions of the main body (the kernel's code up to its last EXIT; the out-of-line slow
paths of IEEE division that ptxas emits after it, reached by CALL only for operands near the fp32 range ends, are
counted apart as "cold"), elements per thread (real elements M*K / programs / threads: padding lanes count as
waste), main / element, and with --opcodes the main body by opcode class. A kernel with a loop over a kernel
argument (a backward branch) is marked "loop": its static count is one trip's, not a program's.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# opcode (before the first '.') -> class; anything else is "other"
CLASSES = {
    "mem": "LDG STG LD ST LDS STS LDC LDSM RED ATOM ATOMG ATOMS LDGSTS ULDC",
    "int": "IADD3 IADD IMAD IMAD.WIDE LOP3 LOP SHF SHL SHR LEA LEA.HI PRMT ISETP IMNMX SEL IABS BFE BFI FLO POPC "
           "VIADD VIMNMX IMNMX.U32 BMSK SGXT",
    "fp32": "FADD FMUL FFMA FMNMX FSETP FSEL FCHK MUFU FSET",
    "cvt": "F2F F2FP I2F F2I I2FP F2IP FRND",
    "move": "MOV UMOV S2R S2UR CS2R R2UR MOVM P2R R2P PLOP3 VOTE VOTEU",
    "shfl": "SHFL",
    "ctrl": "BRA EXIT CALL RET BAR BSSY BSYNC WARPSYNC NOP YIELD DEPBAR MEMBAR",
}
OPCLASS = {op: cls for cls, ops in CLASSES.items() for op in ops.split()}
_INSN = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)")


def opcode_class(op: str) -> str:
    base = op.split(".")[0]
    return OPCLASS.get(base, OPCLASS.get(op, "other"))


def parse_sass(text: str) -> list[tuple[int, str, str]]:
    """[(address, opcode, line)] of the first function in cuobjdump -sass output."""
    out = []
    for line in text.splitlines():
        m = _INSN.search(line)
        if m:
            out.append((int(m.group(1), 16), m.group(3), line))
    return out


_BRA = re.compile(r"BRA\s+(?:`?\(?!?U?P\w+\)?,\s*)?0x([0-9a-f]+)")


def _target(line: str):
    m = _BRA.search(line)
    return int(m.group(1), 16) if m else None


def summarize(insns) -> dict:
    """Main body = up to the last EXIT; the rest (division slow paths after it, trailing NOP/BRA padding) is cold."""
    last_exit = max((i for i, (_, op, _l) in enumerate(insns) if op == "EXIT"), default=len(insns) - 1)
    main, cold = insns[:last_exit + 1], insns[last_exit + 1:]
    cold = [c for c in cold if c[1] != "NOP" and _target(c[2]) != c[0]]  # not the trailing self-branch
    loop = any(op == "BRA" and (_target(line) or addr) < addr for addr, op, line in main)
    by_class = collections.Counter(opcode_class(op) for _, op, _l in main)
    by_op = collections.Counter(op.split(".")[0] for _, op, _l in main)
    calls = sum(1 for _, op, _l in main if op.startswith("CALL"))
    return {"main": len(main), "cold": len(cold), "loop": loop, "calls": calls, "by_class": dict(by_class),
            "by_op": dict(by_op.most_common())}


class _Recorder:
    """Stands in for a @triton.jit kernel: `kernel[grid](*args, **kw)` records the launch instead of running it."""

    def __init__(self, fn, sink):
        self.fn, self.sink = fn, sink

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.sink.append((self.fn, tuple(grid), args, kwargs))
        return launch


@contextlib.contextmanager
def recording(module, sink):
    names = [n for n, v in vars(module).items() if hasattr(v, "arg_names") and hasattr(v, "fn")]
    saved = {n: getattr(module, n) for n in names}
    try:
        for n in names:
            setattr(module, n, _Recorder(saved[n], sink))
        yield
    finally:
        for n, v in saved.items():
            setattr(module, n, v)


def _ptr_type(t) -> str:
    import torch

    return "*" + {torch.int32: "i32", torch.int64: "i64", torch.uint8: "u8", torch.float32: "fp32",
                  torch.int16: "i16", torch.int8: "i8", torch.bfloat16: "bf16", torch.float16: "fp16"}[t.dtype]


def compile_launch(fn, grid, args, kwargs):
    """(compiled kernel, threads per program, programs) of a recorded launch, compiled for sm_90."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    import inspect

    names = fn.arg_names
    bound = {k: p.default for k, p in inspect.signature(fn.fn).parameters.items()
             if p.default is not inspect.Parameter.empty}  # constexprs the launch leaves at their defaults
    bound.update(zip(names, args))
    opts = {k: v for k, v in kwargs.items() if k not in names and k != "launch_pdl"}  # a launch option only
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(names):
        v = bound[name]
        if i in fn.constexprs:
            sig[name] = "constexpr"
            constexprs[name] = v
        elif isinstance(v, torch.Tensor):
            sig[name] = _ptr_type(v)
            attrs[(i,)] = [["tt.divisibility", 16]]  # torch's allocations are 256-byte aligned
        elif isinstance(v, bool):
            sig[name] = "i1"
        elif isinstance(v, int):
            sig[name] = "i64" if abs(v) >= 2 ** 31 else "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {name} of type {type(v).__name__}")
    warps = opts.pop("num_warps", 4)
    options = dict(opts, num_warps=warps)
    c = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    programs = 1
    for g in grid:
        programs *= int(g)
    return c, 32 * warps, programs


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def sass_of(cubin: bytes) -> str:
    return _cuobjdump(cubin, "-sass")


def resources_of(cubin: bytes) -> tuple:
    """(registers per thread, spill stores + loads in bytes) from cuobjdump -res-usage."""
    text = _cuobjdump(cubin, "-res-usage")
    regs = re.search(r"REG:(\d+)", text)
    spill = [int(v) for v in re.findall(r"(?:STACK|LOCAL):(\d+)", text)]
    return (int(regs.group(1)) if regs else None), sum(spill)


# kernel name -> call of the host wrapper (x: meta tensor, cfg: launch-config kwargs) on its kernel module
KERNELS = {
    "row": lambda kn, x, cfg: kn.row_scaled(x, **cfg),
    "tensor": lambda kn, x, cfg: kn.per_tensor(x, _given(x), **cfg),
    "2d": lambda kn, x, cfg: kn.per_tensor(x, _given(x), tile_2d=True, **cfg),
    "amax": lambda kn, x, cfg: kn.tensor_amax(x, **cfg),
    # per-tensor incl. its amax pass, launched as on the H200 (programmatic dependent launch: the quantize kernel
    # holds its tile across griddepcontrol.wait, which is where its registers are counted)
    "tensorpdl": lambda kn, x, cfg: _as_on_hopper(kn, lambda: kn.per_tensor(x, **cfg)),
    # for comparison with the NVFP4 kernels: the weight update's flat rowwise MXFP8 kernel (NaN/Inf counted, as in
    # the update), the 2-D MXFP8 kernel rowwise only, FP8-block 1x128 pow2
    "mxfp8flat": lambda km, x, cfg: km.quantize_rows_flat(x, *_bytes(x), bad=_bad_counter(x), **cfg),
    "mxfp8row": lambda km, x, cfg: km.quantize_rowcol(x, "e4m3", True, False, **cfg),
    "fp8block": lambda kf, x, cfg: kf.quantize(x, "e4m3", False, True, False, **cfg),
}
MODULES = {"mxfp8flat": "triton_mxfp8", "mxfp8row": "triton_mxfp8", "fp8block": "triton_fp8_block"}


def _bytes(x):
    import torch

    m, k = x.shape
    return (torch.empty((m, k), dtype=torch.uint8, device=x.device),
            torch.empty((m, k // 32), dtype=torch.uint8, device=x.device))


def _bad_counter(x):
    import torch

    return torch.zeros((1,), dtype=torch.int32, device=x.device)


def _as_on_hopper(kn, call):
    """call() with the kernel module's use_pdl answering as on an sm_90 device (meta tensors have no device)."""
    saved = kn.use_pdl
    kn.use_pdl = lambda pdl, device: pdl is None or bool(pdl)
    try:
        return call()
    finally:
        kn.use_pdl = saved


def _given(x):
    import torch

    return torch.empty((1,), dtype=torch.float32, device=x.device)


def parse_variant(text: str) -> tuple[str, dict]:
    """'row:chunk=64,num_warps=2' -> ("row", {"chunk": 64, "num_warps": 2})."""
    kind, _, rest = text.partition(":")
    cfg = {}
    for item in filter(None, rest.split(",")):
        k, _, v = item.partition("=")
        cfg[k.strip()] = v.strip() if not v.strip().lstrip("-").isdigit() else int(v)
        if cfg[k.strip()] in ("True", "False", "None"):
            cfg[k.strip()] = {"True": True, "False": False, "None": None}[cfg[k.strip()]]
    return kind, cfg


def count(kind: str, m: int, k: int, cfg: dict, dtype: str = "bfloat16") -> list[dict]:
    import importlib

    import torch

    kn = importlib.import_module(f"precision_dsl.kernels.{MODULES.get(kind, 'triton_nvfp4')}")
    x = torch.empty((m, k), dtype=getattr(torch, dtype), device="meta")
    sink = []
    with recording(kn, sink):
        KERNELS[kind](kn, x, cfg)
    out = []
    for fn, grid, args, kwargs in sink:
        c, threads, programs = compile_launch(fn, grid, args, kwargs)
        s = summarize(parse_sass(sass_of(c.asm["cubin"])))
        regs, local = resources_of(c.asm["cubin"])
        per_thread = m * k / programs / threads
        out.append(dict(kernel=fn.__name__, kind=kind, shape=f"{m}x{k}", cfg=cfg, grid=list(grid), threads=threads,
                        regs=regs, local_bytes=local,
                        elements_per_thread=per_thread, per_element=s["main"] / per_thread, **s))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="16384x7168,8192x2048")
    ap.add_argument("--kernels", default="row,tensor,2d,amax", help="default launch configs of these wrappers")
    ap.add_argument("--variant", action="append", default=[],
                    help="KIND:key=value,... a launch config of one wrapper (repeatable), e.g. row:chunk=64")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--opcodes", action="store_true", help="also print the main body's most frequent opcodes")
    ap.add_argument("--tables", action="store_true", help="every config of the kernel module's tables")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    kinds = list(filter(None, args.kernels.split(",")))
    if args.tables:
        from precision_dsl.kernels import triton_nvfp4 as kn

        table = {"row": kn.ROW_CONFIGS, "tensor": kn.TENSOR_CONFIGS, "tensorpdl": kn.TENSOR_CONFIGS,
                 "2d": kn.TILE2D_CONFIGS, "amax": kn.AMAX_CONFIGS}
        jobs = [(kd, dict(cfg)) for kd in kinds for cfg in table[kd]]
    else:
        jobs = [(kd, {}) for kd in kinds]
    jobs += [parse_variant(v) for v in args.variant]
    rows = []
    print("| shape | wrapper config | kernel | grid | warps | regs (local B) | main SASS | cold | elem/thread | "
          "SASS/elem | by class |")
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---|")
    for s in args.shapes.split(","):
        m, k = (int(v) for v in s.lower().split("x"))
        for kind, cfg in jobs:
            try:
                found = count(kind, m, k, cfg, args.dtype)
            except Exception as e:  # a config that does not compile (e.g. a non-power-of-two chunk) is reported
                print(f"| {s} | {kind} {cfg or 'default'} | failed: {type(e).__name__}: "
                      f"{str(e).strip().splitlines()[-1][:120]} | | | | | | | | |")
                continue
            for r in found:
                rows.append(r)
                cls = " ".join(f"{c}={n}" for c, n in sorted(r["by_class"].items(), key=lambda t: -t[1]))
                loop = " (loop: one trip)" if r["loop"] else ""
                print(f"| {s} | {kind} {cfg or 'default'} | {r['kernel']}{loop} | {'x'.join(map(str, r['grid']))} | "
                      f"{r['threads'] // 32} | {r['regs']} ({r['local_bytes']}) | {r['main']} | {r['cold']} | "
                      f"{r['elements_per_thread']:.1f} | {r['per_element']:.2f} | {cls} |", flush=True)
                if args.opcodes:
                    print("    " + " ".join(f"{op}:{n}" for op, n in list(r["by_op"].items())[:24]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
