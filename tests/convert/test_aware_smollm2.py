"""Real model: SmolLM2-135M to MQA (3 KV heads -> 1), calibrated merge against mean pooling, held-out text."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.cli import main  # noqa: E402

pytestmark = pytest.mark.slow


def test_smollm2_mqa_aware_beats_mean_pooling_by_far(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    from kvtool.eval.api import evaluate_many

    aware, mean = tmp_path / "aware", tmp_path / "mean"
    common = ["--to", "mqa", "--no-eval", "--no-progress"]
    assert main(["convert", str(smollm2_path), str(aware), *common, "--method", "aware", "--calib-tokens", "1024",
                 "--calib-dataset", "pydoc"]) == 0  # 4 sequences: all from the evaluation text's source
    assert main(["convert", str(smollm2_path), str(mean), *common]) == 0
    _, info = AutoModelForCausalLM.from_pretrained(aware, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    details = json.loads((aware / "kvtool.json").read_text())["method_details"]
    assert details["calib_tokens"] == 1024 and details["calib_text"].startswith("builtin:")
    # evaluation text is disjoint from the calibration text (kvtool.testing.text)
    r_aware, r_mean = evaluate_many([str(aware), str(mean)], baseline=str(smollm2_path), max_tokens=512, max_length=512,
                                    device="cpu")
    print(f"\nSmolLM2-135M MQA, 512 held-out tokens: original {r_aware.baseline_ppl:.2f}, mean pooling "
          f"{r_mean.ppl:.1f} (KLD {r_mean.kld_mean:.2f}), aware {r_aware.ppl:.2f} (KLD {r_aware.kld_mean:.2f}, "
          f"top-1 {r_aware.top1_agreement:.2f})")
    assert r_aware.ppl < r_mean.ppl / 20
    assert r_aware.ppl < 10 * r_aware.baseline_ppl  # the training-free goal
    assert r_aware.kld_mean < r_mean.kld_mean / 2
