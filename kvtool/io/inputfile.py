"""Read a file the user named, safely: regular files only, and never more than a size limit.

Every text or JSON input kvtool reads (config.json, tokenizer.json, the safetensors index,
recipes, pyproject.toml, --text / --calib-text files, factor lists) goes through `read_bytes`:

- it opens with O_NONBLOCK, so a FIFO does not block in open(), then refuses anything fstat does
  not call a regular file (FIFO, character or block device, socket, folder): `/dev/zero` reports
  size 0 and a FIFO never ends, so a size check made before reading proves nothing;
- it reads at most limit + 1 bytes, so a file that grows while being read cannot exceed the limit.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

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


def read_bytes(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT,
               field: str | None = None) -> bytes:
    """The whole file, or InputError (one line naming the file) if it is not a regular file or too big."""
    name = str(path)
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise InputError("no such file", file=name, field=field) from None
    except OSError as exc:
        raise InputError(f"cannot read {what}: {exc.strerror or type(exc).__name__}", file=name, field=field) from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise InputError(f"{what} is {kind_of(mode)}; kvtool reads regular files only", file=name, field=field)
        chunks: list[bytes] = []
        total = 0
        while total <= limit:
            try:
                chunk = os.read(fd, min(_CHUNK, limit + 1 - total))
            except OSError as exc:
                raise InputError(f"cannot read {what}: {exc.strerror or type(exc).__name__}", file=name,
                                 field=field) from None
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise InputError(f"{what} is larger than the {limit} byte limit", file=name, field=field)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_text(path: str | os.PathLike, *, what: str = "file", limit: int = JSON_LIMIT, field: str | None = None) -> str:
    """`read_bytes` decoded as UTF-8 (a leading BOM is dropped)."""
    raw = read_bytes(path, what=what, limit=limit, field=field)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InputError(f"{what} is not UTF-8 (byte {exc.start})", file=str(Path(path)), field=field) from None
