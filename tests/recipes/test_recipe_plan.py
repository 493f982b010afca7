"""Recipe planning: impossible steps are refused before any work, naming the recipe line."""

from __future__ import annotations

import numpy as np
import pytest

from kvtest import write_checkpoint, write_config, write_safetensors
from kvtool.cli import main
from kvtool.errors import UsageError
from kvtool.model.preflight import preflight
from kvtool.recipes.load import load_recipe
from kvtool.recipes.plan import plan_recipe


@pytest.fixture
def model_dir(tmp_path, tiny_llama_config):
    d = tmp_path / "model"
    write_config(d, tiny_llama_config)
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32)})
    return d


def _source(tmp_path, config: dict, *, weights: bool = True):
    """The checkpoint `kvtool apply` plans from (its preflight), with the attention weights convert needs."""
    d = tmp_path / "src"
    if weights:
        write_checkpoint(d, config)
    else:
        write_config(d, config)
    return preflight(d, require_weights=False)


def _recipe(tmp_path, steps: str):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n" + steps)
    return load_recipe(p)


def test_plan_describes_each_step(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n  - lint: {}\n")
    plan = plan_recipe(r, _source(tmp_path, tiny_llama_config))
    assert plan[0].startswith("mqa: 2 -> 1 KV heads")
    assert plan[1] == "lint"


def test_groups_not_dividing_heads_is_refused_with_line(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - lint: {}\n  - convert: {to: gqa, groups: 3}\n")
    with pytest.raises(UsageError) as exc:
        plan_recipe(r, _source(tmp_path, tiny_llama_config))
    msg = exc.value.line()
    assert "line 4" in msg and "cannot convert to 3 KV heads" in msg and "valid choices: 1, 2, 4" in msg


def test_second_convert_sees_the_first(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n  - convert: {to: mha}\n")
    plan = plan_recipe(r, _source(tmp_path, tiny_llama_config))
    assert plan[0].startswith("mqa: 2 -> 1 KV heads")
    assert plan[1].startswith("mha: 1 -> 4 KV heads")


def test_aware_needs_calibration_text_that_exists(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa, method: aware, calibration: {text: calib.txt}}\n")
    with pytest.raises(UsageError, match="calib.txt' not found"):
        plan_recipe(r, _source(tmp_path, tiny_llama_config))
    (tmp_path / "calib.txt").write_text("hello")
    assert plan_recipe(r, _source(tmp_path, tiny_llama_config))


def test_convert_of_unconvertible_architecture_is_refused(tmp_path):
    cfg = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8}
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n")
    with pytest.raises(UsageError, match="cannot be converted"):
        plan_recipe(r, _source(tmp_path, cfg))


def test_eval_without_text_is_refused(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - eval: {max_tokens: 10}\n")
    with pytest.raises(UsageError, match="needs `text`"):
        plan_recipe(r, _source(tmp_path, tiny_llama_config))


def test_config_only_source_cannot_be_converted(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n")
    with pytest.raises(UsageError, match="no safetensors weights"):
        plan_recipe(r, _source(tmp_path, tiny_llama_config, weights=False))


def test_quantized_checkpoint_is_refused_as_convert_refuses_it(tmp_path, tiny_llama_config, capsys):
    """`kvtool apply --dry-run` accepted a quantized checkpoint that `kvtool convert` then refused (issue 15)."""
    cfg = {**tiny_llama_config, "quantization_config": {"quant_method": "fp8"}}
    src = write_checkpoint(tmp_path / "q", cfg)
    assert main(["convert", str(src), "--to", "mqa", "--dry-run"]) == 2
    command = capsys.readouterr().err
    assert "quantization_config: quantized checkpoint" in command
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nsteps:\n  - convert: {to: mqa}\n")
    assert main(["apply", str(r), str(src), str(tmp_path / "out"), "--dry-run"]) == 2
    recipe = capsys.readouterr().err
    assert (f"line 3: step 1 (convert): {src / 'config.json'}: quantization_config: quantized checkpoint: pool the "
            "unquantized weights, then quantize") in recipe


def test_groups_with_mqa_is_refused_as_convert_refuses_it(tmp_path, tiny_llama_config, capsys):
    """The recipe dropped `groups` for --to mqa, where the command refuses the contradiction."""
    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    assert main(["convert", str(src), "--to", "mqa", "--groups", "2", "--dry-run"]) == 2
    assert "--groups: --to mqa means one KV head" in capsys.readouterr().err
    r = _recipe(tmp_path, "  - convert: {to: mqa, groups: 2}\n")
    with pytest.raises(UsageError, match="--to mqa means one KV head") as exc:
        plan_recipe(r, preflight(src))
    assert exc.value.cause.option == "groups" and exc.value.field == "steps[0].convert.groups"


def test_missing_attention_weights_are_refused_at_plan_time(tmp_path, tiny_llama_config):
    """A folder without the attention tensors convert pools: the command refuses it, so the recipe does too."""
    d = tmp_path / "e"
    write_config(d, tiny_llama_config)
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32)})
    r = _recipe(tmp_path, "  - rope: {type: yarn, factor: 2}\n  - convert: {to: mqa}\n")
    with pytest.raises(UsageError, match=r"step 2 \(convert\): .*model\.safetensors: model\.layers\.0\.self_attn"
                                         r"\.q_proj\.weight: missing: the llama table expects this tensor") as exc:
        plan_recipe(r, preflight(d))
    assert exc.value.cause.field == "model.layers.0.self_attn.q_proj.weight"


def test_second_convert_plans_from_the_first_ones_tensors(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - convert: {to: mqa, dtype: bf16}\n  - convert: {to: gqa, groups: 2}\n")
    assert plan_recipe(r, _source(tmp_path, tiny_llama_config))[1].startswith("gqa: 1 -> 2 KV heads")


def test_calibration_dataset_not_offline_is_refused_before_any_work(tmp_path, tiny_llama_config):
    r = _recipe(tmp_path, "  - quantize-kv: {calibration: {dataset: wikitext2}}\n")
    with pytest.raises(UsageError, match="dataset 'wikitext2' is not available offline in recipes"):
        plan_recipe(r, _source(tmp_path, tiny_llama_config))


@pytest.mark.parametrize("step, refused", [
    ("convert: {to: mqa, method: aware, calibration: {dataset: mixed}}", False),  # a built-in mix: offline
    ("convert: {to: mqa, method: aware, calibration: {dataset: pydoc+self}}", True),  # needs the model written text
    ("quantize-kv: {calibration: {dataset: mixed}}", True),  # quantize-kv calibrates on pydoc or files
])
def test_offline_calibration_datasets_depend_on_the_step(tmp_path, tiny_llama_config, step, refused):
    r = _recipe(tmp_path, f"  - {step}\n")
    if refused:
        with pytest.raises(UsageError, match="is not available offline in recipes"):
            plan_recipe(r, _source(tmp_path, tiny_llama_config))
    else:
        assert "2 -> 1 KV heads" in plan_recipe(r, _source(tmp_path, tiny_llama_config))[0]


def test_quantize_kv_refusals_are_the_commands(tmp_path, tiny_llama_config):
    """A source already carrying KV scales: quantize-kv's own check refuses it in the plan (no torch)."""
    d = tmp_path / "s"
    write_checkpoint(d, tiny_llama_config, extra={"model.layers.0.self_attn.k_scale": np.ones((1,), np.float32)})
    r = _recipe(tmp_path, "  - quantize-kv: {calibration: {dataset: pydoc}}\n")
    with pytest.raises(UsageError, match="already carries KV-cache scales") as exc:
        plan_recipe(r, preflight(d))
    assert exc.value.cause.field == "model.layers.0.self_attn.k_scale"


def test_rope_result_that_lint_would_fail_is_refused_in_the_plan(tmp_path, tiny_llama_config, capsys):
    """The command lints its own result; the recipe's plan makes the same check (it used to run only at run time)."""
    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    assert main(["rope", str(src), "--type", "llama3", "--factor", "8", "--low-freq-factor", "4",
                 "--high-freq-factor", "1", "--show"]) == 2
    command = capsys.readouterr().err
    assert "refused: the result would fail `kvtool lint` with KV208" in command
    r = _recipe(tmp_path, "  - rope: {type: llama3, factor: 8, low_freq_factor: 4, high_freq_factor: 1}\n")
    with pytest.raises(UsageError) as got:
        plan_recipe(r, preflight(src))
    assert got.value.cause.line() in command


def test_eval_threshold_the_command_refuses_is_refused_at_plan_time(tmp_path, tiny_llama_config, capsys):
    """A percentage that overflows to infinity: `kvtool eval` refuses the flag before loading anything, and the
    recipe's plan refuses the threshold (it used to fail only when the eval step ran, after the other steps)."""
    huge = "9" * 400 + "%"
    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    assert main(["eval", str(src), "--baseline", str(src), "--max-ppl-increase", huge]) == 2
    command = capsys.readouterr().err
    assert "--max-ppl-increase: " in command and "is not a finite number >= 0" in command
    r = _recipe(tmp_path, f"  - eval: {{dataset: pydoc, thresholds: {{max_ppl_increase: '{huge}'}}}}\n")
    with pytest.raises(UsageError) as got:
        plan_recipe(r, preflight(src))
    assert got.value.field == "steps[0].eval.thresholds.max_ppl_increase"
    assert got.value.cause.message in command


def test_lint_code_matching_no_rule_is_refused_as_lint_refuses_it(tmp_path, tiny_llama_config, capsys):
    """`kvtool lint --select KV999` refuses the typo; a recipe's lint step silently checked nothing."""
    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    assert main(["lint", str(src), "--select", "KV999"]) == 2
    assert "'KV999' matches no rule code" in capsys.readouterr().err
    r = _recipe(tmp_path, "  - lint: {ignore: [KV1, KV999]}\n")
    with pytest.raises(UsageError, match="'KV999' matches no rule code") as got:
        plan_recipe(r, preflight(src))
    assert got.value.field == "steps[0].lint.ignore"
