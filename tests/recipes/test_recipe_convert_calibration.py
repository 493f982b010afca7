"""A recipe's convert step asks its target (kvtool/convert/targets.py) whether it calibrates: `to: mla` with
`calibration.text` is checked before any work exactly as `to: mqa, method: aware` is (issue 40: a missing file
passed `apply --dry-run` with exit 0), its text resolves relative to the recipe's folder, not the working folder,
and the report says what was done (not `method: mean`, `kv_heads: 2->1`)."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main

SMOL_LIKE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
             "vocab_size": 128, "max_position_embeddings": 256, "rope_theta": 10000.0, "tie_word_embeddings": False,
             "hidden_act": "silu", "torch_dtype": "float32"}
MLA = "to: mla, kv_rank: 24, rope_dim: 8, mla_solve: joint"
AWARE = "to: mqa, method: aware"


@pytest.fixture
def src(tmp_path):
    import numpy as np

    from kvtest import write_checkpoint

    write_checkpoint(tmp_path / "src", SMOL_LIKE, dtype="float32", extra={
        "model.embed_tokens.weight": np.zeros((128, 64), np.float32),
        "lm_head.weight": np.zeros((128, 64), np.float32), "model.norm.weight": np.ones((64,), np.float32)})
    return tmp_path / "src"


def _dry_run(capsys, tmp_path, src, step: str) -> tuple[int, str]:
    folder = tmp_path / "recipes"
    folder.mkdir(exist_ok=True)
    recipe = folder / "r.yaml"
    recipe.write_text(f"version: 1\nname: t\nsteps:\n  - convert: {{{step}}}\n")
    rc = main(["apply", str(recipe), str(src), str(tmp_path / "out"), "--dry-run"])
    cap = capsys.readouterr()
    return rc, cap.out + cap.err


@pytest.mark.parametrize("step", [MLA, AWARE])
def test_a_missing_calibration_file_is_refused_by_the_dry_run(tmp_path, src, capsys, step):
    rc, text = _dry_run(capsys, tmp_path, src, step + ", calibration: {text: calib.txt}")
    assert rc == 2, text
    assert "text file 'calib.txt' " in text and str(tmp_path / "recipes" / "calib.txt") in text


@pytest.mark.parametrize("step", [MLA, AWARE])
def test_a_calibration_file_outside_the_recipe_folder_is_refused(tmp_path, src, capsys, step):
    (tmp_path / "secret.txt").write_text("not the recipe's\n")
    rc, text = _dry_run(capsys, tmp_path, src, step + ", calibration: {text: ../secret.txt}")
    assert rc == 2 and "leads outside the recipe's folder" in text, text


@pytest.mark.parametrize("step", [MLA, AWARE])
def test_a_dataset_that_needs_the_network_is_refused(tmp_path, src, capsys, step):
    rc, text = _dry_run(capsys, tmp_path, src, step + ", calibration: {dataset: wikitext2}")
    assert rc == 2 and "dataset 'wikitext2' is not available offline in recipes" in text, text


def test_mla_without_calibration_plans_on_the_built_in_mix_and_aware_is_owed_text(tmp_path, src, capsys):
    rc, text = _dry_run(capsys, tmp_path, src, MLA)
    assert rc == 0 and "convert: mla: 2 KV heads -> MLA latent 24 + rope 8" in text, text
    rc, text = _dry_run(capsys, tmp_path, src, AWARE)
    assert rc == 2 and "needs calibration text" in text, text


def test_mla_with_the_recipe_s_text_plans(tmp_path, src, capsys):
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "calib.txt").write_text("some calibration text\n")
    rc, text = _dry_run(capsys, tmp_path, src, MLA + ", calibration: {text: calib.txt}")
    assert rc == 0, text


@pytest.mark.torch
def test_the_run_reads_the_text_beside_the_recipe_and_reports_mla(smollm2_path, tmp_path, monkeypatch):
    """Run from another working folder (with no calib.txt in it): the stand-in solve of tests/convert/mla (the
    maths is tested on its own) calibrates on the recipe folder's file, and the report names the latent."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parents[1] / "convert" / "mla"))
    try:
        from mla_helpers import install_fake_solve, tiny_llama
    finally:
        sys.path.pop(0)
    install_fake_solve(monkeypatch)
    model = tiny_llama(tmp_path / "src", smollm2_path)
    folder = tmp_path / "recipes"
    folder.mkdir()
    (folder / "calib.txt").write_text("The recipe's own calibration text, read from beside the recipe. " * 40)
    recipe = folder / "r.yaml"
    recipe.write_text("version: 1\nname: t\nsteps:\n  - convert: {to: mla, kv_rank: 24, rope_dim: 8, "
                      "calibration: {text: calib.txt, tokens: 64, seq_len: 32}}\n")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    dst = tmp_path / "out"
    assert main(["apply", str(recipe), str(model), str(dst), "--no-progress"]) == 0
    prov = json.loads((dst / "kvtool.json").read_text())
    assert prov["to"] == "mla" and str(folder / "calib.txt") in prov["solve"]["calib_text"]
    step = json.loads((dst / "kvtool-report.json").read_text())["steps"][0]
    assert step["details"]["kv_heads"] == "2->mla" and step["details"]["method"] == "mqa-seed solve"
    assert step["details"]["mla"] == {"kv_lora_rank": 24, "qk_rope_head_dim": 8}
