"""Ctrl-C, SIGTERM, SIGKILL and a full disk: exit 130 with one line saying what was (not) written,
never a half-written DST, and a killed run's staging folder is cleaned up by the next run.

To interrupt at an exact point, the child runs kvtool with kvtool.io.staging._commit wrapped: it
touches a READY file and sleeps just before (or just after) the rename that publishes DST. The test
waits for READY, then signals. One case per signal also interrupts a real, unpatched convert of a
~150 MB checkpoint while its staging folder fills.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hostile import models
from tests.hostile.harness import check_refusal, run_kvtool, tree_digest

REPO = Path(__file__).resolve().parents[2]
WAIT_S = 120.0

PAUSED_KVTOOL = """
import os, sys, time, pathlib
import kvtool.io.staging as st
ready, when, name = pathlib.Path(os.environ["T_READY"]), os.environ["T_WHEN"], os.environ["T_DST_NAME"]
real = st._commit
def commit(tmp, dst, force):
    if dst.name == name and when == "before_commit":
        ready.write_text("x"); time.sleep(300)
    real(tmp, dst, force)
    if dst.name == name and when == "after_commit":
        ready.write_text("x"); time.sleep(300)
st._commit = commit
sys.argv = ["kvtool", *sys.argv[1:]]
from kvtool.cli import _entry
_entry()
"""


def _env(**extra) -> dict:
    e = dict(os.environ)
    e.update({"OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), e.get("PYTHONPATH", "")])})
    e.pop("KVTOOL_DEBUG", None)
    e.update(extra)
    return e


def _start(args: list, *, when: str | None, dst: Path, ready: Path) -> subprocess.Popen:
    argv = [sys.executable, "-c", PAUSED_KVTOOL] if when else [sys.executable, "-m", "kvtool"]
    env = _env(T_READY=str(ready), T_WHEN=when or "", T_DST_NAME=dst.name)
    return subprocess.Popen([*argv, *map(str, args)], env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_interruptible)


def _interruptible() -> None:
    """The child takes SIGINT as a terminal's Ctrl-C delivers it: a test run started in the background of a
    shell without job control inherits SIGINT ignored, and Python (like kvtool) keeps an inherited ignore. SIGHUP
    likewise, as a closed terminal delivers it: under nohup the suite inherits it ignored, and kvtool keeps nohup's
    ignore by design (kvtool/cli.py), which is not what these tests ask."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


def _wait_for(pred, proc: subprocess.Popen, what: str) -> None:
    t0 = time.monotonic()
    while not pred():
        if proc.poll() is not None:
            out, err = proc.communicate()
            pytest.fail(f"kvtool ended (rc {proc.returncode}) before {what}:\n{err.decode()}")
        if time.monotonic() - t0 > WAIT_S:
            proc.kill()
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.005)


def _finish(proc: subprocess.Popen) -> tuple[int, list[str]]:
    out, err = proc.communicate(timeout=WAIT_S)
    text = err.decode("utf-8", "replace")
    assert "Traceback" not in text, text
    return proc.returncode, [ln for ln in text.splitlines() if ln.strip()]


@pytest.fixture
def ws(tmp_path):
    src = models.llama(tmp_path / "src")
    (tmp_path / "rope.yaml").write_text("version: 1\nname: t\nsteps:\n  - rope: {type: yarn, factor: 2}\n")
    return tmp_path


def _args(cmd: str, src: Path, dst: Path, ws: Path) -> list:
    return {"convert": ["convert", src, dst, "--to", "mqa", "--no-eval"],
            "rope": ["rope", src, dst, "--type", "linear", "--factor", "2"],
            "apply": ["apply", ws / "rope.yaml", src, dst, "--device", "cpu"]}[cmd]


def _staging_left(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if ".kvtool-" in p.name)


SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}  # SIGHUP: issue 39


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("cmd", ["convert", "rope", "apply"])
def test_interrupt_before_dst_is_published_writes_nothing(ws, cmd, sig):
    src, dst, ready = ws / "src", ws / "out", ws / "READY"
    before = tree_digest(src)
    proc = _start(_args(cmd, src, dst, ws), when="before_commit", dst=dst, ready=ready)
    _wait_for(ready.exists, proc, "the staging folder was complete")
    proc.send_signal(SIGNALS[sig])
    rc, lines = _finish(proc)
    assert rc == 130, lines
    assert lines[-1] == "kvtool: interrupted: nothing was written", lines
    assert [ln for ln in lines if ln.startswith("kvtool:")] == [lines[-1]]
    assert not dst.exists() and _staging_left(ws) == []
    assert tree_digest(src) == before


@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("cmd", ["convert", "rope", "apply"])
def test_interrupt_after_dst_is_published_says_it_is_written(ws, cmd, sig):
    src, dst, ready = ws / "src", ws / "out", ws / "READY"
    proc = _start(_args(cmd, src, dst, ws), when="after_commit", dst=dst, ready=ready)
    _wait_for(ready.exists, proc, "DST was published")
    proc.send_signal(SIGNALS[sig])
    rc, lines = _finish(proc)
    assert rc == 130, lines
    assert lines[-1] == f"kvtool: interrupted after the output was complete: {dst} is written", lines
    assert json.loads((dst / "config.json").read_text())["model_type"] == "llama"
    assert _staging_left(ws) == []


@pytest.mark.parametrize("sig", list(SIGNALS))
def test_interrupting_a_real_convert_mid_write(tmp_path, sig):
    src = models.big_llama(tmp_path / "big")
    dst = tmp_path / "out"
    before = tree_digest(src)
    proc = _start(["convert", src, dst, "--to", "mqa", "--no-eval"], when=None, dst=dst, ready=tmp_path / "R")

    def writing() -> bool:
        return any(p.name.startswith(".out.kvtool-tmp-") and any(p.glob("*.safetensors"))
                   for p in tmp_path.iterdir())

    _wait_for(writing, proc, "the first shard was being written")
    proc.send_signal(SIGNALS[sig])
    rc, lines = _finish(proc)
    assert rc == 130, lines
    assert lines[-1] == "kvtool: interrupted: nothing was written", lines
    assert not dst.exists() and _staging_left(tmp_path) == []
    assert tree_digest(src) == before


@pytest.mark.parametrize("cmd", ["convert", "rope", "apply"])
def test_sigkill_then_rerun_cleans_up_and_succeeds(ws, cmd):
    src, dst, ready = ws / "src", ws / "out", ws / "READY"
    proc = _start(_args(cmd, src, dst, ws), when="before_commit", dst=dst, ready=ready)
    _wait_for(ready.exists, proc, "the staging folder was complete")
    proc.kill()
    proc.communicate(timeout=WAIT_S)
    left = _staging_left(ws)
    assert left and not dst.exists()  # what a SIGKILL leaves: nothing can run on the way out
    r = run_kvtool(_args(cmd, src, dst, ws))
    assert r.rc == 0, r.stderr
    said = [ln for ln in r.lines if "staging folder" in ln]
    assert len(said) == 1 and all(name in said[0] for name in left), r.lines
    assert _staging_left(ws) == [] and (dst / "config.json").is_file()


def _file_size_limit(limit: int):
    def pre():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return pre


@pytest.mark.parametrize("cmd", ["convert", "rope", "apply"])
def test_disk_full_mid_write_is_one_line_and_leaves_nothing(ws, cmd):
    src, dst = ws / "src", ws / "out"
    before = tree_digest(src)
    p = subprocess.run([sys.executable, "-m", "kvtool", *map(str, _args(cmd, src, dst, ws))],
                       env=_env(PYTHONDONTWRITEBYTECODE="1"), stdin=subprocess.DEVNULL, capture_output=True,
                       timeout=WAIT_S, preexec_fn=_file_size_limit(64 * 1024))
    err = p.stderr.decode()
    lines = [ln for ln in err.splitlines() if ln.startswith("kvtool:")]
    assert p.returncode == 2 and "Traceback" not in err, err
    assert len(lines) == 1 and "file too large" in lines[0] and "nothing was written" in lines[0], err
    assert not dst.exists() and _staging_left(ws) == []
    assert tree_digest(src) == before


# --- long steps before anything is written: tokenizing a text --------------------------------------------------
# kvtool.tokenstream tokenizes a window at a time, so a signal is handled within one window. Before, one
# tokenizer call on the whole text held the interpreter: SIGTERM waited until it returned (or the kernel killed
# the process for memory). The text's read position (/proc/PID/fdinfo) says when kvtool is tokenizing it.
TEXT_MIB = 32


def _read_position(pid: int, path: Path) -> int | None:
    """Where process pid is reading path (None: it has not opened it, or it has closed it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == str(path):
                info = Path(f"/proc/{pid}/fdinfo/{fd}").read_text()
                return int(next(ln.split()[1] for ln in info.splitlines() if ln.startswith("pos:")))
        except (OSError, StopIteration, ValueError):
            continue
    return None


@pytest.fixture(scope="module")
def long_text(tmp_path_factory) -> Path:
    from kvtool.datasets import calibration_text

    path = tmp_path_factory.mktemp("text") / "long.txt"
    block = calibration_text().encode("utf-8")
    with path.open("wb") as fh:
        while fh.tell() < TEXT_MIB << 20:
            fh.write(block)
    return path


TOKENIZING = {
    "eval": lambda m, t, out: ["eval", m, "--text", t, "--device", "cpu"],  # every token: the whole text
    "quantize-kv": lambda m, t, out: ["quantize-kv", m, out, "--calib-text", t, "--calib-tokens", str(1 << 30),
                                      "--no-eval", "--device", "cpu"],
}


@pytest.mark.torch
@pytest.mark.skipif(not Path("/proc/self/fdinfo").is_dir(), reason="reads /proc/PID/fdinfo (Linux)")
@pytest.mark.parametrize("sig", list(SIGNALS))
@pytest.mark.parametrize("cmd", sorted(TOKENIZING))
def test_a_signal_stops_tokenizing_a_long_text(tmp_path, long_text, cmd, sig):
    model, dst = REPO / "examples" / "llama-gqa-tiny", tmp_path / "out"
    proc = _start(TOKENIZING[cmd](model, long_text, dst), when=None, dst=dst, ready=tmp_path / "R")
    first: list[float] = []

    def reading_far() -> bool:
        pos = _read_position(proc.pid, long_text)
        if pos and not first:
            first.append(time.monotonic())
        return bool(pos and pos >= 1 << 20)

    _wait_for(reading_far, proc, "the text was being tokenized")
    took = time.monotonic() - first[0]  # to read and tokenize 1 MiB
    proc.send_signal(SIGNALS[sig])
    t0, last = time.monotonic(), 0
    while proc.poll() is None and time.monotonic() - t0 < WAIT_S:
        last = max(last, _read_position(proc.pid, long_text) or 0)
        time.sleep(0.01)
    stopped = time.monotonic() - t0
    rc, lines = _finish(proc)
    assert rc == 130, lines
    assert lines[-1] == "kvtool: interrupted: nothing was written", lines
    assert not dst.exists() and _staging_left(tmp_path) == []
    assert last < long_text.stat().st_size  # it stopped reading: the text was never read through
    assert stopped < took + 5.0, (stopped, took)  # within about a window, not the rest of the text
