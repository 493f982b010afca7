"""The one writer of files: every file or folder kvtool creates, replaces, moves or copies goes through here.

What it guarantees (docs/safety.md, "Writing"), whatever a model folder holds:

- a new file is opened with O_CREAT | O_EXCL | O_NOFOLLOW (`create`): it is never an existing file and
  never a symlink's target (a dangling link counts as existing), so a link planted at the name is refused,
  not written through;
- a file is replaced (`replace`: rope --in-place, a plot) by writing a fresh file under a name nobody can
  predict (`.NAME.kvtool-tmp-<random>`, created as above in the same folder) and renaming it over the
  target; a target that is itself a symlink is refused;
- folders: `make_dir` creates a folder that must not exist yet (a staging folder); `make_subdirs` creates
  folders inside one kvtool made and refuses a link met on the way; `make_parents` creates DST's parents
  (the user's path, links allowed);
- a source is copied (`copy_source`) from one open file descriptor: opened once, fstat'd (a regular file,
  with the identity (st_dev, st_ino, st_size, st_mtime_ns) recorded when it was validated, when the caller
  has one), copied from that descriptor, and checked once more after the copy, both the descriptor and the
  path. A change is `SourceChanged` (exit 2, one line naming the file); the staged output is removed.

tests/io/test_writes.py fails when a module of the package writes files any other way.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from pathlib import Path
from typing import Callable, NamedTuple

from kvtool.errors import InputError

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# O_NONBLOCK: a FIFO swapped in for a source does not block open(); fstat then refuses it
_READ = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
TMP_MARK = ".kvtool-tmp-"


class Identity(NamedTuple):
    """What identifies a source's bytes between two looks at it (the same inode, size and last change)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int


def identity_of(st: os.stat_result) -> Identity:
    return Identity(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


class SourceChanged(InputError):
    """A source file is not the one that was validated (replaced, truncated, grown or rewritten)."""

    def __init__(self, path: str | os.PathLike, was: Identity, now: Identity | None):
        if now is None:
            what = "is gone"
        elif (now.dev, now.ino) != (was.dev, was.ino):
            what = "was replaced by another file"
        elif now.size != was.size:
            what = f"changed size ({was.size} -> {now.size} bytes)"
        else:
            what = "was rewritten (its modification time changed)"
        super().__init__(f"{what} after kvtool checked it; nothing was written (run again once it is stable)",
                         file=str(path))


# --- new files --------------------------------------------------------------------------------------
def _exists_error(path: Path) -> InputError:
    kind = "a symlink" if os.path.islink(path) else "already there"
    return InputError(f"is {kind}; kvtool writes only new files it names itself, never through a link or over "
                      "a file", file=str(path))


def create(path: str | os.PathLike, mode: int = 0o644) -> int:
    """A new file's descriptor, opened for writing; InputError if anything (a link included) is at `path`."""
    try:
        return os.open(path, _NEW, mode)
    except FileExistsError:
        raise _exists_error(Path(path)) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _exists_error(Path(path)) from None
        raise


def open_new(path: str | os.PathLike, *, binary: bool = False, mode: int = 0o644):
    """`create` as a Python file object ("wb" or "w" in UTF-8)."""
    fd = create(path, mode)
    return os.fdopen(fd, "wb") if binary else os.fdopen(fd, "w", encoding="utf-8")


def write_new(path: str | os.PathLike, data: str | bytes) -> None:
    """Write a new file holding `data`; on failure the partial file is removed."""
    with _removed_on_error(path, binary=isinstance(data, bytes)) as fh:
        fh.write(data)


def create_first_free(names: Callable[[int], Path], data: str | bytes) -> Path:
    """Write `data` to the first of names(0), names(1), ... that does not exist yet (links count as existing)."""
    n = 0
    while True:
        path = names(n)
        try:
            write_new(path, data)
            return path
        except InputError:
            if not os.path.lexists(path):
                raise
            n += 1


class _removed_on_error:
    def __init__(self, path, binary: bool):
        self.path, self.binary = Path(path), binary

    def __enter__(self):
        self.fh = open_new(self.path, binary=self.binary)
        return self.fh

    def __exit__(self, exc_type, *rest):
        try:
            self.fh.close()
        except OSError:
            if exc_type is None:
                self._remove()
                raise
        if exc_type is not None:
            self._remove()

    def _remove(self):
        try:
            os.unlink(self.path)
        except OSError:
            pass


def temp_name(target: Path) -> Path:
    """A fresh name beside `target` that nobody can guess in advance: `.NAME.kvtool-tmp-<64 random bits>`."""
    import secrets  # only where a file is replaced: kept off the start-up path of the reading commands

    return target.with_name(f".{target.name}{TMP_MARK}{secrets.token_hex(8)}")


def replace(target: str | os.PathLike, data: str | bytes | Callable[[object], None]) -> None:
    """Replace (or create) `target` atomically: a fresh temporary file beside it, renamed over it.

    `data` is the content, or a function given the open binary file to write it (a plot). A target that
    is a symlink is refused: the rename would replace the link, and writing through it is never done."""
    target = Path(target)
    if target.is_symlink():
        raise InputError("is a symlink; kvtool does not write through links (give a plain path)", file=str(target))
    tmp = temp_name(target)
    binary = not isinstance(data, str)
    with _removed_on_error(tmp, binary=binary) as fh:
        if callable(data):
            data(fh)
        else:
            fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    try:
        os.replace(tmp, target)
    except BaseException:
        os.unlink(tmp)
        raise


def move(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """Rename a file or folder kvtool made (rename never follows a link at either name)."""
    os.replace(src, dst)


# --- folders ----------------------------------------------------------------------------------------
def make_dir(path: str | os.PathLike) -> Path:
    """Create a folder that must not exist yet (a link at the name is refused)."""
    try:
        os.mkdir(path)
    except FileExistsError:
        raise _exists_error(Path(path)) from None
    return Path(path)


def make_subdirs(root: str | os.PathLike, rel: str | os.PathLike) -> Path:
    """Create root/rel's folders inside `root` (a folder kvtool made); a link on the way is refused."""
    here = Path(root)
    for part in Path(rel).parts:
        here = here / part
        try:
            os.mkdir(here)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(here).st_mode):
                raise _exists_error(here) from None
    return here


def make_parents(path: str | os.PathLike) -> Path:
    """Create the folder the user named for an output (and its parents); an existing one may be a link."""
    os.makedirs(path, exist_ok=True)
    return Path(path)


# --- copying sources --------------------------------------------------------------------------------
def open_source(path: str | os.PathLike, expect: Identity | None = None) -> tuple[int, Identity]:
    """Open a source once for reading: (descriptor, identity). Not a regular file: InputError; not the
    file `expect` describes (the one validated): SourceChanged."""
    try:
        fd = os.open(path, _READ)
    except FileNotFoundError:
        if expect is not None:
            raise SourceChanged(path, expect, None) from None
        raise InputError("no such file", file=str(path)) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError("is not a regular file; kvtool copies regular files only", file=str(path))
        ident = identity_of(st)
        if expect is not None and ident != expect:
            raise SourceChanged(path, expect, ident)
    except BaseException:
        os.close(fd)
        raise
    return fd, ident


def check_unchanged(path: str | os.PathLike, was: Identity, fd: int | None = None) -> None:
    """After a copy: the open descriptor and the path must both still be the file `was` describes."""
    if fd is not None:
        now = identity_of(os.fstat(fd))
        if now != was:
            raise SourceChanged(path, was, now)
    try:
        now = identity_of(os.stat(path))
    except FileNotFoundError:
        raise SourceChanged(path, was, None) from None
    if now != was:
        raise SourceChanged(path, was, now)


# link() failures that mean "links are not possible here", where a copy is the right fallback
_NO_LINK_ERRNOS = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP, errno.EACCES)
# clone / copy_file_range failures after which a plain read-write copy is the right fallback
_NO_FAST_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.EPERM,
                 errno.ENOTTY, errno.EBADF)
_FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int)
_CHUNK = 64 << 20  # the bounded buffer of a copy without copy_file_range
PAGE = 4096
_FOLIO = 64 * 1024  # a copy that writes from this boundary on gets multi-page page-cache folios


def _reflink(src_fd: int, dst_fd: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    import fcntl

    try:
        fcntl.ioctl(dst_fd, _FICLONE, src_fd)
        return True
    except OSError as exc:
        if exc.errno in _NO_FAST_COPY:
            return False
        raise


def copy_range(src_fd: int, dst_fd: int, src_off: int, dst_off: int, count: int, *,
               fast: bool = True) -> int:
    """Copy `count` bytes between two descriptors at the given offsets (copy_file_range in the kernel,
    else a bounded buffer); returns the bytes copied, fewer only when the source ends early. The one copy loop:
    a whole source file (`copy_source`) and a tensor's bytes into a shard (kvtool.io.writer)."""
    done = 0
    if fast and hasattr(os, "copy_file_range"):
        # Linux copies page-congruent ranges ~1.5x faster once the writes start on a folio boundary
        # (bench/convert_bench.py): a short first copy gets there.
        head = -dst_off % _FOLIO if (src_off - dst_off) % PAGE == 0 and count > _FOLIO else 0
        try:
            while done < count:
                n = os.copy_file_range(src_fd, dst_fd, min(count - done, head or 2**30), src_off + done,
                                       dst_off + done)
                if n == 0:
                    break
                head, done = max(0, head - n), done + n
        except OSError as exc:
            if done or exc.errno not in _NO_FAST_COPY:
                raise
    while done < count:
        buf = os.pread(src_fd, min(count - done, _CHUNK), src_off + done)
        if not buf:
            break
        view = memoryview(buf)
        while len(view):
            n = os.pwrite(dst_fd, view, dst_off + done)
            view, done = view[n:], done + n
    return done


def copy_source(src: str | os.PathLike, dst: str | os.PathLike, *, expect: Identity | None = None,
                link: bool = False) -> str:
    """Copy the source `src` to the new file `dst`; returns "link", "reflink", "copy_file_range" or "copy".

    Bytes come from one descriptor, checked against `expect` (the identity recorded when `src` was
    validated) when given, and `src` is checked once more after the copy: a change is SourceChanged and
    `dst` is removed. A reflink shares disk blocks copy-on-write (editing either file later leaves the
    other as it was); link=True hard-links instead where possible (the command's --link). Permission
    bits and times are copied from the descriptor, never through a path."""
    fd, ident = open_source(src, expect)
    try:
        if link and _hard_link(src, dst, ident):
            return "link"
        out = create(dst, 0o600)
        closed = False
        try:
            if _reflink(fd, out):
                how = "reflink"
            else:
                got = copy_range(fd, out, 0, 0, ident.size)
                how = "copy_file_range" if hasattr(os, "copy_file_range") else "copy"
                if got != ident.size:
                    raise SourceChanged(src, ident, identity_of(os.fstat(fd)))
            st = os.fstat(fd)
            os.fchmod(out, stat.S_IMODE(st.st_mode))
            os.utime(out, ns=(st.st_atime_ns, st.st_mtime_ns))
            check_unchanged(src, ident, fd)
        except BaseException:
            os.close(out)
            closed = True
            os.unlink(dst)
            raise
        finally:
            if not closed:
                os.close(out)
        return how
    finally:
        os.close(fd)


def _hard_link(src, dst, ident: Identity) -> bool:
    try:
        os.link(src, dst)
    except OSError as exc:
        if exc.errno in _NO_LINK_ERRNOS:
            return False
        if exc.errno == errno.EEXIST:
            raise _exists_error(Path(dst)) from None
        raise
    st = os.lstat(dst)
    if identity_of(st) != ident:  # the name now leads to another file than the one opened and checked
        os.unlink(dst)
        raise SourceChanged(src, ident, identity_of(st))
    return True


def identities(headers) -> dict[str, Identity]:
    """file name -> identity of each safetensors file a checkpoint scan validated (its `headers`)."""
    return {h.file: Identity(*h.identity) for h in headers if getattr(h, "identity", None)}


def check_files_unchanged(root: str | os.PathLike, validated: dict[str, Identity]) -> None:
    """Every file of `validated` (from `identities`) is still, under `root`, the file that was validated."""
    for file, ident in validated.items():
        check_unchanged(Path(root) / file, ident)
