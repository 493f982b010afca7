"""Unbounded input: alias bombs, FIFOs, devices, huge sparse files and deep nesting are refused quickly.

Every refusal is one line naming the file, exit 2 (lint of a recipe reports KV961, exit 1), within
seconds, with nothing written and nothing changed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"
RECIPE = REPO / "recipes" / "llama-3.1-8b-fp8-kv.yaml"
QUICK_S = 15.0


def _bomb(levels: int = 9) -> str:
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]")
    return "version: 1\n" + "\n".join(lines) + "\nsteps:\n  - lint: {strict: false}\n"


YAML_BOMBS = {
    "billion-laughs": _bomb(),
    "self-alias": "version: 1\nx: &a [*a]\nsteps: []\n",
    "many-aliases": "version: 1\na: &a 1\nb: [" + ", ".join(["*a"] * 500) + "]\nsteps: []\n",
    "deep-nesting": "version: 1\nx: " + "[" * 5000 + "]" * 5000 + "\nsteps: []\n",
    "deep-mapping": "version: 1\nx: " + "{a: " * 200 + "1" + "}" * 200 + "\nsteps: []\n",
}


@pytest.fixture
def model(tmp_path) -> Path:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    return m


@pytest.mark.parametrize("name", sorted(YAML_BOMBS))
def test_yaml_bomb_apply(tmp_path, model, name) -> None:
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(YAML_BOMBS[name])
    r = check_refusal(["apply", recipe, model, tmp_path / "out"], sources=[model, recipe], dst=tmp_path / "out",
                      names=[str(recipe)])
    assert r.seconds < QUICK_S


@pytest.mark.parametrize("name", sorted(YAML_BOMBS))
def test_yaml_bomb_lint(tmp_path, name) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(YAML_BOMBS[name])
    r = run_kvtool(["lint", recipe], timeout=QUICK_S * 2)
    assert r.rc == 1 and "KV961" in r.stdout and "internal error" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert r.seconds < QUICK_S


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _sparse(path: Path) -> Path:
    with path.open("wb") as fh:
        fh.truncate(1 << 30)  # 1 GiB that takes no disk: its size alone must refuse it
    return path


SPECIALS = {
    "fifo": lambda p: _fifo(p),
    "dev-zero": lambda p: p.symlink_to("/dev/zero") or p,
    "folder": lambda p: p.mkdir() or p,
    "sparse-1GB": _sparse,
}
KIND_WORDS = {"fifo": "FIFO", "dev-zero": "character device", "folder": "folder", "sparse-1GB": "byte limit"}


@pytest.mark.parametrize("kind", sorted(SPECIALS))
@pytest.mark.parametrize("command", ["lint", "kv-budget", "rope", "convert"])
def test_config_json_not_a_regular_file(tmp_path, kind, command) -> None:
    m = tmp_path / "m"
    m.mkdir()
    cfg = SPECIALS[kind](m / "config.json")
    args = {"lint": ["lint", m], "kv-budget": ["kv-budget", m], "rope": ["rope", m, "--show"],
            "convert": ["convert", m, "--dry-run", "--to", "mqa"]}[command]
    r = check_refusal(args, sources=[m], names=[str(cfg), KIND_WORDS[kind]], timeout=QUICK_S * 2)
    assert r.seconds < QUICK_S


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_text_option_not_a_regular_file(tmp_path, model, kind) -> None:
    text = SPECIALS[kind](tmp_path / "text.txt")
    r = check_refusal(["eval", model, "--text", text, "--device", "cpu"], sources=[model],
                      names=[str(text), "--text", KIND_WORDS[kind]], timeout=QUICK_S * 4)
    assert r.seconds < QUICK_S * 2


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_calib_text_not_a_regular_file(tmp_path, model, kind) -> None:
    text = SPECIALS[kind](tmp_path / "calib.txt")
    out = tmp_path / "out"
    check_refusal(["convert", model, out, "--to", "mqa", "--method", "aware", "--no-eval", "--calib-text", text],
                  sources=[model], dst=out, names=[str(text), "--calib-text", KIND_WORDS[kind]],
                  timeout=QUICK_S * 8)


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_recipe_not_a_regular_file(tmp_path, model, kind) -> None:
    recipe = SPECIALS[kind](tmp_path / "recipe.yaml")
    out = tmp_path / "out"
    r = check_refusal(["apply", recipe, model, out], sources=[model], dst=out, names=[str(recipe), KIND_WORDS[kind]])
    assert r.seconds < QUICK_S


def test_tokenizer_json_fifo_is_skipped_not_read(model) -> None:
    """Side files are optional: a FIFO tokenizer.json must not block lint."""
    (model / "tokenizer.json").unlink()
    _fifo(model / "tokenizer.json")
    r = run_kvtool(["lint", model], timeout=QUICK_S * 2)
    assert r.rc in (0, 1) and r.seconds < QUICK_S, r.stdout + r.stderr


@pytest.mark.parametrize("depth", [65, 5000, 100_000])
def test_deeply_nested_json(model, depth) -> None:
    cfg = model / "config.json"
    text = cfg.read_text().rstrip().rstrip("}") + ', "x": ' + "[" * depth + "]" * depth + "}"
    cfg.write_text(text)
    r = check_refusal(["kv-budget", model], sources=[model], names=[str(cfg), "nested more than 64"])
    assert r.seconds < QUICK_S


def test_pyproject_fifo_in_cwd_is_skipped(tmp_path, model) -> None:
    """[tool.kvtool] comes from the nearest pyproject.toml file: a FIFO there is not one, and never waited on."""
    import subprocess
    import sys

    proj = tmp_path / "proj"
    proj.mkdir()
    _fifo(proj / "pyproject.toml")
    p = subprocess.run([sys.executable, "-m", "kvtool", "lint", str(model)], cwd=proj, capture_output=True,
                       text=True, timeout=QUICK_S * 2, stdin=subprocess.DEVNULL)
    assert p.returncode == 0, p.stderr


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "folder"])
def test_lint_config_option_not_a_regular_file(tmp_path, model, kind) -> None:
    cfg = SPECIALS[kind](tmp_path / "pyproject.toml")
    check_refusal(["lint", model, "--config", cfg], sources=[model], names=[str(cfg), "--config", KIND_WORDS[kind]])
