"""`kvtool apply`: runs steps in order, reports, gates, and never leaves a DST that looks valid on failure."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtest import write_checkpoint, write_config
from kvtool.cli import main


@pytest.fixture
def tiny_model(tmp_path, tiny_llama_config):
    d = tmp_path / "src"
    # the attention weights too: a recipe's convert plan refuses what `kvtool convert` refuses
    write_checkpoint(d, tiny_llama_config, dtype="float32", extra={
        "model.embed_tokens.weight": np.zeros((128, 64), np.float32),
        "lm_head.weight": np.zeros((128, 64), np.float32),
    })
    return d


def _recipe(tmp_path, body: str):
    p = tmp_path / "recipe.yaml"
    p.write_text("version: 1\nname: t\nsteps:\n" + body)
    return p


def _snapshot(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_rope_and_lint_recipe_writes_dst_and_report(tmp_path, tiny_model, capsys):
    before = _snapshot(tiny_model)
    r = _recipe(tmp_path, "  - rope: {type: yarn, factor: 4}\n  - lint: {strict: true}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(tiny_model), str(dst)]) == 0
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["rope_scaling"]["rope_type"] == "yarn" and cfg["rope_scaling"]["factor"] == 4
    assert cfg["max_position_embeddings"] == 1024  # yarn: original 256 x 4
    report = json.loads((dst / "kvtool-report.json").read_text())
    assert report["passed"] is True
    assert [s["kind"] for s in report["steps"]] == ["rope", "lint"]
    assert all(s["seconds"] >= 0 for s in report["steps"])
    assert report["versions"]["kvtool"]
    assert report["steps"][1]["details"]["counts"]["error"] == 0
    md = (dst / "kvtool-report.md").read_text()
    assert "| 1 | rope |" in md and "**lint**" in md
    assert (dst / "model.safetensors").read_bytes() == before["model.safetensors"]
    assert _snapshot(tiny_model) == before  # the input is never modified
    assert not list(tmp_path.glob(".out.kvtool-work-*"))


def test_dry_run_does_no_work(tmp_path, tiny_model, capsys):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n  - lint: {}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(tiny_model), str(dst), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "1. convert: mqa: 2 -> 1 KV heads (mean)" in out
    assert not dst.exists()


def test_impossible_step_refused_before_any_work(tmp_path, tiny_model, capsys):
    r = _recipe(tmp_path, "  - rope: {type: yarn, factor: 2}\n  - convert: {to: gqa, groups: 3}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(tiny_model), str(dst)]) == 2
    err = capsys.readouterr().err
    assert "line 5" in err and "cannot convert to 3 KV heads" in err
    assert not dst.exists()
    assert not list(tmp_path.glob(".out.kvtool-*"))


def test_failing_lint_gate_exits_1_and_leaves_no_dst(tmp_path, tiny_model, tiny_llama_config, capsys):
    write_config(tiny_model, {**tiny_llama_config, "num_key_value_heads": 3})  # KV102: 4 heads, 3 KV heads
    r = _recipe(tmp_path, "  - lint: {}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(tiny_model), str(dst)]) == 1
    assert "step 1 (lint) failed" in capsys.readouterr().err
    assert not dst.exists()
    failed = json.loads((tmp_path / "out.kvtool-failed.json").read_text())
    assert failed["passed"] is False
    assert any(f["code"] == "KV102" for f in failed["steps"][0]["details"]["findings"])


def test_lint_step_applies_per_file_ignores_like_kvtool_lint(tmp_path, tiny_model, tiny_llama_config, capsys,
                                                              monkeypatch):
    """[tool.kvtool.per-file-ignores] live in the lint engine, so a recipe's lint step honours them too."""
    write_config(tiny_model, {**tiny_llama_config, "rope_scaling": {"rope_type": "gptj"}})  # KV201: an error
    monkeypatch.chdir(tmp_path)  # the nearest pyproject.toml is the one written below (or none)
    r = _recipe(tmp_path, "  - lint: {strict: true}\n")
    assert main(["apply", str(r), "src", "out1"]) == 1
    assert main(["lint", "src"]) == 1
    (tmp_path / "pyproject.toml").write_text("[tool.kvtool.per-file-ignores]\n\"src\" = [\"KV201\"]\n")
    assert main(["lint", "src"]) == 0
    assert main(["apply", str(r), "src", "out2"]) == 0
    report = json.loads((tmp_path / "out2" / "kvtool-report.json").read_text())
    assert not any(f["code"] == "KV201" for f in report["steps"][0]["details"]["findings"])


def test_the_final_output_passes_the_last_writing_step_s_own_check_again(tmp_path):
    """The final check re-runs the check the last writing step published under (its source, its releases) on the
    output as moved into DST: an error that step's source lacks is refused there too, never waved through as
    'already in the final model' (the final model's own errors once counted as known)."""
    from functools import partial

    from kvtest import DATA
    from kvtool.errors import InputError
    from kvtool.recipes.apply import RunContext, _finish
    from kvtool.rules.output_check import verify_output

    mla = json.loads((DATA / "budget" / "deepseek-v2-lite.json").read_text())
    write_config(tmp_path / "src", mla)
    write_config(tmp_path / "work" / "step1", {**mla, "qk_rope_head_dim": 63})  # KV402/KV404: not in its source
    report = {"recipe": {"name": "t"}, "source": "src", "passed": True, "started": "-", "versions": {}, "steps": []}
    ctx = RunContext(recipe=None, src=tmp_path / "src", current=tmp_path / "work" / "step1", work=tmp_path / "work",
                     check=partial(verify_output, source=tmp_path / "src"))
    with pytest.raises(InputError, match="kvtool's own checks refuse the output"):
        _finish(ctx, tmp_path / "dst", report, force=False)
    assert not (tmp_path / "dst").exists()
    # the step's check accepted what it was asked to (convert --to mla --engine transformers: KV404): so does DST's
    write_config(tmp_path / "work" / "step1", {**mla, "kv_lora_rank": 500})  # 500 + 64: a row no vLLM serves
    ctx.check = partial(verify_output, source=tmp_path / "src", engines=("transformers",), accept=("KV404",))
    _finish(ctx, tmp_path / "dst", report, force=False)
    assert json.loads((tmp_path / "dst" / "config.json").read_text())["kv_lora_rank"] == 500
