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

import errno
import json
import os
import re
import stat
import struct
from pathlib import Path
from typing import Optional
from precision_dsl.errors import PolicycError

from precision_dsl.precision import HP_DTYPE_NAMES

DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors library's own limit
# Tensors in ONE file. A released shard (~5 GB) holds a few thousand; even an unsharded Kimi-K2-sized model (384
# experts x 61 layers x 3 weights + their scales) stays under it. Each parsed entry costs ~0.8 KB of Python objects,
# so this also bounds what a hostile header costs before it is refused.
MAX_HEADER_ENTRIES = 1 << 17
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


# `"data_offsets": [b, e]` in the raw header. In valid JSON a match is always a key (a quote ending a string right
# after `data_offsets`, then `:`); a match that is not a tensor entry's offsets makes the header invalid anyway.
_OFFSETS = re.compile(rb'"data_offsets"\s*:\s*\[\s*(\d{1,19})\s*,\s*(\d{1,19})\s*\]')


def _check_budget(raw: bytes, data_len: int, path: Path) -> None:
    """Refuse, on the raw bytes and before json builds one object per entry, a header with more entries than any
    real file or whose entries declare more bytes than the data section holds (non-overlapping tensors inside the
    file cannot). Counts and sums only; every entry is validated by name after parsing."""
    entries = raw.count(b'"data_offsets"')
    if entries > MAX_HEADER_ENTRIES:
        raise CheckpointError(f"{path}: header declares {entries} tensors (limit {MAX_HEADER_ENTRIES} per file)",
                              "the file is not a safetensors checkpoint shard")
    declared = 0
    for m in _OFFSETS.finditer(raw):
        declared += max(0, int(m[2]) - int(m[1]))
        if declared > data_len:
            raise CheckpointError(f"{path}: tensors declare more than the {data_len}-byte data section holds "
                                  "(overlapping or outside the file)", "the file is truncated or corrupt")


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
    _check_budget(raw, size - 8 - n, path)
    from precision_dsl.jsonsafe import loads_bounded

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


# ---- streaming writer -----------------------------------------------------------------------------------------
# Why the writer looks like this (measured on the 2-core CI box, benchmarks/RESULTS.md "Checkpoint converter"): a
# per-tensor `file.write` + CRC32 + torch->numpy round trip on the converter's thread ran at 0.1-0.4x a plain
# safetensors read+write. The bytes now go through a few large, reused, page-aligned staging buffers: the caller's
# thread only copies each tensor into the current buffer; one thread CRC32s each full buffer (zlib releases the
# GIL) while a second writes the same buffer with O_DIRECT where the filesystem allows it (no page-cache copy, no dirty-page writeback
# competing with the next shard; the shard is fsynced at close either way). Output bytes and the CRC are exactly
# those of the sequential writer.
_CHUNK = 32 << 20  # staging buffer size: large sequential writes (O_DIRECT reached ~2.8 GB/s at 32-64 MB here)
_NBUF = 4  # one being filled, one being checksummed, one being written, one spare
_ALIGN = 4096  # O_DIRECT: buffer address, file offset and length multiples of the logical block size (<= 4096)
_POOL: list = []  # staging buffers, reused across writers: freshly touched memory costs ~2 s/GB on a VM


def _direct_io_default() -> bool:
    # POLICYC_DIRECT_IO=0 writes through the page cache instead (benchmarks compare both; some filesystems or
    # setups prefer it). Unsupported filesystems fall back automatically.
    return os.environ.get("POLICYC_DIRECT_IO", "1") != "0"


def _take_buffer():
    import mmap

    return _POOL.pop() if _POOL else mmap.mmap(-1, _CHUNK)  # anonymous mmap: page aligned, as O_DIRECT needs


def read_exact(fd: int, view: memoryview, offset: int, name: str, path=None) -> None:
    """Fill `view` from file `fd` at `offset` (positioned reads: no GIL held, no shared file position); a short
    file is a CheckpointError naming the tensor `name` (and the file, when given)."""
    got, want = 0, len(view)
    while got < want:
        k = os.preadv(fd, [view[got:]], offset + got)
        if not k:
            raise CheckpointError(f"{path}: unexpected end of file reading '{name}'" if path is not None
                                  else f"unexpected end of file reading '{name}'")
        got += k


class StreamingWriter:
    """Write a safetensors file whose tensors are known up front by (name, dtype, shape), data appended in order.

    `write` copies the tensor (CPU or CUDA) into a staging buffer and returns; the caller's tensor may be reused
    right away. `close` waits for the writer thread, fsyncs, and re-raises any write error (e.g. a full disk)."""

    def __init__(self, path: Path, specs: list[tuple[str, str, tuple[int, ...]]], metadata: Optional[dict] = None,
                 direct: Optional[bool] = None):
        import queue
        import threading

        self.path = Path(path)
        self.specs = specs
        self._next = 0
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
        self._direct = self._set_direct(_direct_io_default() if direct is None else direct)
        # CRC32 of the whole file (written bytes, in order): the resume marker's integrity check against a truncated
        # or corrupted partial shard. Computed by the checksum thread on the staging buffers, never by re-reading.
        self._crc = 0
        self.size = 0
        self._error: Optional[BaseException] = None
        self._free: "queue.Queue" = queue.Queue()
        self._todo: "queue.Queue" = queue.Queue()
        self._bufs = [_take_buffer() for _ in range(_NBUF)]
        for b in self._bufs[1:]:
            self._free.put(b)
        self._cur, self._pos = self._bufs[0], 0
        self._view = None  # torch uint8 view of the current buffer (made lazily, for CUDA tensors only)
        self._written: "queue.Queue" = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[int, int] = {}  # id(buffer) -> stages still reading it
        self._closed = self._abandoned = False
        self._threads = [threading.Thread(target=self._checksum_stage, name="policyc-shard-crc", daemon=True),
                         threading.Thread(target=self._write_stage, name="policyc-shard-write", daemon=True)]
        for th in self._threads:
            th.start()
        self._put(header_bytes(specs, metadata))

    # -- writer thread ------------------------------------------------------------------------------------------------
    def _set_direct(self, want: bool) -> bool:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return False
        import fcntl

        try:
            fl = fcntl.fcntl(self._fd, fcntl.F_GETFL)
            fcntl.fcntl(self._fd, fcntl.F_SETFL, (fl | flag) if want else (fl & ~flag))
        except OSError:  # the filesystem has no direct I/O (tmpfs on older kernels, some FUSE/overlay setups)
            return False
        return want

    def _write_all(self, data) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._fd, view):]
            except OSError as err:
                # O_DIRECT accepted at open but refused for this write (alignment rules of the device/filesystem):
                # write through the page cache from here on. Anything else (ENOSPC, EIO) is a real error.
                if not (self._direct and err.errno == errno.EINVAL):
                    raise
                self._direct = self._set_direct(False)

    def _stage(self, queue, work) -> None:
        """One writer thread: `work(buf, n)` on each buffer of `queue` in file order until None; the first error is
        kept (re-raised on the caller's thread by the next write/close) and later buffers are only handed back."""
        while True:
            item = queue.get()
            if item is None:
                return
            buf, n = item
            try:
                if self._error is None and not self._abandoned:
                    with memoryview(buf) as mv:
                        work(mv[:n])
            except BaseException as err:
                self._error = err
            finally:
                self._done_with(buf)

    def _checksum_stage(self) -> None:
        """Thread 1: CRC32 of each full buffer, in file order (zlib releases the GIL)."""
        import zlib

        def crc(data) -> None:
            self._crc = zlib.crc32(data, self._crc)
            data.release()

        self._stage(self._todo, crc)

    def _write_stage(self) -> None:
        """Thread 2, on the same buffers at the same time as thread 1 (both only read them): writes each buffer in
        file order; it mostly waits for the device, so it overlaps the checksum and the caller's reads."""
        def write(data) -> None:
            n = len(data)
            if self._direct and n % _ALIGN:  # the file's tail: direct I/O takes whole blocks only
                cut = n - n % _ALIGN
                self._write_all(data[:cut])
                self._direct = self._set_direct(False)
                self._write_all(data[cut:])
            else:
                self._write_all(data)
            data.release()

        self._stage(self._written, write)

    def _done_with(self, buf) -> None:
        """A buffer goes back to the caller once both stages are done with it."""
        with self._lock:
            left = self._pending[id(buf)] = self._pending[id(buf)] - 1
        if not left:
            self._free.put(buf)

    # -- caller's side -------------------------------------------------------------------------------------------------
    def _check_error(self) -> None:
        if self._error is not None:
            raise self._error

    def _submit(self, buf, n: int) -> None:
        with self._lock:
            self._pending[id(buf)] = 2
        self._todo.put((buf, n))
        self._written.put((buf, n))

    def _flush_current(self) -> None:
        buf, self._cur, self._view = self._cur, None, None  # an interrupt while waiting must not resubmit it
        self._submit(buf, self._pos)
        self._cur, self._pos = self._free.get(), 0
        self._check_error()

    def _put(self, data) -> None:
        """Append raw bytes (the header; device units' packed outputs)."""
        view = memoryview(data).cast("B")
        while view:
            k = min(len(view), _CHUNK - self._pos)
            self._cur[self._pos:self._pos + k] = view[:k]
            self._pos += k
            self.size += k
            view = view[k:]
            if self._pos == _CHUNK:
                self._flush_current()

    def write(self, name: str, tensor) -> None:
        import torch

        self._check_error()
        want_name, dt, shape = self.specs[self._next]
        if name != want_name or tuple(tensor.shape) != tuple(shape) or str(tensor.dtype) != f"torch.{_TORCH_DT[dt]}":
            raise AssertionError(f"streaming writer: got {name} {tuple(tensor.shape)} {tensor.dtype}, expected "
                                 f"{want_name} {shape} {dt}")
        flat = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        # CPU bytes: a plain memcpy on this thread (torch's copy_ is OpenMP-parallel, and on a loaded 2-core box
        # its barriers cost milliseconds per call); CUDA bytes: torch's D2H copy straight into the buffer.
        src = None if flat.is_cuda else memoryview(flat.numpy())
        off, total = 0, flat.numel()
        while off < total:
            k = min(total - off, _CHUNK - self._pos)
            if src is not None:
                self._cur[self._pos:self._pos + k] = src[off:off + k]
            else:
                if self._view is None:
                    self._view = torch.frombuffer(self._cur, dtype=torch.uint8)
                self._view[self._pos:self._pos + k].copy_(flat[off:off + k])
            self._pos += k
            self.size += k
            off += k
            if self._pos == _CHUNK:
                self._flush_current()
        del src
        self._next += 1

    def write_raw(self, names: list[str], data) -> None:
        """Append the next len(names) tensors given as their bytes, back to back (the caller checked dtypes and
        shapes; here the names and the total size are held to the specs)."""
        self._check_error()
        want = 0
        for name in names:
            want_name, dt, shape = self.specs[self._next]
            if name != want_name:
                raise AssertionError(f"streaming writer: got {name}, expected {want_name}")
            want += _numel(shape) * DTYPE_SIZES[dt]
            self._next += 1
        if len(data) != want:
            raise AssertionError(f"streaming writer: {len(data)} bytes for {names}, the specs say {want}")
        self._put(data)

    def write_from_file(self, name: str, fd: int, offset: int, check=None) -> bool:
        """Append tensor `name` (the next spec) by reading its bytes from `fd` at `offset` straight into the staging
        buffers: no intermediate tensor, no second copy (pass-through tensors). `check(piece)` sees every piece (a
        writable memoryview of whole elements when `self.size` is a multiple of the element size) before it is
        handed to the writer threads; a False return stops here and returns False (the caller raises)."""
        self._check_error()
        want_name, dt, shape = self.specs[self._next]
        if name != want_name:
            raise AssertionError(f"streaming writer: got {name}, expected {want_name}")
        remaining = _numel(shape) * DTYPE_SIZES[dt]
        while remaining:
            k = min(remaining, _CHUNK - self._pos)
            with memoryview(self._cur) as mv:
                piece = mv[self._pos:self._pos + k]
                read_exact(fd, piece, offset, name)
                ok = check is None or check(piece)
                piece.release()
            if not ok:
                return False
            self._pos += k
            self.size += k
            offset += k
            remaining -= k
            if self._pos == _CHUNK:
                self._flush_current()
        self._next += 1
        return True

    def checksum(self) -> str:
        return f"crc32:{self._crc:08x}"

    def _finish(self, last: bool = True) -> None:
        """Hand the last buffer over (`last`), stop the threads, give the buffers back to the pool (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._cur is not None:
            self._submit(self._cur, self._pos) if (self._pos and last) else self._free.put(self._cur)
        self._cur, self._view = None, None
        self._todo.put(None)
        self._written.put(None)
        for th in self._threads:
            th.join()
        while not self._free.empty():
            _POOL.append(self._free.get())

    def close(self) -> None:
        self._finish()
        try:
            self._check_error()
            if self._next != len(self.specs):
                raise AssertionError(f"streaming writer: {len(self.specs) - self._next} tensors were not written")
            os.fsync(self._fd)
        finally:
            self._close_fd()

    def _close_fd(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def abort(self) -> None:
        """Stop without finishing the file (after an error; a no-op after close). Buffers still queued are not
        written: the partial file is never used (it only ever becomes a shard through close + rename)."""
        if not self._closed:
            self._abandoned = True
        self._finish(last=False)
        self._close_fd()
