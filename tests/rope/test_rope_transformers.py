"""A config written by `kvtool rope` loads in the installed transformers and builds the intended rotary
embedding; its legacy fields are the ones transformers 4.x reads."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest

from kvtool.cli import main
from kvtool.model.rope import freqs
from kvtool.model.rope import types as rt

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

DATA = Path(__file__).resolve().parents[1] / "data" / "rope"
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128,
        "max_position_embeddings": 2048, "rope_theta": 10000.0, "torch_dtype": "float32"}  # head_dim 32
LISTS = {"short_factor": [1.0 + 0.02 * i for i in range(16)], "long_factor": [1.0 + 0.5 * i for i in range(16)]}
OPTIONS = {
    "yarn": ["--factor", "8", "--beta-fast", "16"],
    "llama3": ["--target-context", "16384"],
    "linear": ["--factor", "4"],
    "dynamic": ["--factor", "4"],
    "longrope": ["--factor", "16"],
}

# transformers 4.x (4.46) accepted keys per rope_type: required, then optional (modeling_rope_utils.py).
TF4_KEYS = {
    "linear": ({"rope_type", "factor"}, set()),
    "dynamic": ({"rope_type", "factor"}, set()),
    "yarn": ({"rope_type", "factor"}, {"attention_factor", "beta_fast", "beta_slow", "original_max_position_embeddings",
                                       "mscale", "mscale_all_dim", "truncate"}),
    "longrope": ({"rope_type", "short_factor", "long_factor"}, {"attention_factor", "factor",
                                                                "original_max_position_embeddings"}),
    "llama3": ({"rope_type", "factor", "original_max_position_embeddings", "low_freq_factor", "high_freq_factor"},
               set()),
}


def write(tmp_path: Path, rope_type: str, config: dict = TINY) -> Path:
    src = tmp_path / "src"
    src.mkdir(exist_ok=True)
    (src / "config.json").write_text(json.dumps(config))
    args = list(OPTIONS[rope_type])
    if rope_type == "longrope":
        for key, lst in LISTS.items():
            f = tmp_path / f"{key}.json"
            f.write_text(json.dumps(lst))
            args += [f"--{key.replace('_', '-')}-file", str(f)]
    dst = tmp_path / "dst"
    assert main(["rope", str(src), str(dst), "--type", rope_type, *args]) == 0
    return dst


@pytest.fixture
def tf_warnings(caplog):
    transformers.utils.logging.enable_propagation()
    caplog.set_level(logging.WARNING, logger="transformers")
    yield caplog
    transformers.utils.logging.disable_propagation()


@pytest.mark.parametrize("rope_type", sorted(OPTIONS))
def test_written_config_builds_the_intended_rotary_embedding(tmp_path, rope_type, tf_warnings):
    dst = write(tmp_path, rope_type)
    cfg = transformers.AutoConfig.from_pretrained(dst)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    rot = model.model.rotary_emb
    written = json.loads((dst / "config.json").read_text())
    params = {**written["rope_parameters"]}
    g = rt.Geometry(dim=32, theta=params["rope_theta"], max_position_embeddings=written["max_position_embeddings"],
                    head_dim=32)
    want_inv, want_att = rt.compute(params, g)
    np.testing.assert_allclose(rot.inv_freq.double().numpy(), want_inv, rtol=2e-6)
    assert rot.attention_scaling == pytest.approx(want_att, rel=1e-9)
    assert rot.rope_type == rope_type
    if rope_type in ("yarn", "llama3", "linear"):
        assert not np.allclose(want_inv, freqs.base_inv_freq(10000.0, 32))  # the scaling is in effect
    # transformers found nothing to complain about (no unknown keys, no factor / length mismatch)
    noisy = [r.getMessage() for r in tf_warnings.records if "rope" in r.getMessage().lower()]
    assert noisy == []


def test_dynamic_and_longrope_switch_at_the_original_length(tmp_path):
    for rope_type in ("dynamic", "longrope"):
        d = tmp_path / rope_type
        d.mkdir()
        dst = write(d, rope_type)
        cfg = transformers.AutoConfig.from_pretrained(dst)
        rot = transformers.AutoModelForCausalLM.from_config(cfg).model.rotary_emb
        seq = 4 * 2048 if rope_type == "dynamic" else 16 * 2048
        x = torch.zeros(1, seq, 64)
        rot(x, torch.arange(seq)[None])
        params = json.loads((dst / "config.json").read_text())["rope_parameters"]
        g = rt.Geometry(dim=32, theta=10000.0, max_position_embeddings=cfg.max_position_embeddings, head_dim=32)
        want, _ = rt.compute(params, g, seq_len=seq)
        np.testing.assert_allclose(rot.inv_freq.double().numpy(), want, rtol=2e-6)


def test_gemma3_nested_rotary_per_layer_type(tmp_path):
    cfg = json.loads((DATA / "gemma-3-1b-it.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=2,
               num_key_value_heads=1, head_dim=32, vocab_size=256, query_pre_attn_scalar=32)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "config.json").write_text(json.dumps(cfg))
    dst = tmp_path / "o"
    assert main(["rope", str(tmp_path / "g"), str(dst), "--type", "linear", "--factor", "8"]) == 0
    conf = transformers.AutoConfig.from_pretrained(dst)
    rot = transformers.AutoModelForCausalLM.from_config(conf).model.rotary_emb
    full = rot.full_attention_inv_freq.double().numpy()
    sliding = rot.sliding_attention_inv_freq.double().numpy()
    np.testing.assert_allclose(full, freqs.base_inv_freq(1e6, 32) / 8, rtol=2e-6)
    np.testing.assert_allclose(sliding, freqs.base_inv_freq(1e4, 32), rtol=2e-6)  # untouched


@pytest.mark.parametrize("rope_type", sorted(OPTIONS))
def test_legacy_fields_are_what_transformers_4_reads(tmp_path, rope_type):
    written = json.loads((write(tmp_path, rope_type) / "config.json").read_text())
    rs = written["rope_scaling"]
    required, optional = TF4_KEYS[rope_type]
    assert required <= set(rs) <= required | optional
    assert "rope_theta" not in rs and written["rope_theta"] == 10000.0  # 4.x reads the top-level base
    assert isinstance(rs["factor"], float)  # 4.x validators warn on an int factor
    if "original_max_position_embeddings" in rs:
        assert isinstance(rs["original_max_position_embeddings"], int)
    # and both layouts describe the same RoPE
    v5 = dict(written["rope_parameters"])
    assert v5.pop("rope_theta") == written["rope_theta"] and v5 == rs


def test_legacy_type_key_written_only_when_present(tmp_path):
    with_type = {**TINY, "rope_scaling": {"type": "linear", "factor": 2.0}}
    dst = write(tmp_path, "yarn", with_type)
    rs = json.loads((dst / "config.json").read_text())["rope_scaling"]
    assert rs["type"] == rs["rope_type"] == "yarn"
    plain = tmp_path / "plain"
    plain.mkdir()
    assert "type" not in json.loads((write(plain, "yarn") / "config.json").read_text())["rope_scaling"]
