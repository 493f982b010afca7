"""Messages that named the wrong thing: an option the command lacks, "not found" for what exists,
kvtool's temporary folders instead of the user's DST; and choices apply used to accept silently."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, run_kvtool

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"
RECIPE = REPO / "recipes" / "llama-3.1-8b-fp8-kv.yaml"


@pytest.fixture
def model(tmp_path) -> Path:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    return m


def test_rope_non_empty_dst_names_no_force(tmp_path, model) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    r = check_refusal(["rope", model, dst, "--type", "linear", "--factor", "2"], sources=[model, dst],
                      names=[str(dst), "not empty", "--in-place"])
    assert "--force" not in r.stderr  # rope has no --force
    assert (dst / "keep.txt").read_text() == "mine"


def test_rope_dst_is_src_still_says_so(model) -> None:
    check_refusal(["rope", model, model, "--type", "linear", "--factor", "2"], sources=[model],
                  names=["destination is the input checkpoint"])


@pytest.mark.parametrize("command", ["convert", "quantize-kv"])
def test_commands_with_force_still_name_it(tmp_path, model, command) -> None:
    dst = tmp_path / "dst"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    args = {"convert": ["convert", model, dst, "--to", "mqa", "--no-eval"],
            "quantize-kv": ["quantize-kv", model, dst, "--device", "cpu", "--calib-text", TINY / "config.json"]}[command]
    check_refusal(args, sources=[model, dst], names=[str(dst), "--force"])


def _recipe_with_text(tmp_path: Path, text: str) -> Path:
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"version: 1\nsteps:\n  - eval: {{text: {text}, thresholds: {{max_kld: 0.5}}}}\n")
    return recipe


@pytest.mark.parametrize("kind,word", [("folder", "is a folder, not a file"), ("fifo", "is a FIFO"),
                                       ("missing", "not found")])
def test_recipe_text_file_described(tmp_path, model, kind, word) -> None:
    target = tmp_path / "texts"
    if kind == "folder":
        target.mkdir()
    elif kind == "fifo":
        os.mkfifo(target)
    recipe = _recipe_with_text(tmp_path, "texts")
    out = tmp_path / "out"
    check_refusal(["apply", recipe, model, out, "--dry-run"], sources=[model, recipe], dst=out,
                  names=[str(recipe), "'texts'", word])
    r = run_kvtool(["lint", recipe])
    assert r.rc == 1 and "KV962" in r.stdout and word in r.stdout, r.stdout


def test_recipe_that_is_a_folder_is_not_reported_missing(tmp_path, model) -> None:
    recipe = tmp_path / "recipe.yaml"
    recipe.mkdir()
    r = check_refusal(["apply", recipe, model, tmp_path / "out"], sources=[model], names=[str(recipe), "folder"])
    assert "no such" not in r.stderr


def test_config_json_folder_is_not_reported_missing(tmp_path) -> None:
    m = tmp_path / "m"
    (m / "config.json").mkdir(parents=True)
    r = check_refusal(["kv-budget", m], sources=[m], names=[str(m / "config.json"), "folder"])
    assert "no config.json" not in r.stderr


def test_apply_errors_name_dst_not_the_work_folder(tmp_path, model, monkeypatch, capsys) -> None:
    # A step that fails while writing into apply's hidden work folder (the planner refuses bad options
    # earlier, so the failure is injected): the line names DST, never the work folder.
    from kvtool.cli import main
    from kvtool.errors import InputError
    from kvtool.recipes import apply as recipe_apply

    def failing_rope(ctx, step):
        raise InputError("cannot write", file=str(ctx.new_folder(step) / "config.json"), field="rope_parameters")

    monkeypatch.setitem(recipe_apply.RUNNERS, "rope", failing_rope)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("version: 1\nsteps:\n  - convert: {to: mqa}\n  - rope: {type: yarn, factor: 4}\n")
    out = tmp_path / "out"
    assert main(["apply", str(recipe), str(model), str(out)]) == 2
    err = capsys.readouterr().err
    assert f"kvtool: error: {out}/config.json: rope_parameters: cannot write" in err, err
    assert ".kvtool-work" not in err and ".kvtool-tmp" not in err
    assert not out.exists()


@pytest.mark.parametrize("option,value,choices", [
    ("--format", "xml", "text, json"), ("--format", "", "text, json"),
    ("--device", "tpu", "auto, cpu, cuda, cuda:N"), ("--device", "cuda:x", "auto, cpu, cuda, cuda:N"),
])
def test_apply_refuses_unknown_choices(tmp_path, model, option, value, choices) -> None:
    out = tmp_path / "out"
    r = check_refusal(["apply", RECIPE, model, out, option, value], sources=[model], dst=out,
                      names=[option, choices, repr(value)])
    assert r.seconds < 10


@pytest.mark.parametrize("device", ["cpu", "cuda:0", "auto"])
def test_apply_accepts_valid_devices(tmp_path, model, device) -> None:
    r = run_kvtool(["apply", RECIPE, model, tmp_path / "out", "--device", device, "--dry-run", "--format", "json"])
    assert r.rc == 0, r.stderr
