"""KV7xx security and KV8xx KV-cache scales, plus the accepted scale names (kvtool.model.kv_scale_names)."""

from __future__ import annotations

import builtins
import json
import pickle

import numpy as np
import pytest
from kvtest import write_config, write_safetensors
from rules_helpers import FIXTURES, LLAMA

from kvtool.model import kv_scale_names as ksn
from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions


def _codes(folder) -> dict:
    return {f.code: f for f in lint_one(str(folder), LintOptions()).findings}


def test_pickles_are_flagged_by_name_and_never_opened(tmp_path, monkeypatch) -> None:
    write_config(tmp_path, LLAMA)

    class Boom:
        def __reduce__(self):
            return (builtins.exec, ("raise SystemExit('unpickled!')",))

    (tmp_path / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    monkeypatch.setattr(pickle, "load", lambda *a, **k: pytest.fail("pickle.load called"))
    monkeypatch.setattr(pickle, "loads", lambda *a, **k: pytest.fail("pickle.loads called"))
    found = _codes(tmp_path)
    assert found["KV701"].severity == "error" and "pytorch_model.bin" in found["KV701"].message


def test_index_escape_is_an_error_and_the_file_is_not_opened(tmp_path) -> None:
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside, {"x": np.zeros((2,), np.float16)})
    model = tmp_path / "model"
    write_config(model, LLAMA)
    (model / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "../outside.safetensors"}}))
    found = _codes(model)
    assert found["KV704"].severity == "error" and "../outside.safetensors" in found["KV704"].message
    assert "KV608" not in found and "KV609" not in found  # nothing from the outside file was read


def test_remote_code_message_depends_on_in_library_support() -> None:
    known = json.loads((FIXTURES / "KV703" / "fail" / "config.json").read_text())
    f = _codes(FIXTURES / "KV703" / "fail")["KV703"]
    assert known["model_type"] == "llama" and "in-library llama class" in f.message
    g = _codes(FIXTURES / "KV703" / "fail_phi2_remote_code_real")["KV703"]
    assert "needs trust_remote_code" in g.message


@pytest.mark.parametrize("name,prefix,role,style", [
    ("model.layers.3.self_attn.k_scale", "model.layers.3.self_attn", "k", "compressed-tensors"),
    ("model.layers.3.self_attn.attn.v_scale", "model.layers.3.self_attn", "v", "vllm"),
    ("model.layers.3.self_attn.k_proj.k_scale", "model.layers.3.self_attn", "k", "modelopt"),
    ("model.layers.3.self_attn.kv_scale", "model.layers.3.self_attn", "kv", "legacy"),
    ("model.layers.3.self_attn.v_proj.output_scale", "model.layers.3.self_attn", "v", "output-activation"),
])
def test_scale_names_vllm_accepts(name, prefix, role, style) -> None:
    got = ksn.match(name)
    assert got is not None and got[0] == prefix and got[1].role == role and got[1].style == style


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.k_proj.weight_scale", "model.layers.0.self_attn.k_proj.input_scale",
                                  "model.layers.0.mlp.down_proj.weight", "k_scale"])
def test_other_scales_are_not_kv_scales(name) -> None:
    assert not ksn.is_kv_scale(name)


def test_scales_for_counts_legacy_for_both_roles() -> None:
    names = {"a.self_attn.kv_scale"}
    found = ksn.scales_for("a.self_attn", names)
    assert [n for n, _ in found["k"]] == ["a.self_attn.kv_scale"] == [n for n, _ in found["v"]]
    assert ksn.canonical_name("a.self_attn", "v") == "a.self_attn.v_scale"


def test_missing_scales_message_counts_layers() -> None:
    f = _codes(FIXTURES / "KV801" / "fail_v_missing")["KV801"]
    assert "2 of 2 attention layers" in f.message and "model.layers.0.self_attn.v_scale" in f.message
    assert f.path == "quantization_config.kv_cache_scheme"


def test_pre_rope_scales_warn_unless_post_rope_scale_also_stored(tmp_path) -> None:
    f = _codes(FIXTURES / "KV803" / "fail_output_scale")["KV803"]
    assert f.severity == "warning" and "k_proj.output_scale" in f.message
    # vLLM 0.33 drops output_scale (its llama loader renames it to qkv_proj.output_scale): scales missing too
    assert "qkv_proj.output_scale" in _codes(FIXTURES / "KV803" / "fail_output_scale")["KV801"].message
    src = FIXTURES / "KV803" / "fail_output_scale"
    from safetensors.numpy import load_file

    tensors = load_file(str(src / "model.safetensors"))
    for i in range(LLAMA["num_hidden_layers"]):
        tensors[f"model.layers.{i}.self_attn.k_scale"] = np.array(0.1, np.float32)
    write_config(tmp_path, json.loads((src / "config.json").read_text()))
    write_safetensors(tmp_path / "model.safetensors", tensors)
    assert "KV803" not in _codes(tmp_path)
