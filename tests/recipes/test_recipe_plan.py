"""Recipe planning: impossible steps are refused before any work, naming the recipe line."""

from __future__ import annotations

import numpy as np
import pytest

from kvtest import write_config, write_safetensors
from kvtool.errors import UsageError
from kvtool.recipes.load import load_recipe
from kvtool.recipes.plan import plan_recipe


@pytest.fixture
def model_dir(tmp_path, tiny_llama_config):
    d = tmp_path / "model"
    write_config(d, tiny_llama_config)
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32)})
    return d


def _recipe(tmp_path, steps: str):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n" + steps)
    return load_recipe(p)


def test_plan_describes_each_step(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n  - lint: {}\n")
    plan = plan_recipe(r, tiny_llama_config, has_weights=True)
    assert plan[0].startswith("mqa: 2 -> 1 KV heads")
    assert plan[1] == "lint"


def test_groups_not_dividing_heads_is_refused_with_line(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - lint: {}\n  - convert: {to: gqa, groups: 3}\n")
    with pytest.raises(UsageError) as exc:
        plan_recipe(r, tiny_llama_config, has_weights=True)
    msg = exc.value.line()
    assert "line 4" in msg and "cannot convert to 3 KV heads" in msg and "valid choices: 1, 2, 4" in msg


def test_second_convert_sees_the_first(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n  - convert: {to: mha}\n")
    plan = plan_recipe(r, tiny_llama_config, has_weights=True)
    assert plan[0].startswith("mqa: 2 -> 1 KV heads")
    assert plan[1].startswith("mha: 1 -> 4 KV heads")


def test_aware_needs_calibration_text_that_exists(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa, method: aware, calibration: {text: calib.txt}}\n")
    with pytest.raises(UsageError, match="calib.txt' not found"):
        plan_recipe(r, tiny_llama_config, has_weights=True)
    (tmp_path / "calib.txt").write_text("hello")
    assert plan_recipe(r, tiny_llama_config, has_weights=True)


def test_convert_of_unconvertible_architecture_is_refused(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n")
    with pytest.raises(UsageError, match="cannot be converted"):
        plan_recipe(r, cfg, has_weights=True)


def test_eval_without_text_is_refused(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - eval: {max_tokens: 10}\n")
    with pytest.raises(UsageError, match="needs `text`"):
        plan_recipe(r, tiny_llama_config, has_weights=True)


def test_config_only_source_cannot_be_converted(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n")
    with pytest.raises(UsageError, match="no safetensors weights"):
        plan_recipe(r, tiny_llama_config, has_weights=False)
