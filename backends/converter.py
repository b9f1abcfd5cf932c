"""Checkpoint converter: HF safetensors (BF16/FP16/FP32, single file or sharded) -> the quantized HF checkpoint
SGLang 0.5.23 / vLLM load, with exactly the tensors the plan quantizes.

Output formats (tensor naming in backends/quantize.py; config from backends/sglang.py so the checkpoint and the
server flags can never disagree):
  * mxfp8     -> config.json quantization_config {quant_method: mxfp8, weight_block_size [1,32], scale_fmt ue8m0,
                 modules_to_not_convert}
  * nvfp4     -> ModelOpt: config.json quantization_config {quant_method: modelopt, quant_algo: NVFP4, ignore} +
                 hf_quant_config.json {quantization: {quant_algo, group_size, exclude_modules}}
  * fp8_block -> DeepSeek: {quant_method: fp8, weight_block_size [128,128], modules_to_not_convert}
plus `policyc_plan.json` (the plan JSON with its content_hash) so every consumer can check the contract.

Properties:
  * streams: one work unit (a tensor, or one share-scale group) in memory at a time; safetensors headers are
    validated before anything is allocated (safetensors_io.read_header); no pickle.
  * atomic: everything is written into `.<dst>.policyc-partial/` next to DST and renamed at the end; an existing
    DST is replaced only with force; the source directory is only read.
  * resumable: every finished output shard gets a `<shard>.done` marker (CRC32 + size) in the partial dir; a
    re-run with the same plan and source skips finished shards and produces a byte-identical result.
  * cross-shard share-scale groups (gate in shard 1, up in shard 2) are quantized together and written in the
    shard of their last member.

Public API:
  convert(src, plan, dst, force=False, progress=False) -> ConvertReport
  verify(dst, src, expected_hash=None) -> list[str]         # [] = OK; re-derives every byte from the source
  load_converted(dst) -> (Plan, {hf_name: QuantizedTensor | Tensor})
  derive_formats_from_specs({out_name: dtype}) -> {hf_name: kind}
  emit(plan) -> [Artifact]                                   # converter/manifest.json (+ configs)
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from ..plan import Plan

from .common import (PLAN_FILE, Artifact, PlanMismatch, UnsupportedByBackend, dump_json, module_of, plan_hash,
                     plan_stamp, replace_dir)
from .safetensors_io import SOURCE_DTYPES, CheckpointError, StreamingWriter, read_header

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
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a valid safetensors index ({err})") from None
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
        if "/" in s or "\\" in s or s.startswith("."):
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


def _check_source_against_plan(srcc: SourceCheckpoint, plan: Plan) -> None:
    by = plan.by_name()
    extra = sorted(set(srcc.where) - set(by))
    missing = sorted(set(by) - set(srcc.where))
    if missing:
        raise CheckpointError(f"source checkpoint lacks {len(missing)} tensor(s) of the plan, e.g. '{missing[0]}'",
                              f"was the plan compiled for model '{plan.model}'? pass the matching --model")
    if extra:
        raise CheckpointError(f"source checkpoint has {len(extra)} tensor(s) the plan does not know, e.g. "
                              f"'{extra[0]}'", f"the plan was compiled for '{plan.model}'; is this its checkpoint?")
    for name, t in by.items():
        if srcc.shapes[name] != tuple(t.shape):
            raise CheckpointError(f"tensor '{name}' has shape {srcc.shapes[name]} in the source, the plan says "
                                  f"{t.shape}")
        if srcc.dtypes[name] not in SOURCE_DTYPES:
            raise CheckpointError(f"tensor '{name}' is {srcc.dtypes[name]} in the source; the converter reads "
                                  "BF16/FP16/FP32 checkpoints", "dequantize the checkpoint to BF16 first")


# ---------------------------------------------------------------------------------------------------------------
# layout of the output
# ---------------------------------------------------------------------------------------------------------------
def output_layout(plan: Plan, srcc: SourceCheckpoint) -> dict[str, list[list[str]]]:
    """Output shard (same file name as the source shard) -> ordered work units (lists of HF names)."""
    from .quantize import work_units

    order = [n for s in srcc.shards for n in _shard_names(srcc, s)]
    layout: dict[str, list[list[str]]] = {s: [] for s in srcc.shards}
    for unit in work_units(plan, order):
        layout[srcc.where[unit[-1]]].append(unit)
    return layout


def _shard_names(srcc: SourceCheckpoint, shard: str) -> list[str]:
    return sorted(n for n, s in srcc.where.items() if s == shard)


def quantization_files(plan: Plan) -> dict[str, Optional[dict]]:
    """config.json quantization_config and hf_quant_config.json contents (None where not applicable)."""
    from .sglang import rollout_config

    try:
        cfg = rollout_config(plan)
    except UnsupportedByBackend as err:
        raise UnsupportedByBackend(BACKEND, err.tensor, f"the checkpoint's quantization_config is SGLang's: "
                                                        f"{err.capability}", err.hint) from None
    return {"quantization_config": cfg.quantization_config, "hf_quant_config": cfg.hf_quant_config}


def _specs_for_unit(plan: Plan, unit: list[str], srcc: Optional[SourceCheckpoint] = None):
    from .quantize import output_specs

    by = plan.by_name()
    out = []
    for n in unit:
        out.extend(output_specs(by[n]))
    return out


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
    grow with the checkpoint instead of the largest tensor). Safetensors format only; nothing is unpickled."""

    _DT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}

    def __init__(self, srcc: SourceCheckpoint):
        self.srcc = srcc
        self._headers: dict[str, tuple[int, dict]] = {}

    def _header(self, shard: str) -> tuple[int, dict]:
        if shard not in self._headers:
            path = self.srcc.root / shard
            with open(path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
            self._headers[shard] = (8 + n, read_header(path))
        return self._headers[shard]

    def get(self, name: str):
        import torch

        shard = self.srcc.where[name]
        base, header = self._header(shard)
        info = header[name]
        b, e = info["data_offsets"]
        buf = torch.empty(e - b, dtype=torch.uint8)
        with open(self.srcc.root / shard, "rb", buffering=0) as f:
            f.seek(base + b)
            view = memoryview(buf.numpy())
            got = 0
            while got < e - b:
                k = f.readinto(view[got:])
                if not k:
                    raise CheckpointError(f"{self.srcc.root / shard}: unexpected end of file reading '{name}'")
                got += k
        return buf.view(getattr(torch, self._DT[info["dtype"]])).reshape(info["shape"])

    def close(self) -> None:
        self._headers.clear()


def _partial_dir(dst: Path) -> Path:
    return dst.parent / f".{dst.name}.policyc-partial"


def convert(src: Path, plan: Plan, dst: Path, force: bool = False, progress: bool = False,
            on_shard_done: Optional[Callable[[str], None]] = None, device: str = "cpu") -> ConvertReport:
    """Convert `src` to `dst` under `plan` (see module docstring). `on_shard_done(shard)` is called after each
    finished shard (tests use it to simulate an interruption). `device="cuda"` quantizes on the GPU with the
    fused Triton kernels (byte-identical to the CPU references); reading and writing stay streaming on the host."""
    from .quantize import checkpoint_tensors

    src, dst = Path(src).resolve(), Path(dst).resolve()
    if dst == src or src in dst.parents or dst in src.parents:
        raise CheckpointError(f"output '{dst}' overlaps the source '{src}'", "write the output to another directory")
    if dst.exists() and not force:
        raise FileExistsError(f"output directory '{dst}' already exists (pass --force to replace it)")
    srcc = open_source(src)
    _check_source_against_plan(srcc, plan)
    qfiles = quantization_files(plan)  # raises UnsupportedByBackend before any work
    from .quantize import check_supported

    for t in plan.tensors:
        check_supported(t, BACKEND)
    layout = output_layout(plan, srcc)
    by = plan.by_name()

    part = _partial_dir(dst)
    state = {"plan_hash": plan_hash(plan), "source": str(src), "fingerprint": srcc.fingerprint()}
    if part.exists():
        try:
            old = json.loads((part / _STATE_FILE).read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != state:
            shutil.rmtree(part)
    part.mkdir(parents=True, exist_ok=True)
    (part / _STATE_FILE).write_text(json.dumps(state))

    report = ConvertReport(dst=dst)
    reader = _Reader(srcc)
    total = len(srcc.where)
    prog = _progress(progress, total)
    try:
        for shard, units in layout.items():
            out_path = part / shard
            marker = part / f"{shard}.done"
            if marker.exists() and out_path.exists():
                info = json.loads(marker.read_text())
                if info.get("size") == out_path.stat().st_size and info.get("checksum") == file_checksum(out_path):
                    report.shards_resumed.append(shard)
                    prog.advance(sum(len(u) for u in units))
                    continue
            marker.unlink(missing_ok=True)
            specs = [s for u in units for s in _specs_for_unit(plan, u)]
            tmp_path = part / f"{shard}.writing"
            writer = StreamingWriter(tmp_path, specs, metadata={"format": "pt", "policyc_plan": plan_hash(plan)})
            try:
                for unit in units:
                    members = [(by[n], reader.get(n).to(device)) for n in unit]
                    for t, _ in members:
                        report.bytes_in += t.bytes_before
                    out = checkpoint_tensors(members, BACKEND)
                    for name, _dt, _shape in _specs_for_unit(plan, unit):
                        writer.write(name, out[name])
                    del members, out
                    prog.advance(len(unit))
                writer.close()
            except BaseException:
                writer.abort()
                tmp_path.unlink(missing_ok=True)
                raise
            tmp_path.replace(out_path)
            marker.write_text(json.dumps({"checksum": writer.checksum(), "size": writer.size}))
            report.shards_written.append(shard)
            if on_shard_done is not None:
                on_shard_done(shard)
    finally:
        reader.close()
        prog.stop()

    # index, configs, plan, side files
    weight_map: dict[str, str] = {}
    total_size = 0
    for shard, units in layout.items():
        for u in units:
            for name, dt, shape in _specs_for_unit(plan, u):
                weight_map[name] = shard
        total_size += (part / shard).stat().st_size
    report.bytes_out = total_size
    (part / INDEX_FILE).write_text(dump_json({"metadata": {"total_size": total_size,
                                                           "policyc_plan": plan_hash(plan)},
                                              "weight_map": dict(sorted(weight_map.items()))}, compact=True))
    cfg_path = src / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if qfiles["quantization_config"] is not None:
        config["quantization_config"] = qfiles["quantization_config"]
    else:
        config.pop("quantization_config", None)
    (part / "config.json").write_text(dump_json(config))
    if qfiles["hf_quant_config"] is not None:
        (part / "hf_quant_config.json").write_text(dump_json(qfiles["hf_quant_config"]))
    (part / PLAN_FILE).write_text(plan.to_json(indent=None) + "\n")
    for p in sorted(src.iterdir()):
        if not p.is_file() or p.suffix == ".safetensors" or p.name in _NOT_COPIED or p.name.startswith("."):
            continue
        if p.suffix in _PICKLE_SUFFIXES:
            report.skipped_files.append(p.name)  # pickled weights are never read nor copied
            continue
        shutil.copyfile(p, part / p.name)
        report.copied_files.append(p.name)
    for p in part.iterdir():
        if p.name.endswith(".done") or p.name == _STATE_FILE:
            p.unlink()
    replace_dir(part, dst)
    return report


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
    if not path.is_file():
        raise CheckpointError(f"'{dst}' has no {PLAN_FILE}: it was not written by `policyc convert`")
    try:
        return Plan.from_json(path.read_text())
    except ValueError as err:
        raise CheckpointError(f"{path}: {err}") from None


def _dst_tensors(dst: Path) -> dict[str, tuple[str, str]]:
    """{tensor name: (shard file, dtype)} of a converted checkpoint, from validated headers."""
    dst = Path(dst)
    out: dict[str, tuple[str, str]] = {}
    for s in sorted(p.name for p in dst.glob("*.safetensors")):
        for name, info in read_header(dst / s).items():
            out[name] = (s, info["dtype"])
    return out


def derive_formats_from_specs(specs: dict[str, str], plan_names: list[str]) -> dict[str, str]:
    """{hf_name: kind} from output tensor names + dtypes only (what a loader sees): `X.weight_scale_2` -> nvfp4,
    `X.weight_scale_inv` U8 -> mxfp8, F32 -> fp8_block, otherwise the stored dtype."""
    dt_kind = {"BF16": "bf16", "F16": "fp16", "F32": "fp32"}
    out: dict[str, str] = {}
    for n in plan_names:
        mod = module_of(n)
        if n.endswith(".weight") and f"{mod}.weight_scale_2" in specs:
            out[n] = "nvfp4"
        elif n.endswith(".weight") and f"{mod}.weight_scale_inv" in specs:
            out[n] = "mxfp8" if specs[f"{mod}.weight_scale_inv"] == "U8" else "fp8_block"
        else:
            out[n] = dt_kind.get(specs.get(n, ""), specs.get(n, "missing"))
    return out


def load_converted(dst: Path, names: Optional[list[str]] = None):
    """(plan, {hf_name: QuantizedTensor | Tensor}) read back from a converted checkpoint (safetensors only)."""
    from .quantize import output_specs, read_quantized

    plan = read_plan(dst)
    reader = _Reader(open_source(Path(dst)))
    out = {}
    for t in plan.tensors:
        if names is not None and t.hf_name not in names:
            continue
        raw = {name: reader.get(name) for name, _dt, _shape in output_specs(t)}
        out[t.hf_name] = read_quantized(t, raw)
    return plan, out


def verify(dst: Path, src: Path, expected_hash: Optional[str] = None, progress: bool = False) -> list[str]:
    """Re-derive every output byte from the source and compare. Returns a list of problems ([] = verified)."""
    import torch

    from .quantize import checkpoint_tensors

    dst = Path(dst)
    plan = read_plan(dst)
    problems: list[str] = []
    if expected_hash is not None and expected_hash != plan_hash(plan):
        raise PlanMismatch(f"{dst / PLAN_FILE}", expected_hash, plan_hash(plan))
    srcc = open_source(Path(src))
    _check_source_against_plan(srcc, plan)
    layout = output_layout(plan, srcc)
    have = _dst_tensors(dst)
    expected_names = {name for units in layout.values() for u in units for name, _, _ in _specs_for_unit(plan, u)}
    for n in sorted(set(have) - expected_names):
        problems.append(f"unexpected tensor '{n}' in {have[n][0]}")
    for n in sorted(expected_names - set(have)):
        problems.append(f"missing tensor '{n}'")
    qfiles = quantization_files(plan)
    cfg_path = dst / "config.json"
    config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    if config.get("quantization_config") != qfiles["quantization_config"]:
        problems.append("config.json quantization_config differs from the plan's")
    if qfiles["hf_quant_config"] is not None:
        hq = dst / "hf_quant_config.json"
        if not hq.is_file() or json.loads(hq.read_text()) != qfiles["hf_quant_config"]:
            problems.append("hf_quant_config.json differs from the plan's")
    by = plan.by_name()
    reader = _Reader(srcc)
    out_reader = _Reader(open_source(dst))
    prog = _progress(progress, len(plan.tensors))
    try:
        for shard, units in layout.items():
            for unit in units:
                out = checkpoint_tensors([(by[n], reader.get(n)) for n in unit], BACKEND)
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
                prog.advance(len(unit))
    finally:
        prog.stop()
    return problems


# ---------------------------------------------------------------------------------------------------------------
# emit (no checkpoint needed): what the converter WILL write
# ---------------------------------------------------------------------------------------------------------------
def emit(plan: Plan) -> list[Artifact]:
    from .quantize import check_all_supported, output_specs

    check_all_supported(plan.tensors, BACKEND)
    qfiles = quantization_files(plan)
    manifest = {"policyc": plan_stamp(plan),
                "formats": sorted({k.value for k in {t.weight.kind for t in plan.quantized()}}),
                "quantization_config": qfiles["quantization_config"],
                "hf_quant_config": qfiles["hf_quant_config"],
                "tensors": {t.hf_name: [[n, dt, list(sh)] for n, dt, sh in output_specs(t)] for t in plan.tensors}}
    return [Artifact("converter/manifest.json", dump_json(manifest, compact=True),
                     "every output tensor (name, dtype, shape) per plan tensor + checkpoint configs")]
