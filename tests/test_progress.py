"""kvtool.progress: modes, ETA, the terminal line, plain lines elsewhere, and clean stdout in commands."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvtool import progress

REPO = Path(__file__).resolve().parents[1]


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("flag,tty,mode", [
    (None, True, "bar"), (None, False, "off"),       # default: on at a terminal only
    (True, True, "bar"), (True, False, "lines"),     # --progress: plain lines into a log
    (False, True, "off"), (False, False, "off"),     # --no-progress
])
def test_resolve(flag, tty, mode):
    assert progress.resolve(flag, Tty() if tty else io.StringIO()) == mode


def test_session_sets_and_restores_the_mode(monkeypatch):
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert not progress.active()
    with progress.session(True) as mode:
        assert mode == "lines" and progress.active()
        assert progress.task("x").mode == "lines"
        assert progress.task("x", enabled=False).mode == "off"
    assert not progress.active() and progress.task("x").mode == "off"  # a library call stays silent


def test_render_count_percent_eta():
    t = progress.Task("calibrate", 30, "layers", mode="off")
    t.t0 -= 20.0
    t.done = 10
    line = t.render(now=t.t0 + 20.0)
    assert line == "calibrate  10/30 layers   33%  elapsed 0:20  ETA 0:40"
    t.note = "layer 9, refinement step 3/64"
    assert t.render(now=t.t0 + 20.0).endswith("(layer 9, refinement step 3/64)")
    assert progress.Task("x", None, "", mode="off").eta(5.0) is None  # no total: no ETA
    assert progress.Task("x", 10, "", mode="off").eta(5.0) is None    # nothing done yet: no ETA


def test_fractional_and_byte_counts():
    t = progress.Task("calibrate", 30, "layers", mode="off")
    t.done = 4.25
    assert "4.2/30 layers" in t.render()
    b = progress.Task("convert", 3 * 2**30, "", mode="off", scale="bytes")
    b.done = 2**29
    assert "512.0 MiB/3.0 GiB" in b.render()
    r = progress.Task("eval", 100, "tok", mode="off", rate=True)
    r.t0 -= 4.0
    r.done = 50
    assert "  12.5 tok/s  elapsed 0:04  ETA 0:04" in r.render(now=r.t0 + 4.0)
    assert progress.fmt_duration(3725) == "1:02:05" and progress.fmt_duration(59.6) == "1:00"


def test_off_writes_nothing():
    out = Tty()
    with progress.Task("x", 3, mode="off", stream=out) as t:
        t.update(3)
    assert out.getvalue() == ""


def test_bar_redraws_one_line_while_a_step_runs(monkeypatch):
    monkeypatch.setattr(progress, "BAR_REFRESH_S", 0.05)
    out = Tty()
    with progress.Task("load", None, mode="bar", stream=out) as t:
        time.sleep(0.3)  # one long step: the ticker keeps the clock moving
        t.update(1, note="done")
    text = out.getvalue()
    assert text.count("\r") >= 4 and text.endswith("\n") and text.count("\n") == 1
    assert "(done)" in text.rsplit("\r", 1)[1]


def test_lines_mode_start_periodic_and_end(monkeypatch):
    monkeypatch.setattr(progress, "LINES_EVERY_S", 0.0)
    out = io.StringIO()
    with progress.Task("eval", 4, "tok", mode="lines", stream=out) as t:
        t.update(2)
        t.update(2)
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines[0].startswith("eval  0/4 tok") and lines[-1].startswith("eval  4/4 tok  100%")
    assert any(ln.startswith("eval  2/4 tok   50%") for ln in lines)


def test_closed_stream_never_fails():
    out = Tty()
    t = progress.Task("x", 2, mode="bar", stream=out)
    out.close()
    t.update(1)
    t.close()


# --- in commands: stderr only, stdout clean ------------------------------------------------------------

def _convert(tmp_path, *flags: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "kvtool", "convert", str(REPO / "examples" / "llama-gqa-tiny"),
                           str(tmp_path / "out"), "--to", "mqa", "--no-eval", *flags],
                          capture_output=True, text=True, env=env, timeout=120)


def test_convert_progress_goes_to_stderr_only(tmp_path):
    p = _convert(tmp_path, "--progress")
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("converted ") and "convert " not in p.stdout.split("\n", 1)[1]
    assert "convert  " in p.stderr and "100%" in p.stderr and "\r" not in p.stderr  # a pipe: plain lines


def test_no_progress_and_a_pipe_are_silent(tmp_path):
    assert _convert(tmp_path, "--no-progress").stderr == ""
    assert _convert(tmp_path / "b").stderr == ""  # stderr not a terminal, no flag: no progress


@pytest.mark.slow
def test_eval_json_stays_clean_with_progress(smollm2_path, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "kvtool", "eval", str(smollm2_path), "--max-tokens", "64",
                        "--max-length", "32", "--format", "json", "--progress"],
                       capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["tokens"] == 63  # stdout is exactly the JSON document
    # a model folder is evaluated one decoder layer at a time (kvtool.eval.layerwise): opening it, then the tokens
    assert "opening " in p.stderr and "eval (layer by layer)  63/63 tok  100%" in p.stderr


def test_an_error_inside_a_task_ends_its_line_and_stops_the_ticker(monkeypatch):
    monkeypatch.setattr(progress, "BAR_REFRESH_S", 0.02)
    out = Tty()
    with pytest.raises(RuntimeError):
        with progress.Task("eval", 10, "tok", mode="bar", stream=out) as t:
            t.update(3)
            raise RuntimeError("boom")
    text = out.getvalue()
    time.sleep(0.1)
    assert out.getvalue() == text and text.endswith("\n")  # kvtool's error line starts on a clean line
