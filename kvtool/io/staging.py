"""Staged output: write into a hidden temporary folder next to DST, rename into place on success.

`staged_output(dst, force=..., protect=[src])` yields the temporary folder. On success it is
renamed to DST (an existing non-empty DST is replaced only with `force`). On any exception,
Ctrl-C or SIGTERM included, the temporary folder is removed and DST is left as it was, so an
interrupted run never leaves a DST that looks valid. A full disk (ENOSPC), a file-size limit
(EFBIG) and other OS errors become one-line InputErrors. `copy_side_files` copies tokenizer,
generation config, chat template and other non-weight files, never the old weights or index.

A run killed with SIGKILL cannot clean up: its hidden `.DST.kvtool-tmp-PID-*` folder stays. Every
staging folder holds a marker file naming the host and process that made it; the next run to the
same DST removes those whose process is gone (`sweep_stale`) and says so in one stderr line.
Nothing without that marker is ever removed.

Every file and folder is created through kvtool.io.outputfile (O_EXCL | O_NOFOLLOW, fresh names):
outputs never share an inode with their source (`copy_source` reflinks when the file system can,
else copies bytes in the kernel; hard links only when a command's `--link` asks for them), and a
source that changes between its validation and the end of its copy stops the run (exit 2).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
import signal
import socket
import threading
import uuid
from pathlib import Path
from typing import Callable, Iterable, Iterator

from kvtool.console import out
from kvtool.errors import SIGNALS_RECEIVED, InputError, KvtoolError, UsageError, listed
from kvtool.io.outputfile import copy_source, make_dir, make_parents, move, write_new

TMP_MARK = ".kvtool-tmp-"
OLD_MARK = ".kvtool-old-"
WORK_MARK = ".kvtool-work-"
MARKER = ".kvtool-staging.json"  # inside every staging folder kvtool creates; removed before the rename
# .DST.kvtool-{tmp,work}-PID-HEX8 (a .kvtool-old- folder is a previous DST being replaced: never swept)
_STAGING_NAME = re.compile(r"^\.(?P<dst>.+)\.kvtool-(?P<kind>tmp|work)-(?P<pid>\d+)-[0-9a-f]{8}$")

# Never copied: weights (rewritten), pickles, the config and provenance (written by the command).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle", ".gguf", ".h5", ".msgpack")
NOT_COPIED = {"model.safetensors.index.json", "pytorch_model.bin.index.json", "config.json", "kvtool.json"}


class Interrupted(KeyboardInterrupt):
    """SIGTERM turned into an exception so cleanup runs (as Ctrl-C does)."""


# What the current process has written, for the one line an interrupted run prints (kvtool.cli).
COMPLETED: list[Path] = []


def interrupted_line() -> str:
    """The line printed on Ctrl-C / SIGTERM: what was, and was not, written."""
    if COMPLETED:
        done = ", ".join(str(p) for p in COMPLETED)
        return f"kvtool: interrupted after the output was complete: {done} is written"
    return "kvtool: interrupted: nothing was written"


@contextlib.contextmanager
def scratch_outputs() -> Iterator[None]:
    """Outputs staged inside the block are scratch (a recipe step's folder): not reported as written."""
    n = len(COMPLETED)
    try:
        yield
    finally:
        del COMPLETED[n:]


def _resolve(path: Path, what: str) -> Path:
    try:
        return Path(path).resolve()
    except (OSError, RuntimeError):  # RuntimeError: a symlink loop (Python < 3.13)
        raise UsageError(f"cannot resolve the {what} (symlink loop?)", file=str(path)) from None


def check_destination(dst: Path, *, force: bool, protect: Iterable[Path] = ()) -> None:
    """Refuse a DST that is a file, non-empty without force, or the same as, inside or above a protected input.

    Paths are compared after resolving symlinks, so a link into SRC is as inside as SRC/sub is.
    """
    dst = Path(dst)
    rdst = _resolve(dst, "destination")
    for p in protect:
        rp = _resolve(Path(p), "source")
        if rdst == rp or rdst in rp.parents:
            raise UsageError("destination is the input checkpoint (or a folder containing it); choose another", file=str(dst))
        if rp in rdst.parents:
            raise UsageError(f"destination is inside the source folder {p}; kvtool never writes into its input",
                             file=str(dst))
    if dst.is_symlink() and not dst.exists():
        raise UsageError("destination is a dangling symlink", file=str(dst))
    if dst.exists() and not dst.is_dir():
        raise UsageError("destination exists and is not a folder", file=str(dst))
    if dst.is_symlink() and not force:  # the output replaces the link; it is never written through it
        raise UsageError("destination is a symlink (use --force to replace the link; the folder it points to is "
                         "left as it is)", file=str(dst))
    if dst.is_dir() and any(dst.iterdir()) and not force:
        raise UsageError("destination folder is not empty (use --force to replace it)", file=str(dst))


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def _raise(signum, frame):
        SIGNALS_RECEIVED.append(signum)
        raise Interrupted()

    # SIGHUP too (the terminal closed, an ssh session dropped): the same cleanup, unless the caller ignores it
    # (nohup), whose choice stands
    sigs = [signal.SIGTERM] + ([signal.SIGHUP] if signal.getsignal(signal.SIGHUP) is not signal.SIG_IGN else [])
    olds = []
    try:
        for sig in sigs:
            olds.append((sig, signal.signal(sig, _raise)))
    except (ValueError, OSError):
        for sig, old in olds:
            signal.signal(sig, old)
        yield
        return
    try:
        yield
    finally:
        for sig, old in olds:
            signal.signal(sig, old)


def os_error_file(exc: OSError, default: str | Path) -> str:
    """The file an OSError is about (its filename, set by open / stat / copy), else `default`."""
    name = exc.filename if exc.filename is not None else None
    return os.fsdecode(name) if isinstance(name, (str, bytes, os.PathLike)) else str(default)


def _os_error_message(exc: OSError) -> str:
    if exc.errno == errno.ENOSPC:
        return "no space left on device; nothing was written"
    if exc.errno == errno.EDQUOT:
        return "disk quota exceeded; nothing was written"
    if exc.errno == errno.EFBIG:
        return "file too large for the file system or the process's file-size limit (ulimit -f); nothing was written"
    return f"{exc.strerror or exc}; nothing was written"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's live process
    return True


def staging_dir_for(dst: Path, kind: str = "tmp") -> Path:
    """A new staging folder next to `dst`: its parents made, stale ones of earlier runs swept. A place the
    system refuses (DST under a file, in /proc, a name too long) is one line naming DST."""
    parent = dst.parent if str(dst.parent) else Path(".")
    try:
        make_parents(parent)
        sweep_stale(parent, dst.name)
        return make_staging_dir(parent, dst.name, kind)
    except OSError as exc:
        raise InputError(f"cannot create the output folder: {_os_error_message(exc)}", file=str(dst)) from None


def make_staging_dir(parent: Path, dst_name: str, kind: str = "tmp") -> Path:
    """Create `.DST.kvtool-KIND-PID-HEX` in `parent` with its marker file (host, pid)."""
    folder = make_dir(parent / f".{dst_name}.kvtool-{kind}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    write_new(folder / MARKER, json.dumps({"host": socket.gethostname(), "pid": os.getpid()}) + "\n")
    return folder


def stale_staging_dirs(parent: Path, dst_name: str) -> tuple[list[Path], list[Path]]:
    """(removable, left alone) hidden staging folders for `dst_name` in `parent` whose process is gone.

    Removable: kvtool's marker names this host and a process that no longer exists. Left alone:
    the name looks like kvtool's but there is no readable marker, or it was made on another host.
    """
    removable: list[Path] = []
    foreign: list[Path] = []
    try:
        entries = list(parent.iterdir())
    except OSError:
        return [], []
    host = socket.gethostname()
    for p in sorted(entries):
        m = _STAGING_NAME.match(p.name)
        if not m or m["dst"] != dst_name or p.is_symlink() or not p.is_dir():
            continue
        pid = int(m["pid"])
        if pid == os.getpid() or _pid_alive(pid):
            continue  # a run in progress (or this one)
        try:
            mark = json.loads((p / MARKER).read_text(encoding="utf-8"))
            ours = mark.get("pid") == pid and mark.get("host") == host
        except (OSError, ValueError, AttributeError):
            ours = False
        (removable if ours else foreign).append(p)
    return removable, foreign


def sweep_stale(parent: Path, dst_name: str) -> None:
    """Remove staging folders left by killed kvtool runs for this DST; one stderr line says what."""
    removable, foreign = stale_staging_dirs(parent, dst_name)
    gone = []
    for p in removable:
        shutil.rmtree(p, ignore_errors=True)
        if not p.exists():
            gone.append(p.name)
    if gone:
        out(f"kvtool: removed {len(gone)} staging folder(s) left by an interrupted kvtool run: "
                    f"{listed(gone)}", err=True)
    if foreign:
        out(f"kvtool: note: left alone {len(foreign)} folder(s) named like kvtool staging but without its "
                    f"marker (or from another host): {listed(str(p) for p in foreign)}", err=True)


@contextlib.contextmanager
def staged_output(dst: str | Path, *, force: bool = False, protect: Iterable[Path] = (),
                  verify: Callable[[Path], None] | None) -> Iterator[Path]:
    """Yield a temporary folder next to `dst`; rename it to `dst` only if the block succeeds and `verify(tmp)`
    (kvtool's own checks of the finished output, passed in by the operation: kvtool.rules.output_check) raises
    nothing. `verify` has no default: every writer says which check it publishes under (None only for outputs
    that are no model, and tests)."""
    dst = Path(dst)
    check_destination(dst, force=force, protect=protect)
    tmp = staging_dir_for(dst)
    try:
        with sigterm_as_interrupt():
            yield tmp
            if verify is not None:
                verify(tmp)
            _commit(tmp, dst, force)
            COMPLETED.append(dst)
    except BaseException as exc:
        if not tmp.exists():  # renamed into place just before the interrupt landed: DST is complete
            if dst not in COMPLETED:
                COMPLETED.append(dst)
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and not isinstance(exc, KvtoolError):  # named by the file that failed (a
            # source kvtool could not read is not DST), else DST
            raise InputError(_os_error_message(exc), file=os_error_file(exc, dst)).relocate(str(tmp), str(dst)) from None
        if isinstance(exc, KvtoolError):  # errors name DST/file, never the hidden staging folder
            exc.relocate(str(tmp), str(dst))
        raise


def _commit(tmp: Path, dst: Path, force: bool) -> None:
    (tmp / MARKER).unlink()  # the marker stays until the last moment: a run killed before this is swept
    if dst.is_symlink():  # --force: the link is moved aside and removed; what it points to is never touched
        old = dst.parent / f".{dst.name}{OLD_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        move(dst, old)
        try:
            move(tmp, dst)
        finally:
            if tmp.exists():
                move(old, dst)
            else:
                old.unlink()
        return
    if dst.is_dir():
        if any(dst.iterdir()):
            if not force:  # appeared while we were writing
                raise UsageError("destination folder became non-empty while writing; nothing was replaced", file=str(dst))
            old = dst.parent / f".{dst.name}{OLD_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
            move(dst, old)
            try:
                move(tmp, dst)
            finally:  # decided by what is on disk, so an interrupt between the two lines cannot mislead it
                if tmp.exists():
                    move(old, dst)  # the new output did not move in: put the previous one back
                else:
                    shutil.rmtree(old, ignore_errors=True)
            return
        dst.rmdir()
    move(tmp, dst)


def is_side_file(path: Path) -> bool:
    """True for files that travel with a checkpoint unchanged (tokenizer, chat template, README...)."""
    name = path.name
    if name.startswith(".") or name in NOT_COPIED:
        return False
    return not name.endswith(WEIGHT_SUFFIXES)


def check_inside(root: Path, path: Path) -> None:
    """Refuse a file of `root` that is a symlink leading outside it: kvtool reads only the folders it was
    given (the same rule as the weights' KV704, Hugging Face cache snapshots included)."""
    from kvtool.io.weight_files import is_inside

    if not is_inside(Path(root), Path(path).relative_to(root).as_posix()):
        raise InputError(f"is a symlink to {_resolve(path, 'file')}, outside the model folder; kvtool does not "
                         "read it", file=str(path))


def copy_side_files(src: str | Path, dst: str | Path) -> list[str]:
    """Copy top-level non-weight files of `src` into `dst` (kvtool.io.outputfile.copy_source: each from one
    descriptor, checked unchanged after the copy); returns the names copied."""
    src, dst = Path(src), Path(dst)
    copied: list[str] = []
    for p in sorted(src.iterdir()):
        if p.is_file() and is_side_file(p):
            check_inside(src, p)
            copy_source(p, dst / p.name)
            copied.append(p.name)
    return copied
