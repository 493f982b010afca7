"""One checker for every hostile-input case: run kvtool (in-process where as faithful, else in a subprocess:
`run_kvtool`) and assert its contract.

A case is a command line plus the folders it must not change. `check_refusal` asserts:
the documented exit code; exactly one stderr line, naming the file (and field, when given);
no traceback; no output folder (and no hidden staging folder beside it); sources unchanged by
checksum; the trap file never created (nothing executed); finished within the time bound.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

TIME_BOUND_S = 60.0
TRAP_ENV = "KVTOOL_HOSTILE_TRAP"  # payloads create this file if they ever run


# A file this large is told by its metadata instead of read (a sparse 1 GiB config.json, a real model's weights:
# hashing them before and after every run cost seconds). A write through the file changes its mtime and ctime,
# a replacement its inode, and no program sets ctime back: as strict as its bytes for what kvtool could do to it.
DIGEST_BY_STAT = 16 << 20


def tree_digest(*roots: Path) -> dict[str, str]:
    """sha256 of every regular file (its size, mtime, ctime and inode from DIGEST_BY_STAT bytes), and the target
    of every link, under the roots, by path."""
    out: dict[str, str] = {}
    for root in roots:
        root = Path(root)
        if not root.exists() and not root.is_symlink():
            continue
        paths = [root] if not root.is_dir() or root.is_symlink() else sorted(root.rglob("*"))
        for p in paths:
            if p.is_symlink():
                out[str(p)] = "link:" + os.readlink(p)
            elif p.is_file() and (st := p.stat()).st_size >= DIGEST_BY_STAT:
                out[str(p)] = f"stat:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}:{st.st_ino}"
            elif p.is_file():
                h = hashlib.sha256()
                with p.open("rb") as fh:
                    for chunk in iter(lambda: fh.read(1 << 20), b""):
                        h.update(chunk)
                out[str(p)] = h.hexdigest()
            elif p.is_dir():
                out[str(p)] = "dir"
            else:  # FIFO, device: record the kind, never open it
                out[str(p)] = f"special:{p.lstat().st_mode:o}"
    return out


@dataclass
class Result:
    rc: int
    stdout: str
    stderr: str
    seconds: float
    lines: list[str] = field(default_factory=list)


# Where a run happens. A subprocess is what a user runs, and the only place that shows start-up (sys.path, imports),
# signals, closed or odd standard streams, the interpreter's own traceback and exit; it costs a fresh interpreter and
# kvtool's imports (~0.3-0.5 s CPU for a refusal, seconds when torch loads) per run. A run that changes none of
# those (no stdin, input, working folder, wrapper or environment of its own but the trap) goes through the same
# entry kvtool.cli._entry takes, in this process: its own stdout / stderr descriptors, fd 0 on /dev/null, guarded
# streams, console.settle, Python's default warning filters, a fresh sys.argv, and a watchdog that ends the worker
# (a failure, never a hang) past the time bound; not while another thread runs in this process (a test's stand-in
# server: what it prints would land in the run's stderr), unless the thread says it writes nothing (the loopback
# server of tests/fake_server.py records its errors instead of printing them). One test in SUBPROCESS_SHARE (by its test id, so the same ones
# every run) still runs every case as a subprocess, and KVTOOL_TEST_SUBPROCESS=1 runs them all so (docs/testing.md).
SUBPROCESS_ENV = "KVTOOL_TEST_SUBPROCESS"
SUBPROCESS_SHARE = 8
THREADS_AT_START: frozenset = frozenset()  # set by tests/conftest.py for each test


def in_process(*, env: dict | None = None, cwd=None, stdin=subprocess.DEVNULL, input=None, prefix=()) -> bool:
    """Whether this run goes in-process (see above)."""
    if prefix or input is not None or stdin is not subprocess.DEVNULL or cwd is not None:
        return False
    if set(env or {}) - {TRAP_ENV} or os.environ.get(SUBPROCESS_ENV):
        return False
    # a thread the test started (a stand-in server) would write where the run reads, unless it writes nothing
    # (tests/fake_server.py: its errors recorded, not printed)
    if any(t is not threading.main_thread() and t not in THREADS_AT_START and not getattr(t, "writes_nothing", False)
           for t in threading.enumerate()):
        return False
    test = os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]
    return zlib.crc32(test.encode()) % SUBPROCESS_SHARE != 0


def run_kvtool(args: list[str], *, cwd: Path | None = None, env: dict | None = None, stdin=subprocess.DEVNULL,
               timeout: float = TIME_BOUND_S, input: bytes | None = None, prefix: list[str] = ()) -> Result:
    """kvtool as `python -m kvtool ARGS` runs it; `prefix` runs it under a wrapper (e.g. setpriv dropping root's
    file capabilities). In this process where that is as faithful (`in_process`), else in a subprocess."""
    if in_process(env=env, cwd=cwd, stdin=stdin, input=input, prefix=prefix):
        return _run_here([str(a) for a in args], env=env or {}, timeout=timeout)
    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("KVTOOL_DEBUG", None)
    if env:
        e.update(env)
    t0 = time.monotonic()
    kw = {"input": input} if input is not None else {"stdin": stdin}
    p = subprocess.run([*prefix, sys.executable, "-m", "kvtool", *map(str, args)], cwd=cwd, env=e, capture_output=True,
                       timeout=timeout, **kw)
    dt = time.monotonic() - t0
    err = p.stderr.decode("utf-8", "replace")
    return Result(p.returncode, p.stdout.decode("utf-8", "replace"), err, dt,
                  [ln for ln in err.splitlines() if ln.strip()])


def _run_here(args: list[str], *, env: dict, timeout: float) -> Result:
    """kvtool.cli._entry's run in this process, its output read from descriptors 1 and 2 (what a library or torch
    writes there directly included). Restores the environment, streams, descriptors, argv and log handlers."""
    import faulthandler
    import io
    import logging
    import tempfile
    import traceback
    import warnings

    from kvtool import cli, console

    saved_env = dict(os.environ)
    saved_streams = sys.stdin, sys.stdout, sys.stderr
    saved_argv = sys.argv
    saved_fds = {fd: os.dup(fd) for fd in (0, 1, 2)}
    handlers = [h for lg in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]
                for h in getattr(lg, "handlers", ()) if type(h) is logging.StreamHandler]
    handler_streams = [h.stream for h in handlers]
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        t0 = time.monotonic()
        try:
            os.environ.pop("KVTOOL_DEBUG", None)
            os.environ.update(env)
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.close(null)
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
            sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                          errors="backslashreplace", write_through=True)
            sys.argv = [str(Path(cli.__file__).with_name("__main__.py")), *args]
            console.guard_streams()
            for h in handlers:  # a library's handler made earlier writes where a fresh one would: this stderr
                h.stream = sys.stderr  # not setStream: it flushes the old stream, which may be closed
            faulthandler.dump_traceback_later(timeout, exit=True, file=saved_fds[2])
            with warnings.catch_warnings():  # a fresh interpreter's filters; shown on stderr (pytest records them)
                warnings.resetwarnings()
                warnings.simplefilter("default")
                for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                    warnings.filterwarnings("ignore", category=category)
                warnings.showwarning = _show_warning
                try:
                    rc = cli.main(args)
                except SystemExit as exc:  # the interpreter's reading of sys.exit(code)
                    rc = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
                    if not isinstance(exc.code, (int, type(None))):
                        console.out(str(exc.code), err=True)
                except BaseException:  # noqa: BLE001 - what the interpreter would print, and its exit code
                    sys.stderr.write(traceback.format_exc())
                    rc = 1
                rc = console.settle(rc)
        finally:
            faulthandler.cancel_dump_traceback_later()
            seconds = time.monotonic() - t0
            for h, stream in zip(handlers, handler_streams):
                h.stream = stream
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            sys.argv = saved_argv
            for fd, saved in saved_fds.items():
                os.dup2(saved, fd)
                os.close(saved)
            os.environ.clear()
            os.environ.update(saved_env)
            console.FAILED.clear()
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
    return Result(rc, stdout, stderr, seconds, [ln for ln in stderr.splitlines() if ln.strip()])


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    import warnings

    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def check_refusal(args: list[str], *, sources: list[Path], dst: Path | None = None, exit_code: int = 2,
                  names: list[str] = (), trap: Path | None = None, timeout: float = TIME_BOUND_S,
                  stdin=subprocess.DEVNULL, input: bytes | None = None, env: dict | None = None,
                  allow_progress: bool = False, prefix: list[str] = ()) -> Result:
    """Run and assert the hostile-input contract; `names` must all appear in the error line."""
    before = tree_digest(*sources)
    e = dict(env or {})
    if trap is not None:
        e[TRAP_ENV] = str(trap)
    r = run_kvtool(args, env=e, timeout=timeout, stdin=stdin, input=input, prefix=prefix)
    what = f"kvtool {' '.join(map(str, args))}\nrc={r.rc}\nstderr:\n{r.stderr}\nstdout:\n{r.stdout[-2000:]}"
    assert r.rc == exit_code, what
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout, what
    errors = [ln for ln in r.lines if ln.startswith("kvtool: error") or ln.startswith("kvtool: ")]
    if allow_progress:
        assert len(errors) >= 1, what
        line = errors[-1]
    else:
        assert len(r.lines) == 1, what
        line = r.lines[0]
    assert "internal error" not in line, what
    for n in names:
        assert str(n) in line, f"{n!r} not named in the error line\n{what}"
    assert r.seconds < timeout, what
    if dst is not None:
        assert not dst.exists(), f"output {dst} was left behind\n{what}"
        parent = dst.parent
        if parent.is_dir():
            stale = [p.name for p in parent.iterdir() if p.name.startswith(f".{dst.name}.kvtool-")]
            assert not stale, f"staging folders left: {stale}\n{what}"
    assert tree_digest(*sources) == before, f"a source changed\n{what}"
    if trap is not None:
        assert not trap.exists(), f"checkpoint code ran (trap {trap} exists)\n{what}"
    return r


@dataclass
class Measured(Result):
    peak_rss_kib: int = 0  # the kvtool process's own peak resident memory (wait4's ru_maxrss)
    cpu_s: float = 0.0  # its user + system CPU time


def run_measured(args: list[str], *, env: dict | None = None, timeout: float = TIME_BOUND_S) -> Measured:
    """run_kvtool, with the peak RSS and CPU time of that one process (os.wait4: not RUSAGE_CHILDREN, which
    mixes in every child the test process ever waited for). Compare them with a reference run in the same
    test, not with fixed numbers: the machine's speed and load do not cancel out otherwise."""
    import tempfile

    e = dict(os.environ)
    e.setdefault("OMP_NUM_THREADS", "1")
    e.pop("KVTOOL_DEBUG", None)
    e.update(env or {})
    t0 = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen([sys.executable, "-m", "kvtool", *map(str, args)], env=e, stdin=subprocess.DEVNULL,
                             stdout=out, stderr=err)
        while True:  # wait4 reaps it and returns its rusage; Popen.wait would reap it first
            pid, status, usage = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() - t0 > timeout:
                p.kill()
                os.wait4(p.pid, 0)
                p.returncode = -9
                raise subprocess.TimeoutExpired(args, timeout)
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode("utf-8", "replace"), err.read().decode("utf-8", "replace")
    return Measured(p.returncode, stdout, stderr, time.monotonic() - t0,
                    [ln for ln in stderr.splitlines() if ln.strip()], usage.ru_maxrss, usage.ru_utime + usage.ru_stime)


def command_args(m: Path, ws: Path) -> dict[str, tuple[list, Path | None]]:
    """Every command on model folder `m` as (arguments, the DST it must not leave), files it needs made in `ws`."""
    out = ws / "out"
    (ws / "calib.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    recipe = ws / "r.yaml"
    recipe.write_text("version: 1\nname: r\nsteps:\n  - convert: {to: mqa}\n")
    return {
        "lint": (["lint", m], None),
        "kv-budget": (["kv-budget", m, "--gpu", "L4"], None),
        "convert": (["convert", m, out, "--to", "mqa"], out),
        "convert-dry-run": (["convert", m, "--to", "mqa", "--dry-run"], None),
        "eval": (["eval", m, "--device", "cpu", "--max-tokens", "16"], None),
        "quantize-kv": (["quantize-kv", m, out, "--calib-text", ws / "calib.txt", "--no-eval", "--device", "cpu"], out),
        "rope": (["rope", m, out, "--type", "linear", "--factor", "2"], out),
        "rope-show": (["rope", m, "--show"], None),
        "apply": (["apply", recipe, m, out], out),
    }
