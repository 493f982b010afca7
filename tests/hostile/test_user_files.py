"""The user's files: outputs never share an inode with the source, and kvtool never deletes or
overwrites what it did not create (DST.intermediate, DST.kvtool-failed.json, unmarked staging).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hostile import models
from tests.hostile.harness import check_refusal, run_kvtool, tree_digest

TIME_BOUND_S = 180.0
ROPE_RECIPE = "version: 1\nname: t\nsteps:\n  - rope: {type: yarn, factor: 2}\n"
LINT_RECIPE = "version: 1\nname: t\nsteps:\n  - lint: {}\n"


@pytest.fixture(scope="module")
def runnable(tmp_path_factory, request):
    """A tiny llama transformers can run (quantize-kv calibrates it), with generation_config.json."""
    smollm2 = request.getfixturevalue("smollm2_path")
    return models.llama_with_tokenizer(tmp_path_factory.mktemp("runnable") / "src", smollm2)


def _inodes(folder: Path) -> dict[tuple[int, int], str]:
    out = {}
    for p in folder.rglob("*"):
        if p.is_file():
            st = p.stat()
            out[(st.st_dev, st.st_ino)] = str(p)
    return out


def _command(cmd: str, src: Path, dst: Path, tmp: Path, calib: Path) -> list:
    (tmp / "rope.yaml").write_text(ROPE_RECIPE)
    (tmp / "lint.yaml").write_text(LINT_RECIPE)
    return {
        "rope": ["rope", src, dst, "--type", "linear", "--factor", "2"],
        "convert": ["convert", src, dst, "--to", "mqa", "--no-eval"],
        "quantize-kv": ["quantize-kv", src, dst, "--calib-text", calib, "--calib-tokens", "64", "--seq-len", "32",
                        "--device", "cpu", "--no-eval"],
        "apply-rope": ["apply", tmp / "rope.yaml", src, dst, "--device", "cpu"],
        "apply-lint-only": ["apply", tmp / "lint.yaml", src, dst, "--device", "cpu"],
    }[cmd]


# quantize-kv runs the model, so it needs a tokenizer: SmolLM2's (a real-model fixture, hence slow)
QUANTIZE = pytest.param("quantize-kv", marks=pytest.mark.slow)


def _source(cmd: str, request, tmp_path: Path) -> Path:
    if cmd == "quantize-kv":
        return request.getfixturevalue("runnable")
    src = models.llama(tmp_path / "src")
    (src / "tokenizer.json").write_text('{"model": {}}\n')
    return src


@pytest.mark.parametrize("cmd", ["rope", "convert", QUANTIZE, "apply-rope", "apply-lint-only"])
def test_outputs_share_no_inode_and_editing_them_leaves_the_source(request, tmp_path, calib_text_file, cmd):
    src = _source(cmd, request, tmp_path)
    before = tree_digest(src)
    dst = tmp_path / "out"
    r = run_kvtool(_command(cmd, src, dst, tmp_path, calib_text_file), timeout=TIME_BOUND_S)
    assert r.rc == 0, r.stderr
    shared = set(_inodes(src)) & set(_inodes(dst))
    assert not shared, f"outputs sharing an inode with the source: {[_inodes(dst)[k] for k in shared]}"
    # what the issue did: `echo '{}' > DST/generation_config.json` (truncate and write in place)
    for name in ("generation_config.json", "tokenizer.json"):
        with open(dst / name, "w") as fh:
            fh.write("{}\n")
    if (dst / "model.safetensors").is_file():
        with open(dst / "model.safetensors", "r+b") as fh:  # scribble on the weights in place
            fh.write(b"\0" * 16)
    assert tree_digest(src) == before


@pytest.mark.parametrize("cmd", ["rope", QUANTIZE])
def test_link_option_hard_links_the_unchanged_files_as_its_help_says(request, tmp_path, calib_text_file, cmd):
    src = _source(cmd, request, tmp_path)
    dst = tmp_path / "out"
    r = run_kvtool([*_command(cmd, src, dst, tmp_path, calib_text_file), "--link"], timeout=TIME_BOUND_S)
    assert r.rc == 0, r.stderr
    assert os.stat(dst / "model.safetensors").st_ino == os.stat(src / "model.safetensors").st_ino
    help_text = run_kvtool([cmd, "--help"]).stdout
    assert "editing either copy in place changes both" in " ".join(help_text.split())


@pytest.fixture
def tiny(tmp_path):
    src = models.llama(tmp_path / "src")
    (tmp_path / "rope.yaml").write_text(ROPE_RECIPE)
    (tmp_path / "lint.yaml").write_text(LINT_RECIPE)
    return src


def test_keep_intermediate_refuses_an_existing_intermediate_without_force(tiny, tmp_path):
    kept = tmp_path / "out.intermediate"
    kept.mkdir()
    (kept / "notes.txt").write_text("the user's own notes")
    r = check_refusal(["apply", tmp_path / "rope.yaml", tiny, tmp_path / "out", "--keep-intermediate"],
                      sources=[tiny, kept], dst=tmp_path / "out", names=[str(kept), "--force"], allow_progress=True)
    assert "exists" in r.lines[-1]


def test_keep_intermediate_replaces_it_with_force(tiny, tmp_path):
    kept = tmp_path / "out.intermediate"
    kept.mkdir()
    (kept / "notes.txt").write_text("old")
    r = run_kvtool(["apply", tmp_path / "rope.yaml", tiny, tmp_path / "out", "--keep-intermediate", "--force"])
    assert r.rc == 0, r.stderr
    assert not (kept / "notes.txt").exists() and (tmp_path / "out" / "config.json").is_file()
    assert not (kept / ".kvtool-staging.json").exists()  # kvtool's marker does not travel into what it keeps


def test_keep_intermediate_never_replaces_a_file(tiny, tmp_path):
    kept = tmp_path / "out.intermediate"
    kept.write_text("a file, not a folder")
    check_refusal(["apply", tmp_path / "rope.yaml", tiny, tmp_path / "out", "--keep-intermediate", "--force"],
                  sources=[tiny, kept], dst=tmp_path / "out", names=[str(kept)], allow_progress=True)


def _failing(tmp_path) -> Path:
    return models.llama(tmp_path / "bad", {**models.LLAMA, "num_key_value_heads": 3})  # KV102: 4 heads / 3


@pytest.mark.parametrize("existing", ["file", "symlink"])
def test_failed_report_never_overwrites_an_existing_one(tmp_path, existing):
    bad = _failing(tmp_path)
    (tmp_path / "lint.yaml").write_text(LINT_RECIPE)
    old = tmp_path / "out.kvtool-failed.json"
    target = tmp_path / "elsewhere.json"
    target.write_text('{"mine": true}\n')
    if existing == "file":
        old.write_text('{"earlier": "report"}\n')
    else:
        old.symlink_to(target)
    before = tree_digest(old, target)
    r = check_refusal(["apply", tmp_path / "lint.yaml", bad, tmp_path / "out"], sources=[bad], exit_code=1,
                      dst=tmp_path / "out", allow_progress=True)
    new = tmp_path / "out.kvtool-failed.1.json"
    assert str(new) in r.lines[-1], r.lines
    assert json.loads(new.read_text())["passed"] is False
    assert tree_digest(old, target) == before


def test_failed_reports_get_new_names_run_after_run(tmp_path):
    bad = _failing(tmp_path)
    (tmp_path / "lint.yaml").write_text(LINT_RECIPE)
    for n in range(3):
        r = run_kvtool(["apply", tmp_path / "lint.yaml", bad, tmp_path / "out"])
        assert r.rc == 1, r.stderr
    names = sorted(p.name for p in tmp_path.glob("out.kvtool-failed*.json"))
    assert names == ["out.kvtool-failed.1.json", "out.kvtool-failed.2.json", "out.kvtool-failed.json"]


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _leftover(parent: Path, name: str, pid: int, *, marker: bool) -> Path:
    import socket

    d = parent / f".{name}.kvtool-tmp-{pid}-0badc0de"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"\0" * (1 << 20))  # the half-written shard a SIGKILL left
    if marker:
        (d / ".kvtool-staging.json").write_text(json.dumps({"host": socket.gethostname(), "pid": pid}))
    return d


@pytest.mark.parametrize("cmd", ["rope", "convert", "apply"])
def test_next_run_removes_a_killed_runs_staging_and_says_so(tiny, tmp_path, cmd):
    left = _leftover(tmp_path, "out", _dead_pid(), marker=True)
    args = {"rope": ["rope", tiny, tmp_path / "out", "--type", "linear", "--factor", "2"],
            "convert": ["convert", tiny, tmp_path / "out", "--to", "mqa", "--no-eval"],
            "apply": ["apply", tmp_path / "rope.yaml", tiny, tmp_path / "out"]}[cmd]
    r = run_kvtool(args)
    assert r.rc == 0, r.stderr
    assert not left.exists()
    said = [ln for ln in r.lines if "staging folder" in ln]
    assert len(said) == 1 and left.name in said[0], r.stderr
    assert not [p for p in tmp_path.iterdir() if ".kvtool-" in p.name]


def test_unmarked_lookalike_is_left_alone_and_reported(tiny, tmp_path):
    left = _leftover(tmp_path, "out", _dead_pid(), marker=False)
    before = tree_digest(left)
    r = run_kvtool(["rope", tiny, tmp_path / "out", "--type", "linear", "--factor", "2"])
    assert r.rc == 0, r.stderr
    assert tree_digest(left) == before
    assert [ln for ln in r.lines if "left alone 1" in ln and str(left) in ln]
