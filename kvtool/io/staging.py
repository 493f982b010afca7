"""Staged output: write into a hidden temporary folder next to DST, rename into place on success.

`staged_output(dst, force=..., protect=[src])` yields the temporary folder. On success it is
renamed to DST (an existing non-empty DST is replaced only with `force`). On any exception,
Ctrl-C or SIGTERM included, the temporary folder is removed and DST is left as it was, so an
interrupted run never leaves a DST that looks valid. A full disk (ENOSPC) and other OS errors
become one-line InputErrors. `copy_side_files` copies tokenizer, generation config, chat template
and other non-weight files, never the old weights or index.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Iterable, Iterator

from kvtool.errors import InputError, KvtoolError, UsageError

TMP_MARK = ".kvtool-tmp-"
OLD_MARK = ".kvtool-old-"

# Never copied: weights (rewritten), pickles, the config and provenance (written by the command).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".gguf", ".h5", ".msgpack")
NOT_COPIED = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json", "kvtool.json"}


class Interrupted(KeyboardInterrupt):
    """SIGTERM turned into an exception so cleanup runs (as Ctrl-C does)."""


def check_destination(dst: Path, *, force: bool, protect: Iterable[Path] = ()) -> None:
    """Refuse a DST that is a file, non-empty without force, or the same as / above a protected input."""
    dst = Path(dst)
    rdst = dst.resolve()
    for p in protect:
        rp = Path(p).resolve()
        if rdst == rp or rdst in rp.parents:
            raise UsageError("destination is the input checkpoint (or a folder containing it); choose another", file=str(dst))
    if dst.exists() and not dst.is_dir():
        raise UsageError("destination exists and is not a folder", file=str(dst))
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UsageError("destination folder is not empty (use --force to replace it)", file=str(dst))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        raise Interrupted()

    try:
        old = signal.signal(signal.SIGTERM, _raise)
    except (ValueError, OSError):
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def _os_error_message(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on device; nothing was written"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded; nothing was written"
    return f"{exc.strerror or exc}; nothing was written"


@contextlib.contextmanager
def staged_output(dst: str | Path, *, force: bool = False, protect: Iterable[Path] = ()) -> Iterator[Path]:
    """Yield a temporary folder next to `dst`; rename it to `dst` only if the block succeeds."""
    dst = Path(dst)
    check_destination(dst, force=force, protect=protect)
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        tmp = parent / f".{dst.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
    except OSError as exc:
        raise InputError(f"cannot create the output folder: {_os_error_message(exc)}", file=str(dst)) from None
    try:
        with sigterm_as_interrupt():
            yield tmp
            _commit(tmp, dst, force)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, KvtoolError):
            raise InputError(_os_error_message(exc), file=str(dst)).relocate(str(tmp), str(dst)) from None
        if isinstance(exc, KvtoolError):  # errors name DST/file, never the hidden staging folder
            exc.relocate(str(tmp), str(dst))
        raise


def _commit(tmp: Path, dst: Path, force: bool) -> None:
    if dst.is_dir():
        if any(dst.iterdir()):
            if not force:  # appeared while we were writing
                raise UsageError("destination folder became non-empty while writing; nothing was replaced", file=str(dst))
            old = dst.parent / f".{dst.name}{OLD_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            os.replace(dst, old)
            try:
                os.replace(tmp, dst)
            except BaseException:
                os.replace(old, dst)  # put the previous output back
                raise
            shutil.rmtree(old, ignore_errors=True)
            return
        dst.rmdir()
    os.replace(tmp, dst)


def is_side_file(path: Path) -> bool:
    """True for files that travel with a checkpoint unchanged (tokenizer, chat template, README...)."""
    name = path.name
    if name.startswith(".") or name in NOT_COPIED:
        return False
    return not name.endswith(WEIGHT_SUFFIXES)


# link() failures that mean "links are not possible here", where a copy is the right fallback
_NO_LINK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)


def link_or_copy(src: Path, dst: Path, *, link: bool = True) -> bool:
    """Hard-link src to dst (same bytes, no extra disk), copying when links are impossible; True if linked."""
    if link:
        try:
            os.link(src, dst)
            return True
        except OSError as exc:
            if exc.errno not in _NO_LINK_ERRNOS:
                raise
    shutil.copy2(src, dst)
    return False


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy top-level non-weight files of `src` into `dst`; returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied: list[str] = []
    for p in sorted(src.iterdir()):
        if p.is_file() and is_side_file(p):
            shutil.copy2(p, dst / p.name)
            copied.append(p.name)
    return copied
