"""rope --show --engine vllm==X: the served context as that release derives it; DST says who reads it as written."""

from __future__ import annotations

import json

from kvtool.cli import main

YARN = {"model_type": "qwen2", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 32768,
        "rope_theta": 1e6, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def test_show_follows_the_release(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["rope", str(tmp_path), "--show", "--engine", "vllm==0.28.0"]) == 0
    old = capsys.readouterr().out
    assert "vllm 0.28.0" in old and "vLLM serves 131072" in old
    assert main(["rope", str(tmp_path), "--show", "--engine", "vllm==0.33.0"]) == 0
    assert "vLLM serves 131072" not in capsys.readouterr().out


def test_written_config_names_the_releases_that_read_it(tmp_path, capsys) -> None:
    cfg = {**YARN, "rope_scaling": None}
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "config.json").write_text(json.dumps(cfg))
    assert main(["rope", str(tmp_path / "src"), str(tmp_path / "dst"), "--type", "llama3", "--factor", "8"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if "read as written by:" in x)
    assert "transformers 4.45-5.25" in line and "vllm 0.5-0.33" in line
