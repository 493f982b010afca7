"""Class 1 of issue 31: kvtool never writes through a link the checkpoint (or anyone) planted.

Generated over the names kvtool writes x where a link can stand (in SRC for --in-place, in DST's
folder, in a DST being replaced, in SRC under the names of kvtool's own outputs) x what it points to
(a file outside, a name outside that does not exist yet, a folder outside). Whatever the command does
(write elsewhere, or refuse in one line), nothing outside changes, every planted link still points
where it did, and nothing kvtool wrote is a link.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.hostile import models
from tests.hostile.harness import Result, run_kvtool, tree_digest

ROPE_RECIPE = "version: 1\nname: t\nsteps:\n  - rope: {type: yarn, factor: 2}\n"
LINT_RECIPE = "version: 1\nname: t\nsteps:\n  - lint: {}\n"
TARGETS = ("file", "missing", "folder")
# every file name kvtool writes into an output folder (kvtool.io.outputfile's callers)
OUTPUT_NAMES = ("config.json", "kvtool.json", "model.safetensors", "model.safetensors.index.json",
                "model-kv-scales.safetensors", "kvtool-report.json", "kvtool-report.md", "tokenizer.json",
                "generation_config.json", "README.md", ".kvtool-staging.json")


@pytest.fixture
def ws(tmp_path):
    """src (a tiny llama with side files), outside (what links point at), recipes."""
    src = models.llama(tmp_path / "src")
    (src / "tokenizer.json").write_text('{"model": {}}\n')
    out = tmp_path / "outside"
    (out / "folder").mkdir(parents=True)
    (out / "file").write_text("the user's file\n")
    (tmp_path / "rope.yaml").write_text(ROPE_RECIPE)
    (tmp_path / "lint.yaml").write_text(LINT_RECIPE)
    return tmp_path


def _plant(link: Path, ws: Path, target: str) -> Path:
    dest = ws / "outside" / target
    link.symlink_to(dest)
    return dest


def _links(root: Path) -> dict[str, str]:
    return {str(p): os.readlink(p) for p in root.rglob("*") if p.is_symlink()}


def _run(args: list, ws: Path, *, allow: tuple[int, ...] = (0, 2), progress: bool = False,
         replaced: Path | None = None) -> Result:
    """Run; assert the contract that holds whether kvtool writes elsewhere or refuses. Links inside
    `replaced` (a DST given with --force) go with the folder they are in."""
    outside = tree_digest(ws / "outside")
    links = {k: v for k, v in _links(ws).items() if replaced is None or not k.startswith(f"{replaced}/")}
    r = run_kvtool(args, timeout=180)
    what = f"kvtool {' '.join(map(str, args))}\nrc={r.rc}\n{r.stderr}"
    assert r.rc in allow and "Traceback" not in r.stderr + r.stdout, what
    if r.rc == 2:
        errors = [ln for ln in r.lines if ln.startswith("kvtool: error")]
        assert len(errors) == 1 and (progress or len(r.lines) == 1) and "internal error" not in errors[0], what
    assert tree_digest(ws / "outside") == outside, f"a file outside was written\n{what}"
    assert {k: v for k, v in _links(ws).items() if k in links} == links, f"a planted link was changed\n{what}"
    new_links = set(_links(ws)) - set(links)
    assert not new_links, f"kvtool made links {new_links}\n{what}"
    return r


BACKUPS = ("config.json.bak", "config.json.bak.1", "config.json.bak.2")


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("planted", BACKUPS)
def test_rope_in_place_backup_never_follows_a_planted_link(ws, planted, target):
    src = ws / "src"
    original = (src / "config.json").read_bytes()
    for earlier in BACKUPS[:BACKUPS.index(planted)]:  # the planted name is the one kvtool would pick next
        (src / earlier).write_text("an earlier backup\n")
    _plant(src / planted, ws, target)
    before = set(os.listdir(src))
    r = _run(["rope", src, "--in-place", "--type", "linear", "--factor", "2"], ws, allow=(0,))
    new = set(os.listdir(src)) - before
    assert len(new) == 1, (new, r.stdout)  # the backup, and no temporary file left
    backup = src / new.pop()
    assert not backup.is_symlink() and backup.read_bytes() == original
    assert backup.name in r.stdout
    assert json.loads((src / "config.json").read_text())["rope_scaling"]["factor"] == 2


@pytest.mark.parametrize("where", ["inside", "outside"])
def test_rope_in_place_never_edits_a_config_json_that_is_a_link(ws, where):
    src = ws / "src"
    real = (src / "real") if where == "inside" else (ws / "outside")
    real.mkdir(exist_ok=True)
    os.replace(src / "config.json", real / "config.json")
    (src / "config.json").symlink_to(real / "config.json")
    before = tree_digest(real)
    r = _run(["rope", src, "--in-place", "--type", "linear", "--factor", "2"], ws, allow=(2,))
    assert "config.json" in r.lines[-1]
    assert tree_digest(real) == before
    assert not [p for p in os.listdir(src) if ".bak" in p or "kvtool-tmp" in p]


def _write_cmd(cmd: str, ws: Path, dst: Path, *, force: bool) -> list:
    src = ws / "src"
    f = ["--force"] if force else []
    return {
        "rope": ["rope", src, dst, "--type", "linear", "--factor", "2"],
        "convert": ["convert", src, dst, "--to", "mqa", "--no-eval", *f],
        "apply-rope": ["apply", ws / "rope.yaml", src, dst, "--device", "cpu", *f],
        "apply-lint-only": ["apply", ws / "lint.yaml", src, dst, "--device", "cpu", *f],
    }[cmd]


WRITERS = ["rope", "convert", "apply-rope", "apply-lint-only"]


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cmd", [c for c in WRITERS if c != "rope"])  # rope has no --force
def test_a_destination_full_of_planted_links_is_replaced_not_written_through(ws, cmd, target):
    dst = ws / "out"
    dst.mkdir()
    for name in OUTPUT_NAMES:
        _plant(dst / name, ws, target)
    _run(_write_cmd(cmd, ws, dst, force=True), ws, allow=(0,), progress=cmd.startswith("apply"), replaced=dst)
    assert not _links(dst) and (dst / "config.json").is_file()


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cmd", WRITERS)
def test_links_in_src_named_like_kvtools_outputs_are_never_written_through(ws, cmd, target):
    src = ws / "src"
    for name in ("kvtool.json", "model-kv-scales.safetensors", "kvtool-report.json", "kvtool-report.md",
                 ".kvtool-staging.json"):
        _plant(src / name, ws, target)
    dst = ws / "out"
    r = _run(_write_cmd(cmd, ws, dst, force=False), ws, progress=cmd.startswith("apply"))
    if r.rc == 0:
        assert not _links(dst)
    else:  # refused: a link out of the folder is not read, a *.safetensors one is a weight file
        assert not dst.exists() and str(src) in r.lines[-1], r.lines


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cmd", WRITERS)
def test_a_destination_that_is_a_planted_link_is_never_written_through(ws, cmd, target):
    dst = ws / "out"
    _plant(dst, ws, target)
    r = _run(_write_cmd(cmd, ws, dst, force=False), ws, allow=(2,), progress=cmd.startswith("apply"))
    assert str(dst) in r.lines[-1]


@pytest.mark.parametrize("target", TARGETS)
def test_a_failed_gate_report_never_follows_a_planted_link(ws, target):
    bad = models.llama(ws / "bad", {**models.LLAMA, "num_key_value_heads": 3})  # KV102: lint fails
    _plant(ws / "out.kvtool-failed.json", ws, target)
    r = _run(["apply", ws / "lint.yaml", bad, ws / "out"], ws, allow=(1,), progress=True)
    report = ws / "out.kvtool-failed.1.json"
    assert str(report) in r.lines[-1] and not report.is_symlink()
    assert json.loads(report.read_text())["passed"] is False


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("cmd", ["rope", "kv-budget"])
def test_a_plot_file_that_is_a_planted_link_is_refused(ws, cmd, target):
    pytest.importorskip("matplotlib")
    plot = ws / "plot.png"
    _plant(plot, ws, target)
    args = (["rope", ws / "src", "--show", "--plot", plot] if cmd == "rope"
            else ["kv-budget", ws / "src", "--plot", plot])
    r = _run(args, ws, allow=(2,))
    assert str(plot) in r.lines[-1] and "symlink" in r.lines[-1]
    assert [p.name for p in ws.iterdir() if "kvtool-tmp" in p.name] == []


@pytest.fixture(scope="module")
def runnable(tmp_path_factory, request):
    """A tiny llama transformers can run (quantize-kv calibrates it)."""
    smollm2 = request.getfixturevalue("smollm2_path")
    return models.llama_with_tokenizer(tmp_path_factory.mktemp("runnable") / "src", smollm2)


@pytest.mark.slow
def test_quantize_kv_never_writes_through_planted_links(ws, runnable, calib_text_file):
    """quantize-kv's own outputs (scale shard, index, config, kvtool.json) into a DST full of links, and
    links in SRC named like them."""
    import shutil

    shutil.rmtree(ws / "src")
    shutil.copytree(runnable, ws / "src")
    dst = ws / "out"
    dst.mkdir()
    for name in OUTPUT_NAMES:
        _plant(dst / name, ws, "file")
    args = ["quantize-kv", ws / "src", dst, "--calib-text", calib_text_file, "--calib-tokens", "64", "--seq-len", "32",
            "--device", "cpu", "--no-eval", "--force"]
    _run(args, ws, allow=(0,), replaced=dst)
    assert not _links(dst) and (dst / "model-kv-scales.safetensors").is_file()
    # dangling links in SRC named like its outputs: refused (every JSON file of a folder transformers loads
    # gets the file check, kvtool.io.model_files) or ignored, never written through
    for name in ("kvtool.json", "kvtool-report.json", ".kvtool-staging.json"):
        _plant(ws / "src" / name, ws, "missing")
    _run(args, ws, allow=(0, 2), replaced=dst)
    assert not _links(dst)
