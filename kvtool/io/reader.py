"""Lazy tensor reader over a model folder (one model.safetensors, several, or a sharded index).

Names, dtypes and shapes come from the safetensors headers (no data read). Tensor data is read
on demand with positional reads at the offsets the header gives, keeping one shard file open at a
time, so memory stays bounded by the tensor being read, never by the model; `get_slice` reads only
the rows asked for. (safetensors' `safe_open` would memory-map the shard: every page read then
stays resident, and counted in RSS, until the shard is closed, so peak memory grows with the bytes
read. A plain read into a fresh buffer is freed with the tensor.)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterator

from kvtool.errors import InputError
from kvtool.io.outputfile import Identity, SourceChanged, open_source
from kvtool.io.weight_files import INDEX_NAME, raise_first_error, scan_weights
from kvtool.io.safetensors_header import TensorInfo

if TYPE_CHECKING:  # torch and numpy are imported lazily: this module is importable without them
    import numpy as np
    import torch

__all__ = ["INDEX_NAME", "CheckpointReader", "st_to_torch_dtype"]


def st_to_torch_dtype(st: str, file: str | None = None, tensor: str | None = None):
    """safetensors dtype string -> torch dtype."""
    import torch

    table = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
    for st_name, attr in (("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("F8_E8M0", "float8_e8m0fnu")):
        if hasattr(torch, attr):
            table[st_name] = getattr(torch, attr)
    try:
        return table[st]
    except KeyError:
        raise InputError(f"tensors of dtype {st} cannot be loaded", file=file, field=tensor) from None


class CheckpointReader:
    """Read tensors of a model folder lazily; use as a context manager (closes the open shard).

    `expect` (file name -> identity, `identities(checkpoint.headers)`) are the shards as an earlier
    validation saw them (the command's plan): a shard that is no longer that file is SourceChanged. Each
    shard is opened as the file its header scan validated (`identities`, by path, for ShardWriter)."""

    def __init__(self, folder: str | Path, expect: dict[str, Identity] | None = None):
        self.folder = Path(folder)
        self.identities: dict[str, Identity] = {}
        self._expect = dict(expect or {})
        self.index_path: Path | None = None
        self._infos: dict[str, TensorInfo] = {}
        self._metadata: dict[str, dict[str, str]] = {}
        self._data_start: dict[str, int] = {}
        self._files: list[str] = []
        self._open_file: str | None = None
        self._fh = None
        self._scan()

    # --- headers ---------------------------------------------------------------------------
    def _scan(self) -> None:
        scan = scan_weights(self.folder)
        raise_first_error(scan, self.folder)
        if scan.index_doc is not None:
            self.index_path = scan.index_doc.path
        for h in scan.headers:
            path = str(self.folder / h.file)
            self.identities[path] = Identity(*h.identity)
            if self._expect.get(h.file, self.identities[path]) != self.identities[path]:
                raise SourceChanged(path, self._expect[h.file], self.identities[path])
            self._infos.update(h.tensors)
            self._metadata[h.file] = dict(h.metadata)
            self._data_start[h.file] = 8 + h.header_size
            self._files.append(h.file)

    # --- metadata access -------------------------------------------------------------------
    def names(self) -> list[str]:
        """All tensor names, shard by shard in file order (reading in this order opens each shard once)."""
        return list(self._infos)

    def __contains__(self, name: str) -> bool:
        return name in self._infos

    def __iter__(self) -> Iterator[str]:
        return iter(self._infos)

    def info(self, name: str) -> TensorInfo:
        """dtype (safetensors string, e.g. 'BF16'), shape, file and byte range, from the header."""
        try:
            return self._infos[name]
        except KeyError:
            raise InputError(f"tensor {name!r} is not in the checkpoint", file=str(self.folder)) from None

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def metadata(self, file: str) -> dict[str, str]:
        """The `__metadata__` of one shard."""
        return dict(self._metadata.get(file, {}))

    def byte_range(self, name: str) -> tuple[Path, int, int]:
        """(file path, absolute offset, length) of a tensor's raw little-endian bytes."""
        info = self.info(name)
        begin, end = info.data_offsets
        return self.folder / info.file, self._data_start[info.file] + begin, end - begin

    @property
    def total_bytes(self) -> int:
        return sum(i.nbytes for i in self._infos.values())

    # --- data access -----------------------------------------------------------------------
    def _file(self, file: str):
        if self._open_file != file:
            self.close()
            path = self.folder / file
            try:  # the file the header scan validated, or SourceChanged
                fd, _ = open_source(path, self.identities.get(str(path)))
            except OSError as exc:
                raise InputError(f"cannot open: {exc.strerror or exc}", file=str(path)) from None
            self._fh = open(fd, "rb", buffering=0)
            self._open_file = file
        return self._fh

    def _read_bytes(self, info: TensorInfo, begin: int, nbytes: int):
        try:  # an uninitialised buffer: bytearray(n) zero-fills first, a pass as long as the read
            import numpy as np

            buf = np.empty(nbytes, np.uint8)
        except ImportError:
            buf = bytearray(nbytes)
        if nbytes == 0:
            return buf
        view = memoryview(buf)
        fh = self._file(info.file)
        fh.seek(self._data_start[info.file] + begin)
        got = 0
        while got < nbytes:
            n = fh.readinto(view[got:])
            if not n:
                raise InputError(f"tensor {info.name!r}: file ends early", file=str(self.folder / info.file))
            got += n
        return buf

    def _rows(self, info: TensorInfo, start: int, stop: int) -> tuple[int, int, tuple[int, ...]]:
        if not info.shape:
            raise InputError(f"tensor {info.name!r} is a scalar and has no rows", file=str(self.folder / info.file))
        rows = info.shape[0]
        start, stop, _ = slice(start, stop).indices(rows)
        stop = max(start, stop)
        row_bytes = (info.nbytes // rows) if rows else 0
        return info.data_offsets[0] + start * row_bytes, (stop - start) * row_bytes, (stop - start, *info.shape[1:])

    def _torch(self, info: TensorInfo, begin: int, nbytes: int, shape: tuple[int, ...]) -> "torch.Tensor":
        import torch

        dtype = st_to_torch_dtype(info.dtype, str(self.folder / info.file), info.name)
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(self._read_bytes(info, begin, nbytes), dtype=dtype).reshape(shape)

    def _numpy(self, info: TensorInfo, begin: int, nbytes: int, shape: tuple[int, ...]) -> "np.ndarray":
        import numpy as np

        from kvtool.io.arrays import storage_dtype

        return np.frombuffer(self._read_bytes(info, begin, nbytes), dtype=storage_dtype(info.dtype)).reshape(shape)

    def get(self, name: str) -> "torch.Tensor":
        """The whole tensor, on CPU, in its stored dtype."""
        info = self.info(name)
        begin, end = info.data_offsets
        return self._torch(info, begin, end - begin, info.shape)

    def get_slice(self, name: str, start: int, stop: int) -> "torch.Tensor":
        """Rows [start, stop) of the first dimension; only those bytes are read."""
        info = self.info(name)
        return self._torch(info, *self._rows(info, start, stop))

    def get_array(self, name: str) -> "np.ndarray":
        """The whole tensor as a writable numpy storage array (BF16 as uint16: see kvtool.io.arrays); no torch."""
        info = self.info(name)
        begin, end = info.data_offsets
        return self._numpy(info, begin, end - begin, info.shape)

    def get_array_slice(self, name: str, start: int, stop: int) -> "np.ndarray":
        """Rows [start, stop) as a numpy storage array."""
        info = self.info(name)
        return self._numpy(info, *self._rows(info, start, stop))

    def close(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self._fh = None
        self._open_file = None

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
