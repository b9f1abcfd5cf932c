"""Safe, bounded-memory safetensors I/O for the converter (no pickle anywhere).

* `read_header(path)` validates the 8-byte length and the JSON header (declared sizes, dtypes, offsets inside the
  file, no overlaps) BEFORE anything is allocated or mmapped, so a hostile header cannot make us allocate.
* `StreamingWriter` writes a safetensors file tensor by tensor: the header is computed up front from the declared
  (name, dtype, shape) specs, then each tensor's bytes are appended as it is produced, so peak memory is one
  work unit, not one shard. Output is deterministic (same specs + same bytes -> same file) which makes resumed
  conversions byte-identical.

File format (https://github.com/huggingface/safetensors, format section): u64 little-endian header length N,
N bytes of UTF-8 JSON {name: {dtype, shape, data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with
spaces so that 8 + N is a multiple of 8, then the raw little-endian tensor bytes; offsets are relative to the
start of the data section.
"""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path
from typing import Optional
from ..errors import PolicycError

from ..precision import HP_DTYPE_NAMES

DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
SOURCE_DTYPES = {st for _, st in HP_DTYPE_NAMES.values()}  # what the converter reads: BF16 / F16 / F32


class CheckpointError(PolicycError, ValueError):
    """A checkpoint file is malformed or not what the converter accepts. Names the file (and tensor)."""

    code = 2

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def read_header(path: Path) -> dict[str, dict]:
    """{name: {dtype, shape, data_offsets}} of a safetensors file, validated against the file size."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"{path}: not a regular file")
            size = st.st_size
            if size < 8:
                raise CheckpointError(f"{path}: {size} bytes is too small to be a safetensors file")
            (n,) = struct.unpack("<Q", f.read(8))
            if n > MAX_HEADER_BYTES or n > size - 8:
                raise CheckpointError(f"{path}: header length {n} exceeds the file size ({size}) or the "
                                      f"{MAX_HEADER_BYTES}-byte limit", "the file is truncated or not safetensors")
            raw = f.read(n)
    except OSError as err:
        raise CheckpointError(f"{path}: cannot read: {err.strerror or err}") from None
    from ..jsonsafe import loads_bounded

    header = loads_bounded(raw, f"{path}: header", CheckpointError, max_bytes=MAX_HEADER_BYTES, max_depth=4)
    if not isinstance(header, dict):
        raise CheckpointError(f"{path}: header is not a JSON object")
    meta = header.get("__metadata__")
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise CheckpointError(f"{path}: __metadata__ must map strings to strings")
    header.pop("__metadata__", None)
    data_len = size - 8 - n
    spans = []
    for name, info in header.items():
        if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
            raise CheckpointError(f"{path}: tensor '{name}' has a malformed header entry")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in DTYPE_SIZES:
            raise CheckpointError(f"{path}: tensor '{name}' has unknown dtype {dt!r}")
        if not isinstance(shape, list) or len(shape) > 8 or not all(
                type(d) is int and 0 <= d <= data_len for d in shape):
            raise CheckpointError(f"{path}: tensor '{name}' has invalid shape {shape!r}")
        if (not isinstance(offs, list) or len(offs) != 2 or not all(type(o) is int for o in offs)
                or not 0 <= offs[0] <= offs[1] <= data_len):
            raise CheckpointError(f"{path}: tensor '{name}' data_offsets {offs!r} lie outside the file "
                                  f"(data section is {data_len} bytes)", "the file is truncated or corrupt")
        if offs[1] - offs[0] != _numel(shape) * DTYPE_SIZES[dt]:
            raise CheckpointError(f"{path}: tensor '{name}' declares {offs[1] - offs[0]} bytes but shape {shape} "
                                  f"{dt} needs {_numel(shape) * DTYPE_SIZES[dt]}")
        spans.append((offs[0], offs[1], name))
    spans.sort()
    for (b0, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
        if b1 < e0:
            raise CheckpointError(f"{path}: tensors '{n0}' and '{n1}' overlap")
    return header


def header_bytes(specs: list[tuple[str, str, tuple[int, ...]]], metadata: Optional[dict] = None) -> bytes:
    """The full header block (length prefix + padded JSON) for tensors written in `specs` order."""
    hdr: dict = {}
    if metadata:
        hdr["__metadata__"] = metadata
    off = 0
    for name, dt, shape in specs:
        nb = _numel(shape) * DTYPE_SIZES[dt]
        hdr[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [off, off + nb]}
        off += nb
    js = json.dumps(hdr, separators=(",", ":")).encode()
    js += b" " * ((8 - (8 + len(js)) % 8) % 8)
    return struct.pack("<Q", len(js)) + js


_TORCH_DT = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U8": "uint8", "F8_E4M3": "float8_e4m3fn"}


class StreamingWriter:
    """Write a safetensors file whose tensors are known up front by (name, dtype, shape), data appended in order."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: Optional[dict] = None):
        self.path = Path(path)
        self.specs = specs
        self._next = 0
        self._f = open(self.path, "wb")
        # CRC32 of the whole file, computed while writing (no re-read): the resume marker's integrity check against
        # a truncated/corrupted partial shard. (sha256 cost ~0.3 s per 400 MB here; CRC32 is ~10x cheaper.)
        self._crc = 0
        self.size = 0
        self._put(header_bytes(specs, metadata))

    def _put(self, data) -> None:
        import zlib

        self._f.write(data)
        self._crc = zlib.crc32(data, self._crc)
        self.size += len(data) if isinstance(data, bytes) else data.nbytes

    def write(self, name: str, tensor) -> None:
        import torch

        want_name, dt, shape = self.specs[self._next]
        if name != want_name or tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != f"torch.{_TORCH_DT[dt]}":
            raise AssertionError(f"streaming writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                                 f"{want_name} {shape} {dt}")
        flat = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self._put(memoryview(flat.numpy()))
        self._next += 1

    def checksum(self) -> str:
        return f"crc32:{self._crc:08x}"

    def close(self) -> None:
        if self._next != len(self.specs):
            self._f.close()
            raise AssertionError(f"streaming writer: {len(self.specs) - self._next} tensors were not written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()

    def abort(self) -> None:
        self._f.close()
