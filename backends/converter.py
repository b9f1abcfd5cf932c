"""Checkpoint converter: HF safetensors (BF16/FP16/FP32, or an FP8-block release such as DeepSeek-V3 / Kimi-K2:
E4M3 + weight_scale_inv, see fp8_source.py; single file or sharded) -> the quantized HF checkpoint SGLang 0.5.23 /
vLLM load, with exactly the tensors the plan quantizes.

The checkpoint is written for one rollout engine (`rollout`, `policyc convert --rollout`, default sglang): its
tensor names (backends/quantize.py DIALECT + ROLLOUT_SUFFIXES) and its quantization_config come from that engine's
backend (sglang.py / vllm.py), so the checkpoint and the server flags can never disagree. For SGLang:
  * mxfp8     -> config.json quantization_config {quant_method: mxfp8, weight_block_size [1,32], scale_fmt ue8m0,
                 modules_to_not_convert}
  * nvfp4     -> ModelOpt: config.json quantization_config {quant_method: modelopt, quant_algo: NVFP4, ignore} +
                 hf_quant_config.json {quantization: {quant_algo, group_size, exclude_modules}}
  * fp8_block -> DeepSeek: {quant_method: fp8, weight_block_size [128,128], modules_to_not_convert}
For vLLM: config.json holds the vLLM backend's quantization_config (fp8 / ModelOpt NVFP4 / ModelOpt MXFP8 in its
flat form), no hf_quant_config.json, and the MXFP8 scales are named `weight_scale` (the bytes are the same);
plus `policyc_plan.json` (the plan JSON with its content_hash) so every consumer can check the contract.

Properties:
  * streams: one work unit (a tensor, or one share-scale group) in memory at a time; safetensors headers are
    validated before anything is allocated (safetensors_io.read_header); no pickle.
  * fast path (benchmarks/RESULTS.md "Checkpoint converter"): tensors stored unchanged are read straight
    into the shard writer's staging buffers and NaN/Inf-checked there; the writer CRC32s and writes full 32 MB
    buffers on two threads, with O_DIRECT where the filesystem allows it (POLICYC_DIRECT_IO=0: page cache);
    reads are recycled through one arena; with device="cuda" only quantization goes to the GPU, with one host
    synchronisation per work unit (pinned buffers, finite checks on the device).
  * crash-safe (kill -9 / full disk at any point; tests/test_convert_faults.py kills it at every filesystem
    mutation): an exclusive lock `.<dst>.policyc-lock` (a second converter on the same DST is refused by name); all
    work in `.<dst>.policyc-work/` whose `out/` only ever receives complete, fsynced files by rename; the commit is
    one rename of `out/` to DST. An existing DST is replaced only with force, and is parked in the work dir until
    the new output is in place (a crash between the two renames is undone by the next run). The source directory
    is only read; side files are copied only if they are regular files inside it (no symlink escapes).
  * resumable: every finished output shard gets an atomic `done/<shard>.json` marker (CRC32 + size), validated on
    resume (a bad marker means "redo this shard"); a re-run with the same plan and source skips finished shards,
    also after a crash in the final phase, and produces a byte-identical result.
  * cross-shard share-scale groups (gate in shard 1, up in shard 2) are quantized together and written in the
    shard of their last member.

Public API:
  convert(src, plan, dst, force=False, progress=False) -> ConvertReport
  verify(dst, src, expected_hash=None) -> list[str]         # [] = OK; re-derives every byte from the source
  load_converted(dst) -> (Plan, {hf_name: QuantizedTensor | Tensor})
  derive_formats_from_specs({out_name: dtype}, arch) -> {hf_name: format}
  emit(plan) -> [Artifact]                                   # converter/manifest.json (+ configs)
  ConverterBackend (registered "converter"): emit(plan, options, problems), derive_formats(artifacts, arch)
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from precision_dsl.plan import Plan

from precision_dsl.backends.common import (PLAN_FILE, Artifact, PlanMismatch, Problems, UnsupportedByBackend, dump_json,
                                          engine_format, fused_module_sizes, module_of, plan_json_bytes, plan_stamp,
                                          read_json_artifact)
from precision_dsl.backends.registry import Backend, EmitOptions, register_backend
from precision_dsl.backends.quantize import DEFAULT_ROLLOUT
from precision_dsl.backends.durable import (Interrupted, OutputExists, OutputLock, copy_regular, discard, fsync_dir,
                                            open_regular, read_small, write_atomic)
from precision_dsl.backends.safetensors_io import _TORCH_DT, CheckpointError, StreamingWriter, read_exact, read_header

BACKEND = "converter"
INDEX_FILE = "model.safetensors.index.json"
_NOT_COPIED = {INDEX_FILE, "config.json", "hf_quant_config.json", PLAN_FILE}
_PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_STATE_FILE = ".policyc_state.json"


@dataclass
class SourceCheckpoint:
    root: Path
    shards: list[str]  # file names, in order
    where: dict[str, str]  # tensor name -> shard file
    dtypes: dict[str, str]
    shapes: dict[str, tuple[int, ...]]

    def fingerprint(self) -> list:
        out = []
        for s in self.shards:
            st = (self.root / s).stat()
            out.append([s, st.st_size, int(st.st_mtime_ns)])
        return out


@dataclass
class ConvertReport:
    dst: Path
    shards_written: list[str] = field(default_factory=list)
    shards_resumed: list[str] = field(default_factory=list)
    bytes_in: int = 0
    bytes_out: int = 0
    copied_files: list[str] = field(default_factory=list)
    skipped_files: list[str] = field(default_factory=list)


# ---------------------------------------------------------------------------------------------------------------
# source
# ---------------------------------------------------------------------------------------------------------------
def open_source(src: Path) -> SourceCheckpoint:
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"source checkpoint '{src}' is not a directory",
                              "pass the HF model directory (with config.json and *.safetensors)")
    index = src / INDEX_FILE
    if index.is_file():
        weight_map = _read_index(index)
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in src.glob("*.safetensors"))
        weight_map = None
    if not shards:
        raise CheckpointError(f"no *.safetensors files in '{src}'",
                              "policyc reads safetensors only (never pickle .bin files)")
    where: dict[str, str] = {}
    dtypes: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for s in shards:
        if not s or "/" in s or "\\" in s or "\x00" in s or s.startswith("."):
            raise CheckpointError(f"{index}: shard name '{s}' is not a plain file name")
        path = src / s
        if not path.is_file():
            raise CheckpointError(f"shard '{path}' listed in the index does not exist")
        for name, info in read_header(path).items():
            if name in where:
                raise CheckpointError(f"tensor '{name}' appears in both {where[name]} and {s}")
            if weight_map is not None and weight_map.get(name) != s:
                raise CheckpointError(f"{index}: tensor '{name}' is in {s} but the index says {weight_map.get(name)}")
            where[name], dtypes[name], shapes[name] = s, info["dtype"], tuple(info["shape"])
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(where))
        if missing:
            raise CheckpointError(f"{index}: {len(missing)} indexed tensors missing from the shards, e.g. {missing[0]}")
    return SourceCheckpoint(root=src, shards=shards, where=where, dtypes=dtypes, shapes=shapes)


_INDEX_LIMIT = 256 << 20


def _read_index(index: Path) -> dict[str, str]:
    """weight_map of a safetensors index, type-checked: {tensor name: shard file name}."""
    from precision_dsl.jsonsafe import loads_bounded

    try:
        with open(index, "rb") as f:
            raw = f.read(_INDEX_LIMIT + 1)
    except OSError as err:
        raise CheckpointError(f"{index}: cannot read: {err.strerror}") from None
    obj = loads_bounded(raw, str(index), CheckpointError, max_bytes=_INDEX_LIMIT, max_depth=8)
    weight_map = obj.get("weight_map") if isinstance(obj, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                   for k, v in weight_map.items()):
        raise CheckpointError(f"{index}: not a valid safetensors index (weight_map must map tensor names to "
                              "shard file names)")
    return weight_map


def _check_source_against_plan(srcc: SourceCheckpoint, plan: Plan) -> None:
    from precision_dsl.backends import fp8_source

    by = plan.by_name()
    missing = sorted(set(by) - set(srcc.where))
    if missing:
        raise CheckpointError(f"source checkpoint lacks {len(missing)} tensor(s) of the plan, e.g. '{missing[0]}'",
                              f"was the plan compiled for model '{plan.model}'? pass the matching --model")
    for name, t in by.items():
        if srcc.shapes[name] != tuple(t.shape):
            raise CheckpointError(f"tensor '{name}' has shape {srcc.shapes[name]} in the source, the plan says "
                                  f"{t.shape}")
        fp8_source.check_tensor(srcc, t)  # stored as the plan's source precision says (BF16 / FP8-block)
    aux = fp8_source.auxiliary_names(plan)  # weight_scale_inv grids of FP8-block sources
    extra = sorted(n for n in set(srcc.where) - set(by) - aux if not fp8_source.is_ignored_buffer(n))
    if extra:
        raise CheckpointError(f"source checkpoint has {len(extra)} tensor(s) the plan does not know, e.g. "
                              f"'{extra[0]}'", f"the plan was compiled for '{plan.model}'; is this its checkpoint?")


# ---------------------------------------------------------------------------------------------------------------
# layout of the output
# ---------------------------------------------------------------------------------------------------------------
def output_layout(plan: Plan, srcc: SourceCheckpoint) -> dict[str, list[list[str]]]:
    """Output shard (same file name as the source shard) -> ordered work units (lists of HF names)."""
    from precision_dsl.backends.quantize import work_units

    names = {t.hf_name for t in plan.tensors}  # scale_inv grids / buffers of the source are not work units
    order = [n for s in srcc.shards for n in _shard_names(srcc, s) if n in names]
    layout: dict[str, list[list[str]]] = {s: [] for s in srcc.shards}
    for unit in work_units(plan, order):
        layout[srcc.where[unit[-1]]].append(unit)
    return layout


def _shard_names(srcc: SourceCheckpoint, shard: str) -> list[str]:
    return sorted(n for n, s in srcc.where.items() if s == shard)


def quantization_files(plan: Plan, rollout: str = DEFAULT_ROLLOUT) -> dict[str, Optional[dict]]:
    """config.json quantization_config and hf_quant_config.json contents (None where not applicable) of the
    checkpoint rollout engine `rollout` loads: its backend's own serving config, so the checkpoint and the server
    flags can never disagree."""
    return ROLLOUT_CONFIGS[rollout](plan)


def _sglang_files(plan: Plan) -> dict[str, Optional[dict]]:
    from precision_dsl.backends.sglang import rollout_config

    probs = Problems()
    try:
        cfg = rollout_config(plan)
    except UnsupportedByBackend as err:
        for e in getattr(err, "errors", None) or [err]:
            probs.add(UnsupportedByBackend(BACKEND, e.tensor, f"the checkpoint's quantization_config is SGLang's: "
                                                              f"{e.capability}", e.hint))
    probs.raise_if_any()
    return {"quantization_config": cfg.quantization_config, "hf_quant_config": cfg.hf_quant_config}


def _vllm_files(plan: Plan) -> dict[str, Optional[dict]]:
    """vLLM reads config.json's quantization_config (hf_quant_config.json only where it is absent,
    vllm/transformers_utils/config.py): the one the vLLM backend passes as --hf-overrides, and no side file."""
    from precision_dsl.backends.vllm import serve_config

    found, probs = Problems(), Problems()
    cfg = serve_config(plan, found)
    for e in found.items:
        probs.add(UnsupportedByBackend(BACKEND, e.tensor, f"the checkpoint's quantization_config is vLLM's: "
                                                          f"{e.capability}", e.hint))
    probs.raise_if_any()
    return {"quantization_config": cfg.quantization_config, "hf_quant_config": None}


# rollout engine -> the checkpoint configs it loads (the tensor names: quantize.ROLLOUT_SUFFIXES)
ROLLOUT_CONFIGS: dict[str, Callable[[Plan], dict]] = {"sglang": _sglang_files, "vllm": _vllm_files}


def checked_rollout(rollout: str) -> str:
    if rollout not in ROLLOUT_CONFIGS:
        raise CheckpointError(f"unknown rollout engine '{rollout}' for a checkpoint",
                              f"choose from {', '.join(ROLLOUT_CONFIGS)}")
    return rollout


def rollout_of(dst: Path, plan: Plan) -> str:
    """The rollout engine a converted checkpoint was written for: the one whose quantization_config its
    config.json holds (the SGLang one where several agree, e.g. an unquantized plan)."""
    have = read_source_config(dst).get("quantization_config")
    for rollout, files in ROLLOUT_CONFIGS.items():
        try:
            if files(plan)["quantization_config"] == have:
                return rollout
        except UnsupportedByBackend:
            continue
    return DEFAULT_ROLLOUT


def _specs_for_unit(by: dict, unit: list[str], rollout: str = DEFAULT_ROLLOUT):
    """(name, dtype, shape) of every output tensor of one work unit, in write order. `by` = plan.by_name(), built
    once by the caller (building it per unit made conversion quadratic in the tensor count)."""
    from precision_dsl.backends.quantize import output_specs

    out = []
    for n in unit:
        out.extend(output_specs(by[n], rollout))
    return out


def _quantizes(members) -> bool:
    return any(t.is_linear and t.precision.weight.is_quantized for t in members)


def _unit_device(members, device: str) -> str:
    """Where a work unit is computed: only quantization goes to the GPU; pass-through and high-precision casts stay
    on the host (a GPU round trip would add two copies and change no byte)."""
    return device if device != "cpu" and _quantizes(members) else "cpu"


class _DeviceUnits:
    """Work units quantized on a CUDA device with ONE host<->device synchronisation per unit (per-tensor finite
    checks and per-output copies to pageable memory cost ~10 synchronisations per tensor), and the next unit's
    source bytes read ahead by a background thread while this one runs:

      * inputs: read (preadv, no GIL) into one of two pinned arenas by the read-ahead thread, copied to the device
        non-blocking; an arena is reused only after the unit that read into it has synchronised;
      * checkpoint_tensors runs without its host-synchronising checks; every input and output the sequential checks
        would test is tested on the device into flags;
      * all outputs (packed exactly as they follow each other in the shard) and the flags are copied non-blocking
        into one pinned host buffer, then handed to the writer in one call.
    Only when a flag says "not finite" are the sequential checks re-run on the same device tensors, raising exactly
    the NonFiniteWeight they always raise. Bytes are the CPU path's (tests/test_converter.py, GPU tests)."""

    def __init__(self, device: str, reader: "_Reader", rollout: str = DEFAULT_ROLLOUT):
        from concurrent.futures import ThreadPoolExecutor

        self.device, self.reader, self.rollout = device, reader, rollout
        self._host = None
        self._arenas: list = [None, None]
        self._turn = 0
        self._ahead = ThreadPoolExecutor(max_workers=1, thread_name_prefix="policyc-read-ahead")
        self._next = None  # (key, future) of the unit being read ahead

    def close(self) -> None:
        self._ahead.shutdown(wait=True)  # a read in flight still writes into an arena: let it finish
        self._next = None

    def _spans(self, members) -> list[tuple]:
        """(name, fd, offset, dtype, shape, nbytes) of the unit's source tensors (main thread: header and descriptor
        caches are not shared with the read-ahead thread)."""
        from precision_dsl.backends import fp8_source

        names = []
        for t in members:
            names.append(t.hf_name)
            if fp8_source.is_fp8_block_source(t):
                names.append(fp8_source.scale_name(t))
        return [(n, *self.reader.span(n), self.reader.shape(n), self.reader.nbytes(n)) for n in names]

    def _read(self, spans: list[tuple], slot: int) -> dict:
        """(read-ahead thread) the unit's source tensors, read into pinned arena `slot`."""
        import torch

        offs, off = [], 0
        for *_, nbytes in spans:
            offs.append(off)
            off = (off + nbytes + 63) & ~63  # 64-byte aligned: every dtype view is aligned
        arena = self._arenas[slot]
        if arena is None or arena.numel() < off:
            arena = self._arenas[slot] = torch.empty(max(off, 1), dtype=torch.uint8, pin_memory=True)
        out = {}
        with memoryview(arena.numpy()) as view:
            for (n, fd, at, dt, shape, nbytes), o in zip(spans, offs):
                piece = view[o:o + nbytes]
                read_exact(fd, piece, at, n)
                piece.release()
                out[n] = arena[o:o + nbytes].view(getattr(torch, _Reader._DT[dt])).reshape(shape)
        return out

    def _prefetch(self, key, members) -> None:
        """Start reading a unit's source bytes in the background, into the arena not used by the running unit."""
        self._next = (key, self._ahead.submit(self._read, self._spans(members), self._turn))

    def run(self, key, members, uspecs, upcoming=None) -> tuple[list[str], memoryview]:
        """(output names, their bytes exactly as the shard stores them) of the unit `key`; `upcoming`: (key, members)
        of the next device unit, read ahead while this one runs."""
        import torch

        from precision_dsl.backends import fp8_source
        from precision_dsl.backends.quantize import checkpoint_tensors

        if self._next is None or self._next[0] != key:  # the first device unit of a shard (or out of order)
            if self._next is not None:
                self._next[1].result()  # let a stray read finish before its arena is reused
            self._prefetch(key, members)
        tensors = self._next[1].result()
        self._next = None
        self._turn ^= 1  # the running unit's arena is not touched again before this unit has synchronised
        if upcoming is not None:
            self._prefetch(*upcoming)

        seen: dict = {}

        def quantize_unchecked(pairs, backend):
            seen["pairs"] = pairs
            return checkpoint_tensors(pairs, backend, check_finite=False, rollout=self.rollout)

        out = fp8_source.unit_tensors(members, _Tensors(tensors), BACKEND, self.device, quantize_unchecked)
        pairs = seen.get("pairs", [])
        mods = tuple(module_of(t.hf_name) + "." for t, _ in pairs)  # pass-through FP8 members are not checked
        oks, host_ok = [], True
        for y in [x for _, x in pairs] + [y for n, y in out.items() if n.startswith(mods)]:
            ok = _finite_flag(y)
            if ok is None:
                continue
            if y.is_cuda:
                oks.append(ok)
            else:
                host_ok = host_ok and bool(ok)
        total = 0
        for name, dt, shape in uspecs:
            y = out[name]
            if tuple(y.shape) != tuple(shape) or str(y.dtype) != f"torch.{_TORCH_DT[dt]}":
                raise AssertionError(f"device unit: {name} is {tuple(y.shape)} {y.dtype}, expected {shape} {dt}")
            total += y.numel() * y.element_size()
        buf = self._buffer(total + len(oks))
        off = 0
        for name, _dt, _shape in uspecs:
            flat = out[name].detach().contiguous().reshape(-1).view(torch.uint8)
            buf[off:off + flat.numel()].copy_(flat, non_blocking=True)
            off += flat.numel()
        if oks:
            buf[total:total + len(oks)].copy_(torch.stack(oks), non_blocking=True)  # bool -> one byte each
        torch.cuda.current_stream(self.device).synchronize()
        if not host_ok or (oks and not bool(buf[total:total + len(oks)].all())):
            checkpoint_tensors(pairs, BACKEND, check_finite=True, rollout=self.rollout)  # the sequential path's error
            raise AssertionError("device finite check and checkpoint_tensors disagree")  # pragma: no cover
        return [name for name, _dt, _shape in uspecs], memoryview(buf.numpy())[:total]

    def _buffer(self, n: int):
        import torch

        if self._host is None or self._host.numel() < n:
            self._host = torch.empty(max(n, 1), dtype=torch.uint8, pin_memory=True)
        return self._host


class _Tensors:
    """A reader over tensors already read (the read-ahead thread's), for fp8_source.unit_tensors."""

    def __init__(self, tensors: dict):
        self._t = tensors

    def get(self, name: str):
        return self._t[name]


def _finite_flag(y):
    """0-dim bool tensor on y's device: y holds no NaN/Inf (None: a dtype without such codes). Same rules as
    quantize._assert_finite: float -> isfinite; E4M3FN NaN = S.1111.111; E5M2 Inf/NaN = S.11111.xx."""
    import torch

    if y.dtype == torch.float8_e4m3fn:
        return ~((y.view(torch.uint8) & 0x7F) == 0x7F).any()
    if y.dtype == torch.float8_e5m2:
        return ~((y.view(torch.uint8) & 0x7C) == 0x7C).any()
    if not y.is_floating_point():
        return None
    return torch.isfinite(y).all()


_FLOAT_DTYPES = {"BF16": ("bfloat16", 2), "F16": ("float16", 2), "F32": ("float32", 4)}


def _copy_through(members, uspecs, srcc: SourceCheckpoint, reader: _Reader, writer: StreamingWriter) -> bool:
    """A tensor written exactly as stored (same dtype, no quantization; e.g. every tensor of a BF16 policy, norms and
    embeddings of the others) is read straight into the writer's staging buffer and checked there, piece by piece,
    with the same finite test as checkpoint_tensors (aminmax). Returns False when this unit is not such a tensor;
    a non-finite piece re-runs the unit on the normal path, which raises the usual NonFiniteWeight."""
    import torch

    from precision_dsl.backends import fp8_source
    from precision_dsl.backends.quantize import checkpoint_tensors

    if len(members) != 1 or len(uspecs) != 1:
        return False
    t = members[0]
    name, dt, shape = uspecs[0]
    if (name != t.hf_name or fp8_source.is_fp8_block_source(t) or (t.is_linear and t.precision.weight.is_quantized)
            or dt not in _FLOAT_DTYPES or srcc.dtypes[name] != dt or tuple(srcc.shapes[name]) != tuple(shape)):
        return False
    tdt, size = _FLOAT_DTYPES[dt]
    if writer.size % size:  # pieces would split elements (only after odd-sized U8/FP8 tensors)
        return False
    torch_dt = getattr(torch, tdt)

    def finite(piece) -> bool:
        if not len(piece):
            return True
        lo, hi = torch.aminmax(torch.frombuffer(piece, dtype=torch_dt))  # NaN propagates; +-inf shows as min/max
        return math.isfinite(lo.item()) and math.isfinite(hi.item())

    fd, offset, _ = reader.span(name)
    if writer.write_from_file(name, fd, offset, finite):
        return True
    fp8_source.unit_tensors(members, reader, BACKEND, "cpu", checkpoint_tensors)  # raises NonFiniteWeight
    raise AssertionError(f"'{name}': finite check of the copy path and checkpoint_tensors disagree")  # pragma: no cover


class _TorchThreads:
    """torch's intra-op thread count for the current unit: `set(1)` or `set(None)` (= the count saved by the first
    `set(n)`)."""

    def __init__(self):
        self._saved: Optional[int] = None

    def set(self, n: Optional[int]) -> None:
        if n is None and self._saved is None:
            # nothing to restore: never import torch here. This runs in the converter's `finally`, also after a
            # Ctrl-C in the middle of `import torch`, when importing the half-initialised module again raises
            # anything (AttributeError, circular ImportError, duplicate registrations) and hides the interrupt.
            return
        import torch

        if n is not None and self._saved is None:
            self._saved = torch.get_num_threads()
            if self._saved != n:
                torch.set_num_threads(n)
        elif n is None:
            if torch.get_num_threads() != self._saved:
                torch.set_num_threads(self._saved)
            self._saved = None


# ---------------------------------------------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------------------------------------------
def file_checksum(path: Path) -> str:
    """Same checksum StreamingWriter computes while writing (CRC32 of the whole file)."""
    import zlib

    crc = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            crc = zlib.crc32(chunk, crc)
    return f"crc32:{crc:08x}"


class _Reader:
    """Reads one tensor at a time with plain positioned reads at the offsets of the VALIDATED header (no mmap: a
    mapped shard's touched pages count towards RSS for as long as it stays mapped, which would make peak memory
    grow with the checkpoint instead of the largest tensor). Safetensors format only; nothing is unpickled.

    `reuse=True` (the converter): tensors are carved out of one reused arena that `release()` recycles after each
    work unit, so the same hot memory is read into again and again (freshly touched memory costs ~2 s/GB on the
    CI VM, more than the copy itself); `pin=True` pins that arena for fast host->GPU copies. Without `reuse`
    every `get` returns a tensor of its own (verify, tests and load_converted keep them)."""

    _DT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}

    def __init__(self, srcc: SourceCheckpoint, reuse: bool = False, pin: bool = False):
        self.srcc = srcc
        self._headers: dict[str, tuple[int, dict]] = {}
        self._fds: dict[str, int] = {}
        self._reuse, self._pin = reuse, pin
        self._arena = None
        self._used = 0

    def _header(self, shard: str) -> tuple[int, dict]:
        if shard not in self._headers:
            path = self.srcc.root / shard
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            self._headers[shard] = (8 + n, read_header(path))
        return self._headers[shard]

    def _fd(self, shard: str) -> int:
        if shard not in self._fds:
            self._fds[shard] = os.open(self.srcc.root / shard, os.O_RDONLY | os.O_CLOEXEC)
        return self._fds[shard]

    def _alloc(self, n: int):
        import torch

        if not self._reuse:
            return torch.empty(n, dtype=torch.uint8)
        start = (self._used + 63) & ~63  # 64-byte aligned slices: any dtype view is aligned
        if self._arena is None or start + n > self._arena.numel():
            # grow to what this unit needs so far (earlier slices keep the old arena alive until released), so the
            # next unit of the same size fits
            self._arena = torch.empty(start + n, dtype=torch.uint8, pin_memory=self._pin)
        self._used = start + n
        return self._arena[start:start + n]

    def span(self, name: str) -> tuple[int, int, str]:
        """(open descriptor, absolute byte offset, safetensors dtype) of a tensor's bytes in its shard."""
        shard = self.srcc.where[name]
        base, header = self._header(shard)
        info = header[name]
        return self._fd(shard), base + info["data_offsets"][0], info["dtype"]

    def shape(self, name: str) -> list[int]:
        return self._header(self.srcc.where[name])[1][name]["shape"]

    def nbytes(self, name: str) -> int:
        b, e = self._header(self.srcc.where[name])[1][name]["data_offsets"]
        return e - b

    def release(self) -> None:
        """Every tensor `get` returned since the last release may now be overwritten (reuse=True only)."""
        self._used = 0

    def get(self, name: str):
        import torch

        shard = self.srcc.where[name]
        base, header = self._header(shard)
        info = header[name]
        b, e = info["data_offsets"]
        buf = self._alloc(e - b)
        fd = self._fd(shard)
        view = memoryview(buf.numpy())
        read_exact(fd, view[:e - b], base + b, name, self.srcc.root / shard)
        del view
        return buf.view(getattr(torch, self._DT[info["dtype"]])).reshape(info["shape"])

    def close(self) -> None:
        self._headers.clear()
        self._arena = None
        fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)

    def __del__(self):  # readers of tests and callers that never close: do not leak descriptors
        try:
            self.close()
        except Exception:
            pass


def _work_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.policyc-work"


def _lock_path(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.policyc-lock"


_partial_dir = _work_dir  # the name older tests and notes use
_MARKER_LIMIT = 4096
_STATE_LIMIT = 1 << 20


def _read_json_marker(path: Path, limit: int):
    """A marker/state file we wrote, parsed; None for anything else (absent, partial, garbage, wrong type): a bad
    marker only ever means "redo this step", never an error."""
    from precision_dsl.jsonsafe import loads_bounded

    raw = read_small(path, limit)
    if raw is None:
        return None
    try:
        obj = loads_bounded(raw, str(path), ValueError, max_bytes=limit, max_depth=8)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


def _shard_is_done(work: Path, shard: str) -> bool:
    info = _read_json_marker(work / "done" / f"{shard}.json", _MARKER_LIMIT)
    out_path = work / "out" / shard
    if info is None or info.get("shard") != shard or type(info.get("size")) is not int \
            or not isinstance(info.get("checksum"), str):
        return False
    try:
        if not out_path.is_file() or out_path.is_symlink() or out_path.stat().st_size != info["size"]:
            return False
    except OSError:
        return False
    return file_checksum(out_path) == info["checksum"]


def _recover(dst: Path, work: Path, state: dict) -> bool:
    """Bring the on-disk state left by an interrupted run back to a consistent one (caller holds the lock).
    Returns True when that run had already committed exactly this conversion (nothing left to do)."""
    for stale in dst.parent.glob(f"{work.name}.trash-*"):  # a crash in the middle of `discard`
        shutil.rmtree(stale, ignore_errors=True)
    if not work.is_dir():
        return False
    previous = work / "previous"
    if previous.is_dir():
        if dst.exists():  # the --force swap finished (new output in place): the old one is garbage now
            shutil.rmtree(previous)
        else:  # killed between the two renames of --force: put the previous output back
            os.rename(previous, dst)
            fsync_dir(dst.parent)
    if not (work / "out").is_dir():  # killed after the commit rename, before the clean-up
        committed = _read_json_marker(work / "state.json", _STATE_LIMIT) == state and dst.is_dir()
        discard(work)
        return committed
    return False


def convert(src: Path, plan: Plan, dst: Path, force: bool = False, progress: bool = False,
            on_shard_done: Optional[Callable[[str], None]] = None, device: str = "cpu",
            rollout: str = DEFAULT_ROLLOUT, on_committed: Optional[Callable[[], None]] = None) -> ConvertReport:
    """Convert `src` to `dst` under `plan` (see module docstring), the checkpoint rollout engine `rollout` loads
    (its tensor names and quantization_config; the bytes are the same). `on_shard_done(shard)` is called after each
    finished shard (tests use it to simulate an interruption); `on_committed()` right after the commit rename (the
    CLI stops taking Ctrl-C there: the output is complete, nothing is left to resume). `device="cuda"` quantizes on the GPU with the
    fused Triton kernels (byte-identical to the CPU references); reading and writing stay streaming on the host.

    Crash safety (tests/test_convert_faults.py kills it at every filesystem mutation): all work happens in
    `.<dst>.policyc-work/` under an exclusive lock `.<dst>.policyc-lock`; `out/` receives only complete, fsynced
    files by rename; `done/<shard>.json` markers are written atomically after their shard and validated (size +
    CRC32) on resume; the commit is `rename(out, dst)` (with --force, the old DST is first renamed to
    `work/previous` and restored by the next run if the commit never happened)."""
    checked_rollout(rollout)
    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise CheckpointError(f"output '{dst}' overlaps the source '{src}'", "write the output to another directory")
    if not dst.parent.is_dir():
        dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        with OutputLock(_lock_path(dst), dst) as lock:
            return _convert_locked(src, plan, dst, force, progress, on_shard_done, device, lock, rollout,
                                   on_committed)
    except Interrupted:
        raise
    except KeyboardInterrupt as err:  # every finished shard is kept: the same command resumes
        raise Interrupted(*err.args) from None


def _committed_mark(state: dict) -> str:
    import hashlib

    return "committed " + hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()


def _convert_locked(src, plan, dst, force, progress, on_shard_done, device, lock: OutputLock,
                    rollout: str = DEFAULT_ROLLOUT, on_committed: Optional[Callable[[], None]] = None) -> ConvertReport:
    import functools

    from precision_dsl.backends import fp8_source
    from precision_dsl.backends.quantize import check_supported, checkpoint_tensors

    work = _work_dir(dst)
    srcc = open_source(src)
    state = {"plan_hash": plan.content_hash(), "source": str(src), "fingerprint": srcc.fingerprint()}
    if rollout != DEFAULT_ROLLOUT:  # another engine's checkpoint is other work (the SGLang state stays as it was)
        state["rollout"] = rollout
    quantize_fn = functools.partial(checkpoint_tensors, rollout=rollout)
    report = ConvertReport(dst=dst)
    # Committed already: killed while tidying up after the commit (work dir still there: _recover), or after it
    # (only the lock file was left, and its last mark says this very conversion was committed).
    if _recover(dst, work, state) or (not work.exists() and dst.is_dir()
                                      and lock.previous.endswith("\n" + _committed_mark(state))):
        report.shards_resumed = list(srcc.shards)
        return report
    if dst.exists() and not force:
        raise OutputExists(f"output directory '{dst}' already exists (pass --force to replace it)")
    _check_source_against_plan(srcc, plan)
    qfiles = quantization_files(plan, rollout)  # raises UnsupportedByBackend before any work
    for t in plan.tensors:
        check_supported(t, BACKEND)
    layout = output_layout(plan, srcc)
    by = plan.by_name()

    if work.exists() and _read_json_marker(work / "state.json", _STATE_LIMIT) != state:
        discard(work)  # another plan / source / a torn state file: nothing in it can be trusted
    if not work.exists():
        work.mkdir()
        # out/ before state.json: a valid state.json without out/ then means "committed" (see _recover)
        for sub in ("out", "done"):
            (work / sub).mkdir()
        write_atomic(work / "state.json", json.dumps(state).encode())
    out_dir = work / "out"

    # The converter's reader recycles one arena per work unit (device units read into _DeviceUnits' pinned arenas).
    reader = _Reader(srcc, reuse=True)
    prog = _progress(progress, len(srcc.where))
    threads = _TorchThreads()
    on_device = _DeviceUnits(device, reader, rollout) if device != "cpu" else None
    try:
        for shard, units in layout.items():
            if _shard_is_done(work, shard):
                report.shards_resumed.append(shard)
                report.bytes_in += sum(by[n].bytes_before for u in units for n in u)  # "X MiB in -> Y MiB" is all
                prog.advance(sum(len(u) for u in units))
                continue
            marker = work / "done" / f"{shard}.json"
            if marker.is_dir() and not marker.is_symlink():  # not ours: a marker is only ever a file
                shutil.rmtree(marker)
            unit_specs = [_specs_for_unit(by, u, rollout) for u in units]
            tmp_path = work / f"{shard}.writing"
            writer = StreamingWriter(tmp_path, [s for us in unit_specs for s in us],
                                     metadata={"format": "pt", "policyc_plan": plan.content_hash()})
            try:
                # device units of this shard -> the next one after it (read ahead while the current one runs)
                dev_units = [i for i, u in enumerate(units) if _unit_device([by[n] for n in u], device) != "cpu"]
                next_device = {i: ((shard, j), [by[n] for n in units[j]]) for i, j in zip(dev_units, dev_units[1:])}
                for i, (unit, uspecs) in enumerate(zip(units, unit_specs)):
                    members = [by[n] for n in unit]
                    report.bytes_in += sum(t.bytes_before for t in members)
                    udev = _unit_device(members, device)
                    # A unit without quantization only pays a finite check (aminmax) on the host: run it on one
                    # torch thread. OpenMP's 2-thread barriers next to the writer thread (and other jobs) on a
                    # 2-core box made each call ~100x slower than its single-threaded time.
                    threads.set(1 if udev == "cpu" and not _quantizes(members) else None)
                    if _copy_through(members, uspecs, srcc, reader, writer):
                        prog.advance(len(unit))
                        continue
                    # BF16 sources are quantized; FP8-block sources are dequantized or passed through (fp8_source)
                    if udev != "cpu":
                        names, data = on_device.run((shard, i), members, uspecs, next_device.get(i))
                        writer.write_raw(names, data)
                        prog.advance(len(unit))
                        continue
                    out = fp8_source.unit_tensors(members, reader, BACKEND, udev, quantize_fn)
                    for name, _dt, _shape in uspecs:
                        writer.write(name, out[name])  # copied into the writer's staging buffer
                    del out
                    reader.release()
                    prog.advance(len(unit))
                writer.close()  # fsyncs the shard
            finally:
                writer.abort()
            os.replace(tmp_path, out_dir / shard)
            write_atomic(marker,
                         json.dumps({"shard": shard, "checksum": writer.checksum(), "size": writer.size}).encode(),
                         tmp_dir=work)
            report.shards_written.append(shard)
            if on_shard_done is not None:
                on_shard_done(shard)
    finally:
        threads.set(None)
        if on_device is not None:
            on_device.close()
        reader.close()
        prog.stop()

    # index, configs, plan, side files: each one atomic, so a crash here redoes only this phase
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, units in layout.items():
        for u in units:
            for name, dt, shape in _specs_for_unit(by, u, rollout):
                weight_map[name] = shard
        total_size += (out_dir / shard).stat().st_size
    report.bytes_out = total_size
    files: dict[str, bytes] = {
        INDEX_FILE: dump_json({"metadata": {"total_size": total_size, "policyc_plan": plan.content_hash()},
                               "weight_map": dict(sorted(weight_map.items()))}, compact=True).encode()}
    config = read_source_config(src)
    if qfiles["quantization_config"] is not None:
        config["quantization_config"] = qfiles["quantization_config"]
    else:
        config.pop("quantization_config", None)
    files["config.json"] = dump_json(config).encode()
    if qfiles["hf_quant_config"] is not None:
        files["hf_quant_config.json"] = dump_json(qfiles["hf_quant_config"]).encode()
    files[PLAN_FILE] = plan_json_bytes(plan)
    for name, data in files.items():
        write_atomic(out_dir / name, data, tmp_dir=work)
    keep = set(layout) | set(files)
    for p in sorted(src.iterdir()):
        if p.suffix == ".safetensors" or p.name in _NOT_COPIED or p.name.startswith("."):
            continue
        if p.suffix in _PICKLE_SUFFIXES:
            report.skipped_files.append(p.name)  # pickled weights are never read nor copied
            continue
        fd = open_regular(p, src)
        if fd is None:  # symlink leaving the source, FIFO, device, directory: never followed, never copied
            if not p.is_dir() or p.is_symlink():
                report.skipped_files.append(p.name)
            continue
        try:
            copy_regular(fd, out_dir / p.name, work)
        finally:
            os.close(fd)
        keep.add(p.name)
        report.copied_files.append(p.name)
    for p in out_dir.iterdir():  # a side file of an earlier attempt that the source no longer has
        if p.name not in keep:
            p.unlink()
    fsync_dir(out_dir)

    # commit
    if dst.exists():  # --force (checked above): the old output waits in work/ until the new one is in place
        os.rename(dst, work / "previous")
        fsync_dir(work)
    os.rename(out_dir, dst)
    if on_committed is not None:
        on_committed()
    fsync_dir(dst.parent)
    lock.mark(_committed_mark(state))  # from here a kill leaves a complete DST: the next run only tidies up
    discard(work)
    return report


def read_source_config(src: Path) -> dict:
    """The source's config.json (regular file inside SRC only), as a dict; {} when there is none."""
    from precision_dsl.jsonsafe import loads_bounded

    path = Path(src) / "config.json"
    if not os.path.lexists(path):
        return {}
    fd = open_regular(path, src)
    if fd is None:
        raise CheckpointError(f"{path} is not a regular file inside the source directory (a symlink leaving it?)",
                              "copy the checkpoint with its files dereferenced, e.g. `cp -rL`")
    try:
        with os.fdopen(fd, "rb") as f:
            raw = f.read(_CONFIG_LIMIT + 1)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror}") from None
    config = loads_bounded(raw, str(path), CheckpointError, max_bytes=_CONFIG_LIMIT)
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: top level is not a JSON object")
    return config


_CONFIG_LIMIT = 16 << 20


class _NoProgress:
    def advance(self, n: int) -> None:
        pass

    def stop(self) -> None:
        pass


class _RichProgress:
    def __init__(self, total: int):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

        self._p = Progress("[progress.description]{task.description}", BarColumn(), MofNCompleteColumn(),
                           TimeElapsedColumn(), transient=False)
        self._task = self._p.add_task("converting tensors", total=total)
        self._p.start()

    def advance(self, n: int) -> None:
        self._p.advance(self._task, n)

    def stop(self) -> None:
        self._p.stop()


def _progress(enabled: bool, total: int):
    return _RichProgress(total) if enabled else _NoProgress()


# ---------------------------------------------------------------------------------------------------------------
# reading back / verify
# ---------------------------------------------------------------------------------------------------------------
def read_plan(dst: Path) -> Plan:
    path = Path(dst) / PLAN_FILE
    if not Path(dst).is_dir():
        what = "is not a directory" if Path(dst).exists() else "does not exist"
        raise CheckpointError(f"converted checkpoint '{dst}' {what}", "pass the --out directory of `policyc convert`")
    if not path.is_file():
        raise CheckpointError(f"'{dst}' has no {PLAN_FILE}: it was not written by `policyc convert`")
    try:
        with open(path, "rb") as f:
            text = f.read(_PLAN_LIMIT + 1).decode("utf-8")
        if len(text) > _PLAN_LIMIT:
            raise ValueError(f"larger than {_PLAN_LIMIT} bytes")
        return Plan.from_json(text)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror}") from None
    except (ValueError, RecursionError, TypeError, AttributeError) as err:  # pydantic errors are ValueErrors
        raise CheckpointError(f"{path}: not a valid plan ({_first_line(err)})") from None


_PLAN_LIMIT = 1 << 30


def _first_line(err: Exception) -> str:
    return str(err).splitlines()[0][:200] if str(err) else type(err).__name__


def _read_json_file(path: Path, limit: int = _CONFIG_LIMIT):
    from precision_dsl.jsonsafe import loads_bounded

    try:
        with open(path, "rb") as f:
            raw = f.read(limit + 1)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror}") from None
    return loads_bounded(raw, str(path), CheckpointError, max_bytes=limit)


def _dst_tensors(dst: Path) -> dict[str, tuple[str, str]]:
    """{tensor name: (shard file, dtype)} of a converted checkpoint, from validated headers."""
    dst = Path(dst)
    out: dict[str, tuple[str, str]] = {}
    for s in sorted(p.name for p in dst.glob("*.safetensors")):
        for name, info in read_header(dst / s).items():
            out[name] = (s, info["dtype"])
    return out


def derive_formats_from_specs(specs: dict[str, str], arch) -> dict[str, str]:
    """{hf_name: TensorFormat.short()} from output tensor names + dtypes only (what a loader sees): `X.weight_scale_2`
    -> nvfp4 (1x16; one weight_scale_2 per fused module where the loader fuses: SGLang requires gate == up for w13),
    `X.weight_scale_inv` U8 (SGLang's naming) or `X.weight_scale` U8 (vLLM's) -> mxfp8 1x32,
    `X.weight_scale_inv` F32 -> fp8_block 128x128 with fp32 scales (what the loader multiplies by), otherwise the stored dtype ("missing" for a tensor with no output)."""
    dt_kind = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
    fused = fused_module_sizes(arch)
    out: dict[str, str] = {}
    for t in arch.tensors:
        n = t.hf_name
        mod = module_of(n)
        if n.endswith(".weight") and f"{mod}.weight_scale_2" in specs:
            out[n] = engine_format("nvfp4", shared=fused.get(n, 1) > 1)
        elif n.endswith(".weight") and f"{mod}.weight_scale_inv" in specs:
            out[n] = engine_format("mxfp8" if specs[f"{mod}.weight_scale_inv"] == "U8" else "fp8_block")
        elif n.endswith(".weight") and specs.get(f"{mod}.weight_scale") == "U8":  # vLLM's MXFP8 naming
            out[n] = engine_format("mxfp8")
        else:
            out[n] = dt_kind.get(specs.get(n, ""), specs.get(n, "missing"))
    return out


def load_converted(dst: Path, names: Optional[list[str]] = None):
    """(plan, {hf_name: QuantizedTensor | Tensor}) read back from a converted checkpoint (safetensors only)."""
    from precision_dsl.backends.quantize import output_specs, read_quantized

    plan = read_plan(dst)
    rollout = rollout_of(Path(dst), plan)
    reader = _Reader(open_source(Path(dst)))
    out = {}
    for t in plan.tensors:
        if names is not None and t.hf_name not in names:
            continue
        raw = {name: reader.get(name) for name, _dt, _shape in output_specs(t, rollout)}
        out[t.hf_name] = read_quantized(t, raw, rollout)
    reader.close()
    return plan, out


def verify(dst: Path, src: Path, expected_hash: Optional[str] = None, progress: bool = False) -> list[str]:
    """Re-derive every output byte from the source and compare (for the rollout engine whose config the
    checkpoint holds). Returns a list of problems ([] = verified)."""
    import functools

    import torch

    from precision_dsl.backends import fp8_source
    from precision_dsl.backends.quantize import NonFiniteWeight, checkpoint_tensors

    dst = Path(dst)
    plan = read_plan(dst)
    problems: list[str] = []
    if expected_hash is not None and expected_hash != plan.content_hash():
        raise PlanMismatch(f"{dst / PLAN_FILE}", expected_hash, plan.content_hash())
    srcc = open_source(Path(src))
    _check_source_against_plan(srcc, plan)
    layout = output_layout(plan, srcc)
    have = _dst_tensors(dst)
    by = plan.by_name()
    rollout = rollout_of(dst, plan)
    quantize_fn = functools.partial(checkpoint_tensors, rollout=rollout)
    expected_names = {name for units in layout.values() for u in units
                      for name, _, _ in _specs_for_unit(by, u, rollout)}
    for n in sorted(set(have) - expected_names):
        problems.append(f"unexpected tensor '{n}' in {have[n][0]}")
    for n in sorted(expected_names - set(have)):
        problems.append(f"missing tensor '{n}'")
    qfiles = quantization_files(plan, rollout)
    config = read_source_config(dst)
    if config.get("quantization_config") != qfiles["quantization_config"]:
        problems.append("config.json quantization_config differs from the plan's")
    if qfiles["hf_quant_config"] is not None:
        hq = dst / "hf_quant_config.json"
        if not hq.is_file() or _read_json_file(hq) != qfiles["hf_quant_config"]:
            problems.append("hf_quant_config.json differs from the plan's")
    elif os.path.lexists(dst / "hf_quant_config.json"):  # a loader may read it: it must not be there
        problems.append("hf_quant_config.json is present but the plan has no ModelOpt config")
    reader = _Reader(srcc, reuse=True)  # both arenas are recycled after each unit (see _Reader)
    out_reader = _Reader(open_source(dst), reuse=True)
    prog = _progress(progress, len(plan.tensors))
    try:
        for shard, units in layout.items():
            for unit in units:
                try:
                    out = fp8_source.unit_tensors([by[n] for n in unit], reader, BACKEND, "cpu", quantize_fn)
                except NonFiniteWeight as err:  # the plan cannot hold this source: no output can verify
                    problems.append(str(err))
                    reader.release()
                    prog.advance(len(unit))
                    continue
                for name, ref in out.items():
                    if name not in have:
                        continue
                    s = have[name][0]
                    if s != shard:
                        problems.append(f"tensor '{name}' is in {s}, expected {shard}")
                    got = out_reader.get(name)
                    if got.dtype != ref.dtype or got.shape != ref.shape or not torch.equal(
                            got.reshape(-1).view(torch.uint8), ref.reshape(-1).view(torch.uint8)):
                        problems.append(f"tensor '{name}' differs from the re-derived bytes")
                del out
                reader.release()
                out_reader.release()
                prog.advance(len(unit))
    finally:
        reader.close()
        out_reader.close()
        prog.stop()
    return problems


# ---------------------------------------------------------------------------------------------------------------
# emit (no checkpoint needed): what the converter WILL write
# ---------------------------------------------------------------------------------------------------------------
def emit(plan: Plan, rollout: str = DEFAULT_ROLLOUT) -> list[Artifact]:
    from precision_dsl.backends.quantize import check_all_supported, plan_output_specs

    check_all_supported(plan, BACKEND)
    qfiles = quantization_files(plan, rollout)
    manifest = {"policyc": plan_stamp(plan),
                "formats": sorted({k.value for k in {t.weight.kind for t in plan.quantized()}}),
                "quantization_config": qfiles["quantization_config"],
                "hf_quant_config": qfiles["hf_quant_config"],
                # (name, dtype, shape) tuples: JSON writes them as [name, dtype, [dims]]
                "tensors": {t.hf_name: specs for t, specs in zip(plan.tensors, plan_output_specs(plan, rollout))}}
    if rollout != DEFAULT_ROLLOUT:
        manifest["rollout"] = rollout
    return [Artifact("converter/manifest.json", dump_json(manifest, compact=True),
                     "every output tensor (name, dtype, shape) per plan tensor + checkpoint configs")]


def derive_formats_of_outputs(artifacts, path: str, outputs, arch) -> dict[str, str]:
    """`derive_formats_from_specs` of the output tensors a JSON manifest artifact lists (`outputs(doc)`: its
    (name, dtype, shape) lists): the converter's checkpoint and the tensors the weight update sends are read the
    same way, as a loader reads a checkpoint."""
    doc = read_json_artifact(artifacts, path)
    return derive_formats_from_specs({n: dt for specs in outputs(doc) for n, dt, _ in specs}, arch)


@register_backend
class ConverterBackend(Backend):
    name = BACKEND
    role = "checkpoint"
    description = "the quantized checkpoint `policyc convert` writes: every output tensor and the configs"

    def artifacts(self, plan: Plan, options: EmitOptions) -> list[Artifact]:
        return emit(plan, checked_rollout(options.rollout) if options else DEFAULT_ROLLOUT)

    def derive_formats(self, artifacts, arch) -> dict[str, str]:
        """The checkpoint's weight formats from the output tensors converter/manifest.json announces."""
        return derive_formats_of_outputs(artifacts, "converter/manifest.json",
                                         lambda doc: (doc.get("tensors") or {}).values(), arch)
