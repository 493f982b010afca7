"""Issue 39 class 2: the exit code reports the verdict, or the failure to deliver it, never success over lost output.

Every command that writes output runs once as a reference (stdout and stderr captured), then with its output sent
where it cannot arrive: a pipe whose reader is gone, stdout closed (`>&-`), a full device (/dev/full), a file
size limit (RLIMIT_FSIZE below the output's length), and with stderr closed (`2>&-`). The codes checked are the
ones docs/exit-codes.md documents: 141 (128 + SIGPIPE, no line) for a closed pipe, 2 and one line for any other
stdout that cannot be written, the verdict itself when only stderr is gone.
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile.models import LLAMA, llama

EXIT_PIPE = 141
TIMEOUT = 120


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("streams")
    llama(ws / "ok")
    llama(ws / "bad", {**LLAMA, "num_key_value_heads": 3})  # KV102: lint exit 1, kv-budget exit 2
    (ws / "r.yaml").write_text("version: 1\nname: r\nsteps:\n  - convert: {to: mqa}\n")
    return ws


# (arguments, the verdict's exit code): every command that writes a verdict or a report, one line each
COMMANDS = {
    "lint-clean": (["lint", "ok"], 0),
    "lint-findings": (["lint", "bad"], 1),
    "lint-json": (["lint", "bad", "--format", "json"], 1),
    "lint-sarif": (["lint", "bad", "--format", "sarif"], 1),
    "lint-github": (["lint", "bad", "--format", "github"], 1),
    "kv-budget-fits": (["kv-budget", "ok", "--gpu", "H100-80GB"], 0),
    "kv-budget-does-not-fit": (["kv-budget", "ok", "--gpu", "1KiB"], 1),
    "kv-budget-json": (["kv-budget", "ok", "--gpu", "1KiB", "--format", "json", "--what-if", "gqa:1,mqa,fp8"], 1),
    "rope-show": (["rope", "ok", "--show"], 0),
    "rules": (["rules"], 0),
    "convert-dry-run": (["convert", "ok", "--to", "mqa", "--dry-run"], 0),
    "apply-dry-run": (["apply", "r.yaml", "ok", "out", "--dry-run"], 0),
    "help": (["--help"], 0),
    "version": (["--version"], 0),
}
# refusals: the verdict is the error line on stderr (stdout empty); no sink may turn them into a 0
REFUSALS = {
    "eval-refusal": ["eval", "ok", "--device", "cpu", "--max-tokens", "0"],
    "kv-budget-refusal": ["kv-budget", "bad"],
    "convert-refusal": ["convert", "ok", "--to", "gqa", "--groups", "3", "--dry-run"],
}


def _run(ws: Path, args: list[str], **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("KVTOOL_DEBUG", None)
    kw.setdefault("stdout", subprocess.PIPE)
    kw.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "kvtool", *args], cwd=ws, env=env, stdin=subprocess.DEVNULL,
                          timeout=TIMEOUT, **kw)


def _closing(*fds: int):
    def pre():
        for fd in fds:
            os.close(fd)
    return pre


def _file_size_limit(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the shell's `ulimit -f` under Python: EFBIG, a short write
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


def _lines(p) -> list[str]:
    return [ln for ln in (p.stderr or b"").decode("utf-8", "replace").splitlines() if ln.strip()]


def _one_cannot_write_line(p, why: str) -> None:
    lines = _lines(p)
    assert p.returncode == 2, (p.returncode, lines)
    assert len(lines) == 1 and lines[0].startswith(f"kvtool: error: stdout: cannot write: {why}"), lines
    assert "Traceback" not in p.stderr.decode("utf-8", "replace")


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_sink_reports_the_verdict_or_its_loss(ws, tmp_path, name):
    args, verdict = COMMANDS[name]
    ref = _run(ws, args)
    assert ref.returncode == verdict, _lines(ref)
    assert ref.stdout, "a command with output"

    # a reader that is gone before the first write: the shell's status of a tool SIGPIPE ended, nothing said
    r, w = os.pipe()
    os.close(r)
    try:
        p = _run(ws, args, stdout=w)
    finally:
        os.close(w)
    assert p.returncode == EXIT_PIPE and _lines(p) == [], (p.returncode, _lines(p))

    # stdout closed (`>&-`): one line, exit 2; nothing of the output lands in a file kvtool opened on fd 1
    p = _run(ws, args, stdout=None, preexec_fn=_closing(1))
    _one_cannot_write_line(p, "Bad file descriptor")

    # a full device
    with open("/dev/full", "wb") as full:
        p = _run(ws, args, stdout=full)
    _one_cannot_write_line(p, "No space left on device")

    # a file size limit below the output: a short write is an error, never a success over a cut file
    limit = max(1, len(ref.stdout) // 2)
    with open(tmp_path / "out.txt", "wb") as fh:
        p = _run(ws, args, stdout=fh, preexec_fn=_file_size_limit(limit))
    _one_cannot_write_line(p, "File too large")
    assert (tmp_path / "out.txt").stat().st_size <= limit

    # stderr closed (`2>&-`): stdout whole and the verdict's own code (stderr carries no verdict of its own)
    p = _run(ws, args, stderr=None, preexec_fn=_closing(2))
    assert p.returncode == verdict and p.stdout == ref.stdout


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refusal_is_never_turned_into_success(ws, name):
    args = REFUSALS[name]
    ref = _run(ws, args)
    assert ref.returncode == 2 and len(_lines(ref)) == 1 and not ref.stdout, _lines(ref)
    for kw in ({"stderr": None, "preexec_fn": _closing(2)}, {"stdout": None, "preexec_fn": _closing(1)},
               {"stdout": None, "stderr": None, "preexec_fn": _closing(1, 2)}):
        p = _run(ws, args, **kw)
        assert p.returncode == 2, (kw, p.returncode, _lines(p))
        assert "Traceback" not in (p.stderr or b"").decode("utf-8", "replace")


def test_a_closed_stdout_lends_its_number_to_no_file(ws, tmp_path):
    """With fd 1 closed, the first file kvtool opens would get number 1 and every later print would land in it:
    a converted model's config.json, say. The slot is held before any file is opened."""
    out = tmp_path / "dst"
    p = _run(ws, ["convert", "ok", str(out), "--to", "mqa", "--no-eval"], stdout=None, preexec_fn=_closing(1))
    lines = _lines(p)
    assert p.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith("kvtool: error: stdout: cannot write: Bad file descriptor")
    assert lines[0].endswith(f"{out} is written")  # published before the report: kept, whole, and said so
    import json

    from kvtool.io.safetensors_header import read_header

    json.loads((out / "config.json").read_text())
    assert read_header(out / "model.safetensors").ok


def test_a_non_blocking_stdout_is_waited_on_not_cut(ws):
    """A pipe the parent set O_NONBLOCK on (shared with a node or asyncio reader): a full pipe is EAGAIN, which
    Python's stream raises (BlockingIOError) mid-output; kvtool waits for the reader instead."""
    import fcntl

    r, w = os.pipe()
    fcntl.fcntl(w, fcntl.F_SETPIPE_SZ, 4096)  # smaller than the output: the writer meets a full pipe
    fcntl.fcntl(w, fcntl.F_SETFL, fcntl.fcntl(w, fcntl.F_GETFL) | os.O_NONBLOCK)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kvtool", "rules"], cwd=ws, env=env, stdout=w,
                            stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    os.close(w)
    import time

    time.sleep(1.0)  # let it fill the pipe before anything reads
    with os.fdopen(r, "rb") as fh:
        got = fh.read()
    _, err = proc.communicate(timeout=TIMEOUT)
    ref = _run(ws, ["rules"])
    assert proc.returncode == 0 and got == ref.stdout, err.decode()
