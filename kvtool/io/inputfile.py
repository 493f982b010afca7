"""Read a file the user named, safely: regular files only, and never more than a size limit.

Every text or JSON input kvtool reads (config.json, tokenizer.json, the safetensors index,
recipes, pyproject.toml, factor lists) goes through `read_bytes`, and --text / --calib-text files through
`read_chunks`, read only as far as their tokens are used (kvtool.tokenstream):

- it opens with O_NONBLOCK, so a FIFO does not block in open(), then refuses anything fstat does
  not call a regular file (FIFO, character or block device, socket, folder): `/dev/zero` reports
  size 0 and a FIFO never ends, so a size check made before reading proves nothing;
- it reads at most limit + 1 bytes, so a file that grows while being read cannot exceed the limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator

from kvtool.errors import InputError

# Limits per kind of input (docs/input-limits.md). Real configs are a few KiB, the largest
# tokenizer.json files ~35 MiB, safetensors indexes ~2 MiB.
JSON_LIMIT = 64 * 1024 * 1024
RECIPE_LIMIT = 4 * 1024 * 1024
TOML_LIMIT = 4 * 1024 * 1024
TEXT_LIMIT = 256 * 1024 * 1024  # --text / --calib-text: far more than any evaluation needs
_CHUNK = 1 << 20

_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def kind_of(mode: int) -> str:
    for test, name in _KINDS:
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: str | os.PathLike) -> str | None:
    """Why `path` is not a regular file ("not found", "is a folder", ...), or None when it is one."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "not found"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or type(exc).__name__})"
    return None if stat.S_ISREG(mode) else f"is {kind_of(mode)}, not a file"


def _open_regular(name: str, what: str, field: str | None) -> tuple[int, int]:
    """(fd, size) of a regular file opened for reading; InputError naming the file for anything else."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError("no such file", file=name, field=field) from None
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror or type(exc).__name__}", file=name, field=field) from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise InputError(f"{what} is {kind_of(st.st_mode)}; kvtool reads regular files only", file=name, field=field)
    return fd, st.st_size


def _open_within(name: str, what: str, limit: int, field: str | None) -> tuple[int, int]:
    fd, size = _open_regular(name, what, field)
    if size > limit:
        os.close(fd)
        raise InputError(f"{what} is larger than the {limit} byte limit", file=name, field=field)
    return fd, size


def check_size(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT,
               field: str | None = None) -> int:
    """The size of a regular file of at most `limit` bytes, opened as read_chunks opens it but not read;
    InputError as read_chunks for anything else."""
    fd, size = _open_within(str(path), what, limit, field)
    os.close(fd)
    return size


def read_chunks(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT, field: str | None = None,
                size: int = _CHUNK) -> Iterator[bytes]:
    """The file's bytes, `size` at a time, read only as far as the caller iterates (a text of which only the
    first tokens are used is never read further); InputError as `read_bytes`, and at once for a file whose
    size is over the limit (it is also counted while reading: a file can grow)."""
    name = str(path)
    fd = _open_within(name, what, limit, field)[0]
    try:
        total = 0
        while True:
            try:
                chunk = os.read(fd, min(size, limit + 1 - total))
            except OSError as exc:
                raise InputError(f"cannot read {what}: {exc.strerror or type(exc).__name__}", file=name,
                                 field=field) from None
            if not chunk:
                return
            total += len(chunk)
            if total > limit:
                raise InputError(f"{what} is larger than the {limit} byte limit", file=name, field=field)
            yield chunk
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT,
               field: str | None = None) -> bytes:
    """The whole file, or InputError (one line naming the file) if it is not a regular file or too big."""
    return b"".join(read_chunks(path, what=what, limit=limit, field=field))


def read_text(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT, field: str | None = None,
              bom: bool = True) -> str:
    """`read_bytes` decoded as UTF-8 (a leading BOM is dropped; refused with bom=False: a file an engine's own
    reader refuses, as transformers' json.loads does)."""
    return decode(read_bytes(path, what=what, limit=limit, field=field), path, what=what, field=field, bom=bom)


def decode(raw: bytes, path: str | os.PathLike, *, what: str = "file", field: str | None = None,
           bom: bool = True) -> str:
    """A file's bytes as `read_text` decodes them (for a caller that also needs the bytes)."""
    if not bom and raw.startswith(b"\xef\xbb\xbf"):
        raise InputError(f"{what} starts with a UTF-8 byte order mark, which transformers' JSON reader refuses "
                         "(engines cannot load it); save it as UTF-8 without one", file=str(Path(path)), field=field)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 (byte {exc.start})", file=str(Path(path)), field=field) from None
