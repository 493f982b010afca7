"""Class 3 of issue 31: a source that changes after validation never gives exit 0 and a corrupt output.

Generated over every command that copies sources x every way a file can change x the moment it changes
(tests/hostile/racing.py: right after its header was validated, or once kvtool has opened it to copy).
Each run must end as harness.check_refusal says (exit 2, one line naming the file, no DST, no staging
folder left), and every other source file must be as it was.
"""

from __future__ import annotations

import pytest

from tests.hostile import models, racing
from tests.hostile.harness import check_refusal, tree_digest

ROPE_RECIPE = "version: 1\nname: t\nsteps:\n  - rope: {type: yarn, factor: 2}\n"
LINT_RECIPE = "version: 1\nname: t\nsteps:\n  - lint: {}\n"
SHARD = "model.safetensors"


def _args(cmd: str, src, dst, tmp, calib) -> list:
    (tmp / "rope.yaml").write_text(ROPE_RECIPE)
    (tmp / "lint.yaml").write_text(LINT_RECIPE)
    return {
        "rope": ["rope", src, dst, "--type", "linear", "--factor", "2"],
        "convert": ["convert", src, dst, "--to", "mqa", "--no-eval"],
        "apply-rope": ["apply", tmp / "rope.yaml", src, dst, "--device", "cpu"],
        "apply-lint-only": ["apply", tmp / "lint.yaml", src, dst, "--device", "cpu"],
        "quantize-kv": ["quantize-kv", src, dst, "--calib-text", calib, "--calib-tokens", "64", "--seq-len", "32",
                        "--device", "cpu", "--no-eval"],
    }[cmd]


def _race(cmd, src, tmp_path, calib, when, change, nth=1):
    dst = tmp_path / "out"
    others = {p: d for p, d in tree_digest(src).items() if not p.endswith(SHARD)}
    r = check_refusal(_args(cmd, src, dst, tmp_path, calib), sources=[], dst=dst, names=[SHARD],
                      env=racing.env(file=SHARD, when=when, change=change, nth=nth),
                      allow_progress=cmd.startswith("apply"), timeout=180)
    assert {p: d for p, d in tree_digest(src).items() if not p.endswith(SHARD)} == others
    assert "internal error" not in r.stderr
    return r


@pytest.mark.parametrize("change", racing.CHANGES)
@pytest.mark.parametrize("when", racing.WHEN)
@pytest.mark.parametrize("cmd", ["rope", "convert", "apply-rope", "apply-lint-only"])
def test_a_shard_that_changes_after_validation_is_never_published(tmp_path, calib_text_file, cmd, when, change):
    src = models.llama(tmp_path / "src")
    (src / "tokenizer.json").write_text('{"model": {}}\n')
    _race(cmd, src, tmp_path, calib_text_file, when, change)


@pytest.fixture(scope="module")
def runnable(tmp_path_factory, request):
    """A tiny llama transformers can run (quantize-kv calibrates it)."""
    smollm2 = request.getfixturevalue("smollm2_path")
    return models.llama_with_tokenizer(tmp_path_factory.mktemp("runnable") / "src", smollm2)


# quantize-kv validates the shard four times before its copy: the command's front check, the plan, the
# layer-by-layer loader, the writer. A change after the first is then checked by the plan, and the run
# uses that file throughout; a change after the plan's check (2nd) or the writer's (4th) must be refused.
QUANTIZE_RACES = [("validated", 2, "replace"), ("validated", 4, "truncate"), ("opened", 1, "truncate"),
                  ("opened", 1, "replace")]


@pytest.mark.slow
@pytest.mark.parametrize("when,nth,change", QUANTIZE_RACES)
def test_quantize_kv_never_publishes_a_shard_that_changed(tmp_path, runnable, calib_text_file, when, nth, change):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(runnable, src)
    _race("quantize-kv", src, tmp_path, calib_text_file, when, change, nth)


def test_the_seam_changes_the_file_it_is_told_to(tmp_path):
    """The race is real: the same command without kvtool's checks would have published a changed shard."""
    src = models.llama(tmp_path / "src")
    before = (src / SHARD).read_bytes()
    for change in racing.CHANGES:
        p = tmp_path / change
        p.write_bytes(before)
        ino = p.stat().st_ino
        racing.mutate(p, change)
        after = p.read_bytes()
        assert after != before
        assert (len(after) == len(before)) == (change in ("rewrite", "replace"))
        assert (p.stat().st_ino == ino) == (change != "replace")


@pytest.mark.parametrize("change", racing.CHANGES)
def test_rope_in_place_never_edits_a_config_json_that_changed_after_it_was_read(tmp_path, change):
    """The edit was planned on one config.json; a different one (changed once kvtool opened it for the
    backup) is neither edited nor backed up."""
    src = models.llama(tmp_path / "src")
    r = check_refusal(["rope", src, "--in-place", "--type", "linear", "--factor", "2"], sources=[],
                      names=["config.json"], env=racing.env(file="config.json", when="opened", change=change))
    assert "after kvtool checked it" in r.lines[0]
    assert sorted(p.name for p in src.iterdir()) == ["README.md", "config.json", "generation_config.json", SHARD]
    assert "rope_scaling" not in (src / "config.json").read_text(errors="replace")
