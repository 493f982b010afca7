"""Sharded safetensors writer with Hugging Face's shard naming and index.

Two modes, one API (`add`, then `finalize`):
- planned (pass `plan`, the (name, dtype, shape) of every tensor to come): shard boundaries and
  headers are fixed up front, each tensor is written straight to its place in its shard file
  (positional writes, any order), so memory is bounded by one tensor;
- unplanned: tensors are buffered up to `max_shard_size` and flushed, as mergekit does.

Planned mode copies unchanged tensors file to file (`copy_from`, in the kernel with
copy_file_range). With `background_copies`, those copies run on one worker thread while the caller
computes the tensors that change (the copy releases the GIL), and runs of tensors that are
contiguous in both files are joined into one copy. Planned shards are preallocated (a full disk
fails at once, and ext4 copies into allocated extents faster). A checkpoint converts at about copy
speed (issue 18; a second copy thread measured no faster on 2 cores). Failures of a background copy
are raised by `finalize`.

Files are `model.safetensors` when there is one shard, else `model-0000i-of-0000n.safetensors`
plus `model.safetensors.index.json` ({"metadata": {"total_parameters", "total_size"}, "weight_map"},
indent 2, sorted keys, as transformers writes it). `metadata` (str -> str) goes into every
shard's `__metadata__` ("format": "pt" is always set, as transformers requires it).
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass, field
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from kvtool.io.outputfile import (PAGE, Identity, check_unchanged, copy_range, create, move, open_new, open_source,
                                  write_new)
from kvtool.io.safetensors_header import DTYPE_BYTES

if TYPE_CHECKING:
    import torch

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
DEFAULT_MAX_SHARD_SIZE = 5 * 10**9
_ALIGN = 8  # safetensors pads the header so tensor data starts 8-byte aligned


def torch_dtype_to_st(dtype) -> str:
    """torch dtype -> safetensors dtype string ('BF16', 'F32', ...)."""
    import torch

    table = {
        torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
        torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
        torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
    }
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            table[getattr(torch, name)] = {"uint16": "U16", "uint32": "U32", "uint64": "U64"}[name]
    if hasattr(torch, "float8_e8m0fnu"):
        table[torch.float8_e8m0fnu] = "F8_E8M0"
    try:
        return table[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors equivalent") from None


def nbytes_of(dtype: str, shape: Iterable[int]) -> int:
    shape = tuple(shape)
    return int((prod(shape) if shape else 1) * DTYPE_BYTES[dtype])


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return nbytes_of(self.dtype, self.shape)


@dataclass
class _Shard:
    entries: list[PlannedTensor] = field(default_factory=list)
    size: int = 0
    file: str = ""
    header: bytes = b""
    offsets: dict[str, int] = field(default_factory=dict)  # name -> absolute file offset of its data
    written: set[str] = field(default_factory=set)
    fd: int | None = None
    buffered: dict = field(default_factory=dict)  # unplanned mode: name -> tensor


@dataclass
class _CopyRun:
    """Bytes contiguous in one source file and one shard: copied with one copy_file_range loop."""

    src: str
    shard: _Shard
    src_off: int
    dst_off: int
    nbytes: int

    def extends(self, src: str, shard: _Shard, src_off: int, dst_off: int) -> bool:
        return src == self.src and shard is self.shard and (src_off, dst_off) == (
            self.src_off + self.nbytes, self.dst_off + self.nbytes)


@dataclass(frozen=True)
class WriteResult:
    files: list[str]
    index_file: str | None
    total_size: int
    total_parameters: int
    weight_map: dict[str, str]


def _split(entries: list[PlannedTensor], max_size: int) -> list[_Shard]:
    shards: list[_Shard] = []
    cur = _Shard()
    for e in entries:
        if cur.entries and cur.size + e.nbytes > max_size:
            shards.append(cur)
            cur = _Shard()
        cur.entries.append(e)
        cur.size += e.nbytes
    if cur.entries:
        shards.append(cur)
    return shards


def _shard_names(n: int) -> list[str]:
    if n == 1:
        return [SINGLE_NAME]
    return [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def _build_header(shard: _Shard, metadata: dict[str, str], copy_offsets: dict[str, int] | None = None) -> None:
    obj: dict = {"__metadata__": metadata}
    pos = 0
    rel: dict[str, int] = {}
    for e in shard.entries:
        obj[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
        rel[e.name] = pos
        pos += e.nbytes
    raw = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    raw += b" " * _header_padding(8 + len(raw), rel, shard.entries, copy_offsets or {})
    shard.header = len(raw).to_bytes(8, "little") + raw
    shard.offsets = {n: len(shard.header) + p for n, p in rel.items()}


def _header_padding(data_start: int, rel: dict[str, int], entries: list[PlannedTensor],
                    copy_offsets: dict[str, int]) -> int:
    """Spaces after the header JSON (safetensors allows them): the data starts 8-byte aligned and, where
    tensors will be copied from a source file, at the offset that puts the most copied bytes at the
    same offset within a page as in their source, which the kernel needs to copy whole pages."""
    pad = -data_start % _ALIGN
    weight: dict[int, int] = {}
    for e in entries:
        if e.name in copy_offsets:
            r = (copy_offsets[e.name] - data_start - rel[e.name]) % PAGE
            if r % _ALIGN == pad:
                weight[r] = weight.get(r, 0) + e.nbytes
    return max(weight, key=lambda r: (weight[r], -r)) if weight else pad


def _tensor_bytes(tensor) -> memoryview:
    """A zero-copy byte view of a CPU tensor or numpy array (little-endian, as safetensors stores it)."""
    import numpy as np

    if isinstance(tensor, np.ndarray):
        a = np.ascontiguousarray(tensor)
        if a.dtype.byteorder == ">":
            a = a.astype(a.dtype.newbyteorder("<"))
        return memoryview(a.reshape(-1).view(np.uint8))
    t = tensor.detach()
    if t.device.type != "cpu":
        t = t.to("cpu")
    t = t.contiguous().reshape(-1)
    import torch

    return memoryview(t.view(torch.uint8).numpy())


def _copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int) -> None:
    """Copy bytes file to file (kvtool.io.outputfile.copy_range: inside the kernel, else a bounded buffer)."""
    if copy_range(src_fd, dst_fd, src_off, dst_off, count) < count:
        raise OSError("unexpected end of the source file")


def _copy_file(src_path: str, dst_fd: int, src_off: int, dst_off: int, count: int,
               expect: Identity | None = None) -> None:
    """Copy a byte range of a source opened once, as validated (`expect`), and unchanged after the copy."""
    src_fd, ident = open_source(src_path, expect)
    try:
        _copy_range(src_fd, dst_fd, src_off, dst_off, count)
        check_unchanged(src_path, ident, src_fd)
    finally:
        os.close(src_fd)


def _preallocate(fd: int, size: int) -> None:
    """Reserve a planned shard's blocks: a full disk fails before any work, and copies into
    allocated extents run about 1.4x faster on ext4 than into a growing file (issue 18)."""
    if not hasattr(os, "posix_fallocate"):
        return
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            raise


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    while len(data):
        n = os.pwrite(fd, data, offset)
        data = data[n:]
        offset += n


class ShardWriter:
    """Write tensors into HF-named safetensors shards under `out_dir` (which must exist).

    `copy_offsets` (planned mode: name -> absolute offset in its source file) names the tensors
    expected through `copy_from`; the header padding then keeps them page-congruent with their
    source. It is a hint: any tensor may still be written either way.

    `sources` (path -> kvtool.io.outputfile.Identity, as recorded when the source was validated:
    CheckpointReader.identities) are the files `copy_from` may copy from: each copy opens its source,
    checks it is still that file, copies from that descriptor and checks it again; `finalize` checks
    every one once more. A change is SourceChanged (exit 2) and the caller's staged output is removed."""

    def __init__(self, out_dir: str | Path, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
                 metadata: dict[str, str] | None = None, plan: Iterable[PlannedTensor | tuple] | None = None,
                 background_copies: bool = False, copy_offsets: dict[str, int] | None = None,
                 sources: dict[str, Identity] | None = None):
        if max_shard_size <= 0:
            raise ValueError("max_shard_size must be positive")
        self.out_dir = Path(out_dir)
        self.max_shard_size = int(max_shard_size)
        self.metadata = {"format": "pt", **{str(k): str(v) for k, v in (metadata or {}).items()}}
        self._planned = plan is not None
        self._shards: list[_Shard] = []
        self._where: dict[str, _Shard] = {}
        self._plan: dict[str, PlannedTensor] = {}
        self._finalized = False
        self._background = background_copies
        self._run: _CopyRun | None = None  # the copy being extended (joined with the next contiguous one)
        self._copier = None  # ThreadPoolExecutor(1), started by the first background copy
        self._pending: list = []
        self._sources: dict[str, Identity] = dict(sources or {})
        if plan is not None:
            entries = [p if isinstance(p, PlannedTensor) else PlannedTensor(p[0], p[1], tuple(p[2])) for p in plan]
            for e in entries:
                if e.name in self._plan:
                    raise ValueError(f"tensor {e.name!r} is planned twice")
                self._plan[e.name] = e
            self._shards = _split(entries, self.max_shard_size)
            for shard, fname in zip(self._shards, _shard_names(len(self._shards))):
                shard.file = fname
                _build_header(shard, self.metadata, copy_offsets)
                for e in shard.entries:
                    self._where[e.name] = shard

    # --- adding ----------------------------------------------------------------------------
    def add(self, name: str, tensor: "torch.Tensor") -> None:
        """Write (planned) or buffer (unplanned) one tensor."""
        if self._finalized:
            raise RuntimeError("ShardWriter.add after finalize")
        st_dtype = torch_dtype_to_st(tensor.dtype)
        shape = tuple(tensor.shape)
        if self._planned:
            self._add_planned(name, tensor, st_dtype, shape)
        else:
            self._add_buffered(name, tensor, st_dtype, shape)

    def add_array(self, name: str, array, st_dtype: str) -> None:
        """Like `add`, for a numpy storage array whose safetensors dtype is `st_dtype` (BF16 as uint16)."""
        from kvtool.io.arrays import storage_dtype

        if array.dtype.itemsize != storage_dtype(st_dtype).itemsize:
            raise ValueError(f"tensor {name!r}: a {array.dtype} array cannot hold {st_dtype}")
        if self._planned:
            self._add_planned(name, array, st_dtype, tuple(array.shape))
        else:
            self._add_buffered(name, array, st_dtype, tuple(array.shape))

    def copy_from(self, name: str, src_path: str | Path, offset: int, nbytes: int) -> None:
        """Planned mode: write a tensor's bytes straight from a source file (no tensor in memory).

        `offset` is the absolute position of the tensor data in `src_path`; its dtype and shape
        must be the planned ones (the caller copies unchanged tensors only)."""
        if not self._planned:
            raise RuntimeError("copy_from needs a planned ShardWriter")
        shard = self._slot(name)
        if nbytes != self._plan[name].nbytes:
            raise ValueError(f"tensor {name!r}: {nbytes} bytes to copy, the plan needs {self._plan[name].nbytes}")
        dst_off = shard.offsets[name]
        if not self._background:
            _copy_file(str(src_path), shard.fd, offset, dst_off, nbytes, self._sources.get(str(src_path)))
            self._done(shard, name)
            return
        shard.written.add(name)  # the shard's fd stays open until finalize: the copy is still to come
        if self._run is not None and self._run.extends(str(src_path), shard, offset, dst_off):
            self._run.nbytes += nbytes
            return
        self._submit_run()
        self._run = _CopyRun(str(src_path), shard, offset, dst_off, nbytes)

    def _submit_run(self) -> None:
        run, self._run = self._run, None
        if run is None:
            return
        if self._copier is None:
            from concurrent.futures import ThreadPoolExecutor

            self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvtool-copy")
        for f in [f for f in self._pending if f.done()]:  # a failed copy stops the run early
            self._pending.remove(f)
            f.result()
        self._pending.append(self._copier.submit(_copy_file, run.src, run.shard.fd, run.src_off, run.dst_off,
                                                 run.nbytes, self._sources.get(run.src)))

    def _wait_copies(self) -> None:
        """Run the queued copies and wait for them; the first failure is raised."""
        self._submit_run()
        pending, self._pending = self._pending, []
        try:
            for f in pending:
                f.result()
        finally:
            if self._copier is not None:
                self._copier.shutdown(wait=True, cancel_futures=True)
                self._copier = None

    def _slot(self, name: str) -> _Shard:
        """The open shard a planned tensor goes to (opened, header written, on first use)."""
        if self._finalized:
            raise RuntimeError("ShardWriter.add after finalize")
        shard = self._where.get(name)
        if shard is None:
            raise ValueError(f"tensor {name!r} was not in the write plan")
        if name in shard.written:
            raise ValueError(f"tensor {name!r} written twice")
        if shard.fd is None:
            shard.fd = create(self.out_dir / shard.file)
            _preallocate(shard.fd, len(shard.header) + shard.size)
            _pwrite_all(shard.fd, memoryview(shard.header), 0)
        return shard

    def _done(self, shard: _Shard, name: str) -> None:
        shard.written.add(name)
        if len(shard.written) == len(shard.entries) and not self._background:
            os.close(shard.fd)
            shard.fd = None

    def _add_planned(self, name, tensor, st_dtype, shape) -> None:
        shard = self._where.get(name)
        if shard is None:
            raise ValueError(f"tensor {name!r} was not in the write plan")
        want = self._plan[name]
        if (st_dtype, shape) != (want.dtype, want.shape):
            raise ValueError(f"tensor {name!r} is {st_dtype}{list(shape)}, the plan said {want.dtype}{list(want.shape)}")
        shard = self._slot(name)
        _pwrite_all(shard.fd, _tensor_bytes(tensor), shard.offsets[name])
        self._done(shard, name)

    def _add_buffered(self, name, tensor, st_dtype, shape) -> None:
        if name in self._where:
            raise ValueError(f"tensor {name!r} written twice")
        e = PlannedTensor(name, st_dtype, shape)
        cur = self._shards[-1] if self._shards and self._shards[-1].buffered is not None else None
        if cur is None or (cur.entries and cur.size + e.nbytes > self.max_shard_size):
            if cur is not None:
                self._flush(cur)
            cur = _Shard()
            self._shards.append(cur)
        cur.entries.append(e)
        cur.size += e.nbytes
        cur.buffered[name] = tensor
        self._where[name] = cur

    def _flush(self, shard: _Shard) -> None:
        shard.file = f".kvtool-shard-{len(self._shards):05d}.safetensors"
        _build_header(shard, self.metadata)
        with open_new(self.out_dir / shard.file, binary=True) as fh:
            fh.write(shard.header)
            for e in shard.entries:
                fh.write(_tensor_bytes(shard.buffered[e.name]))
        shard.written = {e.name for e in shard.entries}
        shard.buffered = None

    # --- finishing -------------------------------------------------------------------------
    def finalize(self) -> WriteResult:
        """Close and name the shards, write the index when there are several; returns what was written."""
        if self._finalized:
            raise RuntimeError("ShardWriter.finalize called twice")
        if self._planned:
            missing = [e.name for s in self._shards for e in s.entries if e.name not in s.written]
            if missing:
                self.abort()
                raise RuntimeError(f"{len(missing)} planned tensor(s) never written, e.g. {missing[0]!r}")
            try:
                self._wait_copies()
            except BaseException:
                self.abort()
                raise
            for s in self._shards:
                if s.fd is not None:
                    os.close(s.fd)
                    s.fd = None
            try:  # every source as validated until the end: what was read or copied is what was checked
                for path, ident in self._sources.items():
                    check_unchanged(path, ident)
            except BaseException:
                self.abort()
                raise
        else:
            if self._shards and self._shards[-1].buffered is not None:
                self._flush(self._shards[-1])
            for shard, fname in zip(self._shards, _shard_names(len(self._shards))):
                move(self.out_dir / shard.file, self.out_dir / fname)
                shard.file = fname
        self._finalized = True
        weight_map = {e.name: s.file for s in self._shards for e in s.entries}
        total_size = sum(s.size for s in self._shards)
        total_params = sum(prod(e.shape) if e.shape else 1 for s in self._shards for e in s.entries)
        index_file = None
        if len(self._shards) > 1:
            index = {"metadata": {"total_parameters": total_params, "total_size": total_size},
                     "weight_map": weight_map}
            write_new(self.out_dir / INDEX_NAME, json.dumps(index, indent=2, sort_keys=True) + "\n")
            index_file = INDEX_NAME
        return WriteResult([s.file for s in self._shards], index_file, total_size, total_params, dict(sorted(weight_map.items())))

    def abort(self) -> None:
        """Close open files (the staging folder that holds them is removed by its owner)."""
        self._run = None
        if self._copier is not None:  # no copy may write into a closed (or reused) descriptor
            self._copier.shutdown(wait=True, cancel_futures=True)
            self._copier = None
        self._pending = []
        for s in self._shards:
            if s.fd is not None:
                try:
                    os.close(s.fd)
                except OSError:
                    pass
                s.fd = None
        self._finalized = True

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is not None:
            self.abort()
