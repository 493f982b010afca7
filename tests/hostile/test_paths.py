"""Paths: kvtool never writes into its input and reads only the folders it was given.

DST inside SRC (or SRC itself, or a folder holding SRC, or any of these through a symlink) is
refused by every command that writes, before any work and even with --force; symlink loops and
folders given where a file is expected are one-line errors; a side file that is a symlink out of
the model folder is never read into the output.
"""

from __future__ import annotations

import os

import pytest

from tests.hostile import models
from tests.hostile.harness import check_refusal, run_kvtool, tree_digest

RECIPE = "version: 1\nname: t\nsteps:\n  - rope: {type: yarn, factor: 2}\n"
LINT_ONLY = "version: 1\nname: t\nsteps:\n  - lint: {}\n"


@pytest.fixture
def ws(tmp_path):
    """A workspace: src (tiny llama), calib text and recipes outside it, an alias symlink to src."""
    src = models.llama(tmp_path / "src")
    (src / "sub").mkdir()
    (tmp_path / "calib.txt").write_text("text " * 400)
    (tmp_path / "recipe.yaml").write_text(RECIPE)
    (tmp_path / "lint.yaml").write_text(LINT_ONLY)
    (tmp_path / "alias").symlink_to(src)
    return tmp_path


def _write_args(cmd: str, src, dst, ws) -> list:
    return {
        "convert": ["convert", src, dst, "--to", "mqa", "--force"],
        "rope": ["rope", src, dst, "--type", "linear", "--factor", "2"],
        "quantize-kv": ["quantize-kv", src, dst, "--calib-text", ws / "calib.txt", "--device", "cpu", "--no-eval",
                        "--force"],
        "apply": ["apply", ws / "recipe.yaml", src, dst, "--force"],
    }[cmd]


WRITERS = ["convert", "rope", "quantize-kv", "apply"]
# (SRC as given, DST as given) relative to the workspace
PLACES = {
    "child": ("src", "src/out"),
    "grandchild": ("src", "src/sub/out"),
    "same": ("src", "src"),
    "parent_of_src": ("src", "."),
    "symlink_into_src": ("src", "alias/out"),
    "src_via_symlink": ("alias", "src/out"),
}


@pytest.mark.parametrize("place", list(PLACES))
@pytest.mark.parametrize("cmd", WRITERS)
def test_destination_in_or_above_source_is_refused(ws, cmd, place):
    s, d = PLACES[place]
    src, dst = ws / s, ws / d
    r = check_refusal(_write_args(cmd, src, dst, ws), sources=[ws / "src"], exit_code=2, names=[str(dst)])
    assert "source" in r.lines[-1] or "input checkpoint" in r.lines[-1], r.lines
    assert sorted(p.name for p in (ws / "src").iterdir()) == ["README.md", "config.json", "generation_config.json",
                                                             "model.safetensors", "sub"]
    assert list((ws / "src" / "sub").iterdir()) == []


LOOP_CMDS = {
    "lint": lambda m, ws: ["lint", m],
    "kv-budget": lambda m, ws: ["kv-budget", m],
    "convert": lambda m, ws: ["convert", m, ws / "out", "--to", "mqa"],
    "rope": lambda m, ws: ["rope", m, ws / "out", "--type", "linear", "--factor", "2"],
    "quantize-kv": lambda m, ws: ["quantize-kv", m, ws / "out", "--calib-text", ws / "calib.txt", "--no-eval"],
    "eval": lambda m, ws: ["eval", m, "--device", "cpu"],
    "apply": lambda m, ws: ["apply", ws / "recipe.yaml", m, ws / "out"],
}


def _refused(args, sources, dst, names):
    """check_refusal, except for lint, whose report (stdout) carries a folder's error as one line."""
    if args[0] != "lint":
        return check_refusal(args, sources=sources, dst=dst, names=names)
    before = tree_digest(*sources)
    r = run_kvtool(args)
    lines = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
    assert r.rc == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.rc, r.stdout, r.stderr)
    assert all(n in lines[0] for n in names) and tree_digest(*sources) == before
    r.lines = lines
    return r


@pytest.mark.parametrize("cmd", list(LOOP_CMDS))
def test_model_folder_that_is_a_symlink_loop(ws, cmd):
    loop = ws / "loop"
    loop.symlink_to(loop)
    _refused(LOOP_CMDS[cmd](loop, ws), [ws / "src"], ws / "out", [str(loop)])


@pytest.mark.parametrize("cmd", list(LOOP_CMDS))
def test_config_json_that_is_a_symlink_loop(ws, cmd):
    m = ws / "m"
    m.mkdir()
    (m / "config.json").symlink_to(m / "config.json")
    os.link(ws / "src" / "model.safetensors", m / "model.safetensors")
    r = _refused(LOOP_CMDS[cmd](m, ws), [ws / "src", m], ws / "out", [str(m)])
    assert "symlink loop" in r.lines[-1] or "config.json" in r.lines[-1], r.lines


FILE_OPTIONS = {
    "quantize-kv --calib-text": lambda d, ws: ["quantize-kv", ws / "src", ws / "out", "--calib-text", d, "--no-eval"],
    "convert --calib-text": lambda d, ws: ["convert", ws / "src", ws / "out", "--to", "mqa", "--method", "aware",
                                           "--calib-text", d],
    "eval --text": lambda d, ws: ["eval", ws / "src", "--text", d, "--device", "cpu"],
    "apply RECIPE": lambda d, ws: ["apply", d, ws / "src", ws / "out"],
    "rope --short-factor-file": lambda d, ws: ["rope", ws / "src", ws / "out", "--type", "longrope", "--factor", "2",
                                               "--short-factor-file", d, "--long-factor-file", d],
    "lint --config": lambda d, ws: ["lint", ws / "src", "--config", d],
}


@pytest.mark.parametrize("option", list(FILE_OPTIONS))
def test_folder_given_where_a_file_is_expected(ws, option):
    d = ws / "a_folder"
    d.mkdir()
    r = check_refusal(FILE_OPTIONS[option](d, ws), sources=[ws / "src", d], dst=ws / "out", names=[str(d)])
    assert "folder" in r.lines[-1] or "directory" in r.lines[-1], r.lines


@pytest.mark.parametrize("cmd", ["rope", "apply"])
def test_side_file_symlinked_out_of_the_model_folder_is_not_read(ws, cmd):
    secret = ws / "secret.txt"
    secret.write_text("API_TOKEN=hunter2\n")
    (ws / "src" / "tokenizer.json").symlink_to(secret)
    args = (["rope", ws / "src", ws / "out", "--type", "linear", "--factor", "2"] if cmd == "rope"
            else ["apply", ws / "lint.yaml", ws / "src", ws / "out"])
    r = check_refusal(args, sources=[ws / "src", secret], dst=ws / "out", names=["tokenizer.json"],
                      allow_progress=cmd == "apply")
    assert "outside the model folder" in r.lines[-1]
    assert "hunter2" not in r.stdout + r.stderr


def test_lone_config_json_source_protects_the_file_not_its_neighbours(ws):
    """For `rope CONFIG.json DST`, the input is the file: a DST folder beside it is fine, one holding it is not."""
    cfg_dir = ws / "cfg"
    cfg_dir.mkdir()
    (cfg_dir / "config.json").write_bytes((ws / "src" / "config.json").read_bytes())
    check_refusal(["rope", cfg_dir / "config.json", cfg_dir, "--type", "linear", "--factor", "2"],
                  sources=[cfg_dir], names=[str(cfg_dir)])
    r = run_kvtool(["rope", cfg_dir / "config.json", cfg_dir / "out", "--type", "linear", "--factor", "2"])
    assert r.rc == 0, r.stderr
    assert (cfg_dir / "out" / "config.json").is_file()
