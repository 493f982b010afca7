"""The shipped SmolLM2 recipe end to end (MQA aware + FP8 KV + lint + eval gate), offline, on CPU."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main
from kvtool.recipes.load import load_recipe

pytestmark = pytest.mark.slow

REPO_RECIPE = "recipes/smollm2-135m-mqa-fp8.yaml"


def test_smollm2_recipe_end_to_end(tmp_path, smollm2_path, capsys):
    from kvtest import REPO

    recipe = REPO / REPO_RECIPE
    dst = tmp_path / "smollm2-mqa-fp8"
    assert main(["apply", str(recipe), str(smollm2_path), str(dst)]) == 0, capsys.readouterr().err
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 1
    assert cfg["quantization_config"]["kv_cache_scheme"]["type"] == "float"
    report = json.loads((dst / "kvtool-report.json").read_text())
    assert report["passed"] is True
    assert [s["kind"] for s in report["steps"]] == [s.kind for s in load_recipe(recipe).steps]
    assert set(report) >= {"recipe", "source", "versions", "started", "finished", "plan", "steps"}
    metrics = report["steps"][-1]["details"]["metrics"]
    assert metrics["tokens"] >= 1000 and metrics["kv_cache_dtype"] == "fp8_e4m3"
    assert metrics["baseline_ppl"] < metrics["ppl"]  # MQA + FP8 costs something, and the gate says how much
    md = (dst / "kvtool-report.md").read_text()
    assert "**eval**" in md and "| ppl_ratio |" in md
    assert main(["lint", str(dst)]) == 0


def test_too_tight_gate_exits_1_and_leaves_no_dst(tmp_path, smollm2_path, capsys):
    # FP8 KV emulation changes the logits a little; a zero-KLD gate must fail on that
    r = tmp_path / "tight.yaml"
    r.write_text("version: 1\nsteps:\n  - eval:\n      dataset: pydoc\n      max_tokens: 256\n      max_length: 128\n"
                 "      kv_cache_dtype: fp8\n      thresholds: {max_kld: 0.0}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(smollm2_path), str(dst)]) == 1
    err = capsys.readouterr().err
    assert "step 1 (eval) failed" in err and "kld_mean" in err
    assert not dst.exists()
    failed = json.loads((tmp_path / "out.kvtool-failed.json").read_text())
    assert failed["steps"][0]["details"]["metrics"]["kld_mean"] > 0


def test_a_convert_step_calibrates_on_the_mixed_dataset_as_the_command_does(tmp_path, smollm2_path, capsys):
    r = tmp_path / "mixed.yaml"
    r.write_text("version: 1\nsteps:\n  - convert:\n      to: mqa\n      method: aware\n"
                 "      calibration: {dataset: mixed, tokens: 768}\n")
    assert main(["apply", str(r), str(smollm2_path), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert main(["convert", str(smollm2_path), str(tmp_path / "cli"), "--to", "mqa", "--method", "aware",
                 "--calib-tokens", "768", "--no-eval", "--no-progress"]) == 0  # the default dataset is the mix
    details = [json.loads((tmp_path / d / "kvtool.json").read_text())["method_details"] for d in ("out", "cli")]
    for d in details:
        assert d["calib_text"].split(" + ")[1:] == ["builtin:The Devil's Dictionary (Ambrose Bierce, 1911; sample)",
                                                    "builtin:The Jargon File 4.4.7 (sample)"]
    assert details[0]["calib_ids_sha256"] == details[1]["calib_ids_sha256"]  # the same tokens
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == (tmp_path / "cli" / "model.safetensors").read_bytes()
