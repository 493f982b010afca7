"""kvtool.budget.run: kv-budget's plan (options checked, checkpoint opened) and apply (the budget)."""

from __future__ import annotations

import json

import pytest

from kvtest import write_checkpoint
from kvtool.errors import KvtoolError
from kvtool.options.kv_budget import KvBudgetOptions
from kvtool.budget.run import apply, plan


@pytest.mark.parametrize(("kw", "option", "message"), [
    ({"format": "xml"}, "format", "must be one of text, json, got 'xml'"),
    ({"kv_cache_dtype": "int3"}, "kv_cache_dtype", "must be one of auto, "),
    ({"batch": 0}, "batch", "must be at least 1, got 0"),
    ({"gpu_memory_utilization": 1.5}, "gpu_memory_utilization", "must be at most 1, got 1.5"),
    ({"reserve": "2GiB"}, "gpu_memory", "--reserve and --gpu-memory-utilization need --gpu-memory"),
])
def test_options_are_refused_before_the_checkpoint_is_read(kw, option, message, tmp_path):
    with pytest.raises(KvtoolError) as got:  # the options object refuses a declared bound when it is made
        plan(KvBudgetOptions(model=str(tmp_path / "missing"), **kw))  # the missing model is never reached
    assert got.value.option == option and message in got.value.message


def test_plan_then_apply_is_the_commands_budget(tmp_path, tiny_llama_config, capsys):
    from kvtool.budget.report import render_json
    from kvtool.cli import main

    src = write_checkpoint(tmp_path / "m", tiny_llama_config)
    p = plan(KvBudgetOptions(model=str(src), max_model_len=4096, batch=3, kv_cache_dtype="fp8"))
    assert p.options.batch == 3 and p.options.batch_given and p.spec.num_kv_heads == tiny_llama_config.get(
        "num_key_value_heads", tiny_llama_config["num_attention_heads"])
    b = apply(p)
    assert b.current.kv_bytes_per_token > 0
    rc = main(["kv-budget", str(src), "--max-model-len", "4096", "--batch", "3", "--kv-cache-dtype", "fp8",
               "--format", "json"])
    assert rc == (1 if b.problems else 0)
    assert json.loads(capsys.readouterr().out) == json.loads(render_json(b))
