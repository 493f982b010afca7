"""Lint on real pretrained checkpoints (SmolLM2-135M, Gemma-3-270M): clean weight checks, and a
hand-edited KV-head count caught from the real safetensors headers."""

from __future__ import annotations

import json

import pytest

from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("which", ["smollm2_path", "gemma3_path"])
def test_real_checkpoints_have_no_weight_or_config_errors(which, request) -> None:
    folder = request.getfixturevalue(which)
    report = lint_one(str(folder), LintOptions())
    assert report.error is None
    assert not [f for f in report.findings if f.severity == "error"], [f.message for f in report.findings]
    assert report.kv and report.kv["bytes_per_token"] > 0


def test_edited_kv_heads_on_real_weights(smollm2_path, tmp_path) -> None:
    cfg = json.loads((smollm2_path / "config.json").read_text())
    assert cfg["num_key_value_heads"] == 3
    cfg["num_key_value_heads"] = 1  # an "MQA conversion" by editing config.json only
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for f in smollm2_path.glob("*.safetensors"):
        (tmp_path / f.name).symlink_to(f)
    found = [f for f in lint_one(str(tmp_path), LintOptions()).findings if f.code == "KV601"]
    hd = cfg["hidden_size"] // cfg["num_attention_heads"]
    assert {f.path for f in found} == {"model.layers.0.self_attn.k_proj.weight", "model.layers.0.self_attn.v_proj.weight"}
    assert f"[{3 * hd}, {cfg['hidden_size']}]" in found[0].message and f"and {cfg['num_hidden_layers'] - 1} more" in found[0].message
    tp = [f.code for f in lint_one(str(smollm2_path), LintOptions(tensor_parallel_size=2)).findings]
    assert "KV103" in tp and "KV104" in tp  # 9 query heads, 3 KV heads: TP 2 cannot start in vLLM
