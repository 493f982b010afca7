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


@pytest.mark.parametrize("engine,noted", [("vllm==99.0", True), ("vllm==0.33.0", False), ("vllm==0.5.0", False)])
def test_a_release_kvtool_has_not_read_is_noted(tmp_path, capsys, engine: str, noted: bool) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["kv-budget", str(tmp_path / "config.json"), "--engine", engine]) == 0
    assert ("is not a release kvtool has read" in capsys.readouterr().out) is noted


def test_a_range_is_refused_in_one_line(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps(YARN))
    assert main(["kv-budget", str(tmp_path / "config.json"), "--engine", "vllm>=0.28"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtool: error: --engine") and "give one" in err


# --- the paging rules of each release (schemas/engines/facts.json kv_* rows; numbers worked out by hand) ---
def _cdiv(a, b):
    return -(-a // b)


def _budget(capsys, name: str, *args: str) -> dict:
    from budget_helpers import config, run_json

    return run_json(capsys, config(name), *args)


def test_mistral_v01_window_follows_the_release(capsys) -> None:
    """Mistral-7B-v0.1: 32 layers all sliding over 4096, 8 KV heads x 128 at 2 bytes, 32768 tokens, 2048-token step."""
    per_layer = 2 * 8 * 128 * 2
    want = {  # tokens each layer reserves
        "0.6.2": _cdiv(4096, 16) * 16,  # BlockSpaceManagerV1: ceil(W / B) blocks
        "0.7.3": (4096 // 16 + 2) * 16,  # V2 / SelfAttn block manager: W // B + 2 blocks
        "0.8.2": 32768,  # V1 without SlidingWindowSpec: every token
        "0.25.1": (_cdiv(4096 - 1 + 2048, 16) + 1) * 16,  # one scheduler step
        "0.33.0": (_cdiv(4096 - 1 + 2 * 2048, 16) + 1) * 16,  # max_in_flight_tokens: two steps (async)
    }
    for release, tokens in want.items():
        d = _budget(capsys, "mistral-7b-instruct-v0.1", "--engine", f"vllm=={release}", "--max-model-len", "32768")
        assert d["kv_bytes_per_sequence"] == 32 * tokens * per_layer, release


def test_gemma3_hybrid_groups_follow_the_release(capsys) -> None:
    """Gemma-3-1B: 4 global + 22 sliding (512) layers, 1 KV head x 256 at 2 bytes, 32768 tokens."""
    per_layer = 2 * 1 * 256 * 2
    one = (_cdiv(512 - 1 + 2048, 16) + 1) * 16
    two = (_cdiv(512 - 1 + 2 * 2048, 16) + 1) * 16
    cases = {
        "0.9.0": (26 * 32768, []),  # no hybrid allocator: every layer full, one group
        "0.10.2": (4 * 32768 + 24 * one, [2]),  # groups of 4: 22 sliding fill 6 groups, 2 padding slots
        "0.33.0": (4 * 32768 + 24 * two, [2]),
    }
    for release, (tokens, pads) in cases.items():
        d = _budget(capsys, "gemma-3-1b-it", "--engine", f"vllm=={release}")
        assert d["kv_bytes_per_sequence"] == tokens * per_layer, release
        assert [p["count"] for p in d["padding_layers"]] == pads, release


def test_gpt_oss_20b_group_threshold_follows_the_release(tmp_path, capsys) -> None:
    """13 full + 12 sliding (window 128) layers: 0.10.2 groups by the smallest kind (12: the 13 full layers fill
    2 groups, 11 padding slots), 0.17.0 (under 1.25x) and 0.33.0 (under 1.5x) by the largest (13: 1 sliding slot)."""
    from budget_helpers import config

    cfg = json.loads(open(config("gpt-oss-20b")).read())
    cfg["num_hidden_layers"] = 25
    cfg["layer_types"] = ["sliding_attention", "full_attention"] * 12 + ["full_attention"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for release, pads in {"0.10.2": [("full_attention", 11)], "0.17.0": [("sliding_attention", 1)],
                          "0.33.0": [("sliding_attention", 1)]}.items():
        assert main(["kv-budget", str(tmp_path / "config.json"), "--engine", f"vllm=={release}",
                     "--max-model-len", "8192", "--format", "json"]) == 0
        d = json.loads(capsys.readouterr().out)
        assert [(p["layer_type"], p["count"]) for p in d["padding_layers"]] == pads, release


def test_disabling_the_hybrid_manager_keeps_an_all_sliding_window(capsys) -> None:
    """--disable-hybrid-kv-cache-manager converts windows to full only beside full layers (Gemma-3); Mistral-v0.1's
    layers all slide, so they keep the window (vllm/v1/core/kv_cache_planning.py, _promote_local_kv_cache_specs)."""
    per_layer = 2 * 8 * 128 * 2
    d = _budget(capsys, "mistral-7b-instruct-v0.1", "--disable-hybrid-kv-cache-manager", "--max-model-len", "32768")
    assert d["kv_bytes_per_sequence"] == 32 * (_cdiv(4096 - 1 + 2 * 2048, 16) + 1) * 16 * per_layer


@pytest.mark.parametrize("name,release,cited", [
    ("gemma-3-1b-it", "0.6.3", {"vllm-v0-interleaved-window-full"}),
    ("mistral-7b-instruct-v0.1", "0.6.3", {"vllm-v0-sliding-floor-plus-two-blocks"}),
    ("gemma-3-1b-it", "0.8.2", {"vllm-v1-no-sliding-spec"}),
    ("gemma-3-1b-it", "0.10.2", {"vllm-sliding-one-step", "vllm-hybrid-group-min-layers"}),
    ("mistral-7b-instruct-v0.1", "0.10.2", {"vllm-sliding-one-step"}),
    ("gemma-3-1b-it", "0.33.0", set()),
])
def test_notes_cite_the_rows_that_shaped_the_figures(capsys, name, release, cited) -> None:
    from kvtool.engines.facts import facts

    notes = " ".join(_budget(capsys, name, "--engine", f"vllm=={release}")["notes"])
    rows = {f.id for f in facts() if f.effect == "arithmetic" and f.arithmetic.startswith("kv_")
            and str(f.citation) in notes}
    assert rows == cited, (release, rows)
