"""The harness's in-process run is the subprocess run: the same exit code, stdout and stderr for cases of every
kind it takes in-process (a refusal of each command family, a usage error, help, success with output, a warning a
library prints, output written straight to the descriptors), and the cases it must leave to a subprocess go there."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from harness import TRAP_ENV, _run_here, in_process, run_kvtool

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    m = tmp_path_factory.mktemp("harness") / "m"
    shutil.copytree(TINY, m)
    return m


def _cases(m: Path, ws: Path) -> dict[str, list]:
    bad = ws / "bad"
    if ws.is_dir():
        bad.mkdir(exist_ok=True)
        (bad / "config.json").write_text('{"model_type": "llama", "num_attention_heads": 0}')
    return {
        "lint ok": ["lint", m],
        "lint json": ["lint", m, "--format", "json"],
        "lint bad": ["lint", bad],
        "lint missing": ["lint", ws / "nowhere"],
        "kv-budget": ["kv-budget", m, "--gpu", "RTX-4090", "--format", "json"],
        "kv-budget usage": ["kv-budget", m, "--gpu"],
        "rope show": ["rope", m],
        "convert refusal": ["convert", bad, ws / "out", "--to", "mqa"],
        "convert dry run": ["convert", m, ws / "out2", "--to", "mqa", "--dry-run"],
        "eval refusal": ["eval", bad],
        "quantize-kv refusal": ["quantize-kv", m, m, "--device", "cpu"],
        "unknown command": ["frobnicate"],
        "bad option": ["lint", m, "--no-such-option"],
        "help": ["convert", "--help"],
        "version": ["--version"],
    }


@pytest.mark.parametrize("case", list(_cases(Path("m"), Path("ws"))))
def test_in_process_equals_subprocess(tmp_path, model, case, monkeypatch) -> None:
    args = _cases(model, tmp_path)[case]
    here = _run_here([str(a) for a in args], env={}, timeout=120)
    monkeypatch.setenv("KVTOOL_TEST_SUBPROCESS", "1")
    there = run_kvtool(args, timeout=120)
    assert (here.rc, here.stdout, here.stderr) == (there.rc, there.stdout, there.stderr)


def test_a_python_warning_reaches_stderr_once_per_run(tmp_path) -> None:
    """pytest records warnings; a kvtool run in-process shows them as a fresh interpreter does, every run."""
    code = tmp_path / "warns.py"
    code.write_text("import warnings\nwarnings.warn('loud', UserWarning)\n")
    import runpy

    from kvtool import cli

    def command(argv):
        runpy.run_path(str(code))
        return 0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "main", command)
        first = _run_here(["lint"], env={}, timeout=60)
        second = _run_here(["lint"], env={}, timeout=60)
    assert "UserWarning: loud" in first.stderr and "UserWarning: loud" in second.stderr


def test_descriptor_writes_are_read(tmp_path) -> None:
    """What a library writes to descriptor 2 itself (torch's C++ warnings) is in stderr, as in a subprocess."""
    import os

    from kvtool import cli

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cli, "main", lambda argv: os.write(2, b"from C\n") and 3)
        r = _run_here(["lint"], env={}, timeout=60)
    assert (r.rc, r.lines) == (3, ["from C"])


@pytest.mark.parametrize("kw", [{"cwd": Path("/")}, {"stdin": subprocess.PIPE}, {"input": b"y\n"},
                                {"prefix": ["env"]}, {"env": {"PYTHONIOENCODING": "ascii"}}])
def test_what_only_a_subprocess_shows_goes_to_one(kw) -> None:
    assert not in_process(**kw)


def test_a_run_beside_another_thread_goes_to_a_subprocess(monkeypatch) -> None:
    """A stand-in server's thread prints its own tracebacks: in-process they would be read as kvtool's."""
    import threading

    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/hostile/x.py::in (call)")
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    try:
        assert not in_process()
    finally:
        stop.set()
        t.join()
    assert in_process()


def test_the_trap_and_nothing_else_stays_in_process(monkeypatch) -> None:
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/hostile/x.py::in (call)")  # crc32 % 8 != 0
    assert in_process(env={TRAP_ENV: "/tmp/trap"})
    monkeypatch.setenv("KVTOOL_TEST_SUBPROCESS", "1")
    assert not in_process(env={TRAP_ENV: "/tmp/trap"})


def test_a_thread_an_earlier_test_left_does_not_count(monkeypatch) -> None:
    """Only threads the test itself started send a run to a subprocess (tests/conftest.py notes those alive at its
    start): in CI an earlier test of the same worker may leave a daemon thread behind."""
    import threading

    import harness

    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/hostile/x.py::in (call)")
    stop = threading.Event()
    left = threading.Thread(target=stop.wait, daemon=True)
    left.start()
    try:
        assert not in_process()  # started during this test
        monkeypatch.setattr(harness, "THREADS_AT_START", frozenset(threading.enumerate()))
        assert in_process()  # as if an earlier test had left it
    finally:
        stop.set()
        left.join()


def test_a_stand_in_server_that_writes_nothing_keeps_the_run_in_process(monkeypatch, tmp_path) -> None:
    """tests/fake_server.py's threads record their errors instead of printing them, so a run beside one stays in
    this process, and a handler's error during the run is recorded, not read as kvtool's output."""
    from fake_server import FakeServer

    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/hostile/x.py::in (call)")
    text = tmp_path / "t.txt"
    text.write_text("some text to score", encoding="utf-8")

    def broken(h, method, path, body):
        raise ValueError("a handler's own error")

    with FakeServer(intercept=broken) as s:
        assert in_process()
        r = _run_here(["eval", "honest", "--server", s.url, "--text", str(text)], env={}, timeout=60)
    assert r.rc == 2 and len(r.lines) == 1 and r.lines[0].startswith("kvtool: error: "), r.stderr
    assert "Traceback" not in r.stderr and "a handler's own error" not in r.stderr
    assert [type(e) for e in s.errors] == [ValueError]


def test_the_digest_of_a_large_file_sees_a_write_or_a_replacement(tmp_path) -> None:
    """Files from DIGEST_BY_STAT bytes are told by size, mtime, ctime and inode, not read: one byte rewritten in
    place (mtime set back as it was) or the same bytes put in its place must still change the digest."""
    import os

    from harness import DIGEST_BY_STAT, tree_digest

    big = tmp_path / "big.bin"
    with big.open("wb") as fh:
        fh.truncate(DIGEST_BY_STAT)
    before = tree_digest(tmp_path)
    assert before[str(big)].startswith("stat:") and tree_digest(tmp_path) == before
    st = big.stat()
    with big.open("r+b") as fh:
        fh.seek(12345)
        fh.write(b"\0")  # the same byte: only the write itself is left to see
    os.utime(big, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert tree_digest(tmp_path) != before
    now = tree_digest(tmp_path)
    copy = tmp_path / "copy.bin"
    with copy.open("wb") as fh:
        fh.truncate(DIGEST_BY_STAT)
    os.replace(copy, big)
    assert tree_digest(tmp_path) != now
