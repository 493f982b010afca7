"""Issue 39 class 6: the working folder never joins the import path, and never names the installed releases.

`python -m kvtool` puts the working folder first on sys.path, so a model folder kvtool runs inside could ship
`transformers/`, `numpy/` or even `json.py` and have it imported (run) in place of the real one; and lint read a
`transformers-*.dist-info` planted there as the installed release. Every module name kvtool or its libraries
import is a candidate: the test plants a payload under each name in the list (packages and plain modules,
stdlib ones included), runs every command inside the folder, and checks no payload ran and the releases lint
names are the installed ones.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from tests.hostile.models import llama

REPO = Path(__file__).resolve().parents[2]
# modules kvtool's commands import after start-up (stdlib ones the interpreter has not loaded by then, and
# every third-party library on the lint / kv-budget / rope / convert / recipe paths)
PLANTED = ["transformers", "torch", "numpy", "safetensors", "typer", "click", "yaml", "packaging", "json",
           "re", "hashlib", "tempfile", "shutil", "struct", "uuid", "random", "datetime", "decimal",
           "unicodedata", "select", "fcntl", "resource", "importlib_metadata", "kvtool_extra"]
PAYLOAD = "import os\nopen(os.environ['KVTOOL_HOSTILE_TRAP'] + '-' + __name__, 'w').write('ran')\n"
COMMANDS = {
    "lint": (["lint", "."], 0),
    "lint-json": (["lint", ".", "--format", "json"], 0),
    "kv-budget": (["kv-budget", ".", "--gpu", "L4"], 0),
    "rope-show": (["rope", ".", "--show"], 0),
    "convert-dry-run": (["convert", ".", "--to", "mqa", "--dry-run"], 0),
    "convert": (["convert", ".", "../out", "--to", "mqa", "--no-eval"], 0),
    "apply-dry-run": (["apply", "../r.yaml", ".", "../out2", "--dry-run"], 0),
    "rules": (["rules"], 0),
    "help": (["--help"], 0),
}


def _plant(folder: Path) -> None:
    for i, name in enumerate(PLANTED):
        if i % 2:  # both kinds of shadowing: a package folder and a plain module
            (folder / name).mkdir()
            (folder / name / "__init__.py").write_text(PAYLOAD)
        else:
            (folder / f"{name}.py").write_text(PAYLOAD)
    info = folder / "transformers-99.0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 99.0.0\n\n")
    for dist in ("vllm-99.0.0.dist-info", "torch-99.0.0.dist-info"):
        (folder / dist).mkdir()
        (folder / dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist.split('-')[0]}\n"
                                                "Version: 99.0.0\n\n")


@pytest.fixture
def planted(tmp_path) -> Path:
    m = llama(tmp_path / "m")
    _plant(m)
    (tmp_path / "r.yaml").write_text("version: 1\nname: r\nsteps:\n  - convert: {to: mqa}\n")
    return m


def _env(trap: Path, pythonpath: str) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "KVTOOL_HOSTILE_TRAP": str(trap), "PYTHONPATH": pythonpath,
           "PYTHONDONTWRITEBYTECODE": "1"}
    env.pop("KVTOOL_DEBUG", None)
    env.pop("PYTHONSAFEPATH", None)
    return env


def _ran(trap: Path) -> list[str]:
    return sorted(p.name for p in trap.parent.iterdir() if p.name.startswith(trap.name + "-"))


@pytest.mark.parametrize("pythonpath", ["repo", "empty-entry-first"])
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_python_m_kvtool_inside_a_model_folder_imports_nothing_from_it(planted, tmp_path, name, pythonpath):
    args, code = COMMANDS[name]
    trap = tmp_path / "trap"
    # "empty-entry-first": PYTHONPATH=":REPO" puts '' (the working folder) on sys.path as well
    path = str(REPO) if pythonpath == "repo" else f":{REPO}"
    p = subprocess.run([sys.executable, "-m", "kvtool", *args], cwd=planted, env=_env(trap, path),
                       capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    err = p.stderr.decode("utf-8", "replace")
    assert [n for n in _ran(trap) if n.removeprefix("trap-") not in _before_kvtool(path)] == [], err
    if pythonpath == "repo":
        assert _ran(trap) == [] and p.returncode == code, err
        assert "Traceback" not in err


def _before_kvtool(pythonpath: str) -> set[str]:
    """Modules the interpreter itself loads before any of kvtool runs (site, .pth files) with this PYTHONPATH,
    found in a clean folder: with '' on PYTHONPATH those come from the working folder before kvtool can act
    (docs/safety.md says so); everything imported later must not."""
    if pythonpath not in _STARTUP:
        clean = Path(os.environ.get("TMPDIR", "/tmp"))
        env = {**os.environ, "PYTHONPATH": pythonpath}
        out = subprocess.run([sys.executable, "-c", "import sys; print(' '.join(sys.modules))"], cwd=clean,
                             env=env, capture_output=True, timeout=60, check=True).stdout.decode().split()
        _STARTUP[pythonpath] = set(out) if pythonpath.startswith(":") else set()
    return _STARTUP[pythonpath]


_STARTUP: dict[str, set[str]] = {}


def test_the_console_script_inside_a_model_folder_imports_nothing_from_it(tmp_path):
    """The `kvtool` script pip writes (`import re, sys; from kvtool.cli import ...`), with '' on sys.path through
    PYTHONPATH: what the interpreter and the script import before kvtool runs is theirs; nothing after."""
    m = llama(tmp_path / "m")
    _plant(m)
    early = _before_kvtool(f":{REPO}") | {"re", "sys"}
    for name in early & set(PLANTED):
        for f in (m / f"{name}.py", m / name / "__init__.py"):
            f.unlink(missing_ok=True)
    script = tmp_path / "bin" / "kvtool"
    script.parent.mkdir()
    script.write_text("import re\nimport sys\nfrom kvtool.cli import _entry\nif __name__ == '__main__':\n"
                      "    sys.exit(_entry())\n")
    trap = tmp_path / "trap"
    for args in (["lint", "."], ["convert", ".", "--to", "mqa", "--dry-run"], ["rules"]):
        p = subprocess.run([sys.executable, str(script), *args], cwd=m, env=_env(trap, f":{REPO}"),
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
        assert _ran(trap) == [], p.stderr.decode()
        assert p.returncode == 0, p.stderr.decode()


@pytest.mark.parametrize("pythonpath", ["repo", "empty-entry-first"])
def test_lint_names_the_installed_releases_not_the_planted_ones(tmp_path, pythonpath):
    m = llama(tmp_path / "m")
    _plant(m)
    for f in m.iterdir():  # the metadata alone: a planted module the interpreter loads at start-up is not kvtool's
        if f.name.endswith(".py") or (f / "__init__.py").exists():
            (f.unlink() if f.is_file() else __import__("shutil").rmtree(f))
    trap = tmp_path / "trap"
    path = str(REPO) if pythonpath == "repo" else f":{REPO}"
    for args in (["lint", "."], ["lint", ".", "--format", "json"]):
        p = subprocess.run([sys.executable, "-m", "kvtool", *args], cwd=m, env=_env(trap, path),
                           capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
        out = p.stdout.decode()
        assert p.returncode == 0 and "99.0.0" not in out, out + p.stderr.decode()
        assert metadata.version("transformers") in out, out


def test_the_installed_release_reader_skips_the_working_folder(planted, monkeypatch):
    """The library path too (a program that imports kvtool with '' on sys.path): relative entries are skipped."""
    from kvtool.engines import installed

    real = metadata.version("transformers")
    monkeypatch.chdir(planted)
    monkeypatch.setattr(sys, "path", ["", ".", *sys.path])
    installed._LISTED.clear()
    assert metadata.version("transformers") == "99.0.0"  # what a reader of sys.path as it is would say
    assert installed.version("transformers") == real
    assert installed.version("vllm") != "99.0.0"
