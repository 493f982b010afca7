"""Issue 39, the red-team pass on the command line's surroundings (new classes, not variations of the issue's):
argv values that are no path, a working folder removed under the shell, stdin closed, an environment without
HOME, stdout encodings that lack characters kvtool prints.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from harness import check_refusal

from tests.hostile.models import LLAMA, llama

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ws(tmp_path_factory) -> Path:
    ws = tmp_path_factory.mktemp("env")
    llama(ws / "ok")
    llama(ws / "bad", {**LLAMA, "num_key_value_heads": 3})
    llama(ws / "é-model")
    (ws / "r.yaml").write_text("version: 1\nname: r\nsteps:\n  - convert: {to: mqa}\n")
    return ws


def _run(args, *, cwd, env=None, **kw) -> subprocess.CompletedProcess:
    e = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    e.pop("KVTOOL_DEBUG", None)
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], cwd=cwd, env=e, capture_output=True,
                          timeout=120, **kw)


# --- argv: an empty or blank MODEL / SRC / DST is no path (Path("") is the working folder) -------------------
EMPTY = {
    "lint": (["lint", "ok", "{e}"], "PATHS"),
    "kv-budget": (["kv-budget", "{e}"], "MODEL"),
    "rope-show": (["rope", "{e}", "--show"], "SRC"),
    "rope-dst": (["rope", "ok", "{e}", "--type", "linear", "--factor", "2"], "DST"),
    "convert-src": (["convert", "{e}", "out", "--to", "mqa"], "SRC"),
    "convert-dst": (["convert", "ok", "{e}", "--to", "mqa"], "DST"),
    "apply-dst": (["apply", "r.yaml", "ok", "{e}"], "DST"),
    "eval": (["eval", "{e}"], "MODEL"),
    "quantize-kv-dst": (["quantize-kv", "ok", "{e}"], "DST"),
}


@pytest.mark.parametrize("blank", ["", " ", "\t"], ids=["empty", "space", "tab"])
@pytest.mark.parametrize("name", sorted(EMPTY))
def test_an_empty_path_argument_is_refused_before_work(ws, tmp_path, name, blank):
    """`kvtool lint ""` linted the working folder, `kvtool rope m ""` staged its output into it."""
    template, field = EMPTY[name]
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    for p in ("ok", "r.yaml"):
        (cwd / p).symlink_to(ws / p)
    before = sorted(os.listdir(cwd))
    p = _run([a.format(e=blank) for a in template], cwd=cwd)
    lines = [ln for ln in p.stderr.decode().splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"kvtool: error: {field}: ") and "empty name" in lines[0], lines
    assert sorted(os.listdir(cwd)) == before  # nothing staged or written in the working folder


# --- a working folder removed under the shell ------------------------------------------------------------------
@pytest.mark.parametrize("args,code", [
    (["lint", "{ws}/bad"], 1), (["lint", "{ws}/bad", "--format", "sarif"], 1), (["lint", "{ws}/ok"], 0),
    (["kv-budget", "{ws}/ok"], 0), (["rope", "{ws}/ok", "--show"], 0),
    (["convert", "{ws}/ok", "--to", "mqa", "--dry-run"], 0),
    (["apply", "{ws}/r.yaml", "{ws}/ok", "{ws}/never", "--dry-run"], 0),
], ids=lambda v: " ".join(v[:1] + v[2:]) if isinstance(v, list) else str(v))
def test_a_removed_working_folder(ws, tmp_path, args, code):
    """Absolute paths need no working folder: lint looked for pyproject.toml from it and SARIF named it
    (`kvtool: error: No such file or directory`, exit 2, no file named)."""
    gone = tmp_path / "gone"
    gone.mkdir()
    # the child changes into the folder, which is then removed; it runs kvtool from there
    script = (f"import os, sys; os.chdir({str(gone)!r}); os.rmdir({str(gone)!r}); "
              f"sys.argv = ['kvtool', *sys.argv[1:]]; sys.path.insert(0, {str(REPO)!r}); "
              "from kvtool.cli import _entry; _entry()")
    e = {**os.environ, "OMP_NUM_THREADS": "1"}
    e.pop("KVTOOL_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", script, *[a.format(ws=ws) for a in args]], env=e,
                       capture_output=True, timeout=120, cwd=tmp_path)
    assert p.returncode == code, p.stderr.decode()
    assert "Traceback" not in p.stderr.decode()
    if "sarif" in args:
        json.loads(p.stdout)


# --- stdin closed, HOME unset ----------------------------------------------------------------------------------
def test_stdin_closed_and_no_home(ws, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "HOME"}
    for args, code in ((["lint", ws / "bad"], 1), (["kv-budget", ws / "ok"], 0),
                       (["convert", ws / "ok", tmp_path / "out", "--to", "mqa", "--no-eval"], 0)):
        p = subprocess.run([sys.executable, "-m", "kvtool", *map(str, args)], env={**env, "PYTHONPATH": str(REPO)},
                           capture_output=True, timeout=120, preexec_fn=lambda: os.close(0))
        assert p.returncode == code and "Traceback" not in p.stderr.decode(), p.stderr.decode()
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1


# --- encodings of stdout that lack what kvtool prints ----------------------------------------------------------
@pytest.mark.parametrize("encoding", ["ascii", "latin-1", "cp1252", "utf-8"])
@pytest.mark.parametrize("fmt", ["text", "json", "sarif", "github"])
def test_an_encoding_without_the_characters(ws, encoding, fmt):
    """PYTHONIOENCODING=ascii (or LANG=C without UTF-8 mode) and a folder named é: the output is written with
    backslash escapes, never a UnicodeEncodeError (an internal error, exit 2, the report lost)."""
    p = _run(["lint", "é-model", "--format", fmt], cwd=ws, env={"PYTHONIOENCODING": encoding})
    assert p.returncode == 0 and p.stderr == b"", p.stderr.decode()
    text = p.stdout.decode(encoding)
    if fmt in ("json", "sarif"):
        json.loads(text)


def test_an_encoding_without_the_characters_in_an_error_line(ws):
    r = check_refusal(["kv-budget", "é-missing"], sources=[ws / "ok"], env={"PYTHONIOENCODING": "ascii"})
    assert "missing" in r.lines[0]
