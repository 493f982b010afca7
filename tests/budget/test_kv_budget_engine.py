"""kv-budget --engine vllm==X: the default sequence is the max_model_len that release derives (yarn changed at 0.30)."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main

YARN = {"model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "torch_dtype": "bfloat16",
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


@pytest.mark.parametrize("engine,tokens", [("vllm==0.28.0", 131072), ("vllm==0.29.0", 131072),
                                           ("vllm==0.30.0", 32768), ("vllm==0.33.0", 32768)])
def test_default_length_follows_the_release(tmp_path, capsys, engine: str, tokens: int) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["kv-budget", str(tmp_path / "config.json"), "--engine", engine, "--format", "json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    text = json.dumps(doc)
    assert f'"max_model_len": {tokens}' in text and engine.split("==")[1] in text


def test_without_engine_the_config_length_stays(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["kv-budget", str(tmp_path / "config.json"), "--format", "json"]) == 0
    assert '"max_model_len": 32768' in capsys.readouterr().out


def test_a_range_is_refused_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["kv-budget", str(tmp_path / "config.json"), "--engine", "vllm>=0.28"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtool: error: --engine") and "give one" in err
