"""`kvtool rope` and the RoPE rules where the engines' own behaviour decides (issue: agree with the engines).

Each case is one the oracle lane (tests/oracle) found kvtool getting wrong against transformers or vLLM.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtest import write_config

from kvtool.cli import main
from kvtool.rope.apply import lint_findings

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_attention_heads": 2,
         "num_key_value_heads": 1, "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096,
         "rope_theta": 10000.0, "torch_dtype": "bfloat16"}


def codes(cfg: dict) -> dict[str, str]:
    return {f.code: f.severity for f in lint_findings(cfg, "config.json")}


@pytest.mark.parametrize("rope_type", ["yarn", "linear", "dynamic", "llama3"])
@pytest.mark.parametrize("name", ["phi-3.5-mini-instruct", "phi-4"])
def test_rope_refuses_what_phi3config_refuses(tmp_path, capsys, name, rope_type):
    """Phi3Config accepts default / longrope only (it rewrites yarn to longrope, which then lacks its lists)."""
    src = tmp_path / "config.json"
    src.write_text((CONFIGS / f"{name}.json").read_text())
    rc = main(["rope", str(src), str(tmp_path / "out.json"), "--type", rope_type, "--factor", "2"])
    assert rc == 2 and not (tmp_path / "out.json").exists()
    assert "KV217" in capsys.readouterr().err


def test_yarn_without_factor_is_kv202_not_an_internal_error(tmp_path, capsys):
    cfg = {**LLAMA, "rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 2048}}
    found = codes(cfg)
    assert found.get("KV202") == "error" and "KV000" not in found
    folder = tmp_path / "m"
    write_config(folder, cfg)
    assert main(["rope", str(folder), "--show"]) == 0
    out = capsys.readouterr().out
    assert "vLLM refuses this RoPE dict" in out and "'factor'" in out and "vLLM serves" not in out


def test_partial_rotary_on_llama_reports_both_engines(tmp_path, capsys):
    plain = {**LLAMA, "partial_rotary_factor": 0.5}
    assert codes(plain).get("KV219") == "warning"
    yarn = {**plain, "max_position_embeddings": 16384,
            "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
    assert codes(yarn).get("KV218") == "error"
    folder = tmp_path / "m"
    write_config(folder, plain)
    assert main(["rope", str(folder), "--show"]) == 0
    assert "rotary dims 64," in capsys.readouterr().out  # head_dim 128 x 0.5: what vLLM rotates


def test_severities_where_transformers_only_warns():
    assert codes({**LLAMA, "rope_scaling": {"rope_type": "linear", "factor": 0.5}}).get("KV204") == "warning"
    assert codes({**LLAMA, "rope_scaling": {"rope_type": "ntk", "factor": 2.0}}).get("KV216") == "warning"
    assert codes({**LLAMA, "rope_scaling": {"rope_type": "su", "short_factor": [1.0] * 64, "long_factor": [1.0] * 64,
                                            "original_max_position_embeddings": 4096}}).get("KV216") == "warning"


def test_olmo3_rope_writes_nested_rope_parameters(tmp_path):
    src = CONFIGS / "olmo-3.1-32b-instruct.json"
    out = tmp_path / "out.json"
    assert main(["rope", str(src), str(out), "--type", "linear", "--factor", "2"]) == 0
    rp = json.loads(out.read_text())["rope_parameters"]
    assert set(rp) == {"full_attention", "sliding_attention"} and rp["full_attention"]["rope_type"] == "linear"
