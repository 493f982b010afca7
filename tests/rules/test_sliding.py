"""KV3xx: sliding windows and layer_types."""

from __future__ import annotations

import json

from rules_helpers import FIXTURES, only

QWEN2 = json.loads((FIXTURES / "KV302" / "pass_qwen25_disabled" / "config.json").read_text())
GEMMA3 = json.loads((FIXTURES / "KV301" / "pass" / "config.json").read_text())


def test_window_value_names_field_and_value() -> None:
    (f,) = only({**GEMMA3, "sliding_window": -4}, "KV301")
    assert f.path == "sliding_window" and "-4" in f.message and f.severity == "error"
    # a null window with sliding layers: transformers' Gemma-3 fails at the first forward (tests/oracle)
    (g,) = only({**GEMMA3, "sliding_window": None}, "KV301")
    assert "sliding_attention" in g.message


def test_qwen25_window_with_switch_off_is_clean() -> None:
    # transformers nulls sliding_window when use_sliding_window is false: no finding of any KV3 code
    assert not only(QWEN2, "KV302") + only(QWEN2, "KV303")


def test_switch_on_without_sliding_layers() -> None:
    (f,) = only({**QWEN2, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 9}, "KV302")
    assert "max_window_layers = 9 >= num_hidden_layers = 4" in f.message and f.path == "max_window_layers"
    (g,) = only({**QWEN2, "max_window_layers": -1}, "KV302")
    assert "-1" in g.message


def test_window_not_shorter_than_context_is_info() -> None:
    (f,) = only({**GEMMA3, "sliding_window": 2048}, "KV303")
    assert f.severity == "info" and "2048 >= max_position_embeddings = 2048" in f.message


def test_layer_types_length_and_values() -> None:
    (n,) = only({**GEMMA3, "layer_types": ["full_attention"] * 3}, "KV304")
    assert "3 entries but num_hidden_layers is 2" in n.message
    (u,) = only({**GEMMA3, "layer_types": ["full_attention", "global"]}, "KV305")
    assert "[1] 'global'" in u.message and u.path == "layer_types[1]"
    legacy = {**GEMMA3, "layer_types": ["attention", "mamba"]}  # names transformers remaps on load
    assert not only(legacy, "KV305")
