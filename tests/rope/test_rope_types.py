"""Every entry of the RoPE type table: keys, validation, math; and the math against transformers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvtool.model.rope import freqs
from kvtool.model.rope import types as rt

DIM = 64
LISTS = {"short_factor": [1.0 + 0.01 * i for i in range(DIM // 2)],
         "long_factor": [1.0 + 0.2 * i for i in range(DIM // 2)]}

# One valid dict per table entry. A new entry without an example fails test_every_kind_has_an_example.
EXAMPLES = {
    "default": {"rope_type": "default"},
    "linear": {"rope_type": "linear", "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 512},
    "deepseek_yarn": {"rope_type": "deepseek_yarn", "factor": 8.0, "original_max_position_embeddings": 512,
                      "mscale": 0.707, "mscale_all_dim": 0.707},
    "deepseek_llama_scaling": {"rope_type": "deepseek_llama_scaling", "factor": 8.0,
                               "original_max_position_embeddings": 512},
    "longrope": {"rope_type": "longrope", "original_max_position_embeddings": 512, **LISTS},
    "llama3": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 512,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0},
    "proportional": {"rope_type": "proportional", "partial_rotary_factor": 0.5},
    "ntk": {"rope_type": "ntk", "factor": 4.0},
    "axial": {"rope_type": "axial"},
    "bailing_mrope": {"rope_type": "bailing_mrope", "mrope_section": [8, 8, 16]},
    "openpangu": {"rope_type": "openpangu", "mrope_section": [8, 8, 16], "mrope_interleaved": True},
    "mllama4": {"rope_type": "mllama4"},
}
GEOM = rt.Geometry(dim=DIM, theta=10000.0, max_position_embeddings=4096, head_dim=DIM)


def test_every_kind_has_an_example():
    assert set(EXAMPLES) == set(rt.KINDS)


@pytest.mark.parametrize("name", sorted(rt.KINDS))
def test_entry_valid_example_passes(name):
    assert rt.validate(EXAMPLES[name], GEOM) == []
    assert rt.KINDS[name].unknown(EXAMPLES[name]) == []


@pytest.mark.parametrize("name", sorted(rt.KINDS))
def test_entry_each_required_key_is_required(name):
    kind = rt.KINDS[name]
    for req in kind.required:
        keys = req if isinstance(req, tuple) else (req,)
        broken = {k: v for k, v in EXAMPLES[name].items() if k not in keys}
        codes = [(p.code, p.key) for p in rt.validate(broken, GEOM)]
        assert ("KV202", "|".join(keys)) in codes, (name, keys, codes)


@pytest.mark.parametrize("name", sorted(rt.KINDS))
def test_entry_flags_unknown_key(name):
    assert rt.KINDS[name].unknown({**EXAMPLES[name], "factr": 2.0}) == ["factr"]


@pytest.mark.parametrize("name", sorted(rt.KINDS))
def test_entry_math_is_finite(name):
    kind = rt.KINDS[name]
    if kind.compute is None:
        with pytest.raises(ValueError):
            rt.compute(EXAMPLES[name], GEOM)
        return
    inv, att = rt.compute(EXAMPLES[name], GEOM, seq_len=4 * 4096)  # past the original: dynamic / longrope scale
    assert inv.shape == (DIM // 2,)
    assert np.all(np.isfinite(inv)) and np.all(inv >= 0) and att > 0
    base = freqs.base_inv_freq(GEOM.theta, DIM)
    if kind.scaling and name != "proportional":
        # scaling never raises a frequency and lowers the slowest one
        assert np.all(inv <= base * (1 + 1e-12)) and inv[-1] < base[-1]


@pytest.mark.parametrize("name", [n for n, k in rt.KINDS.items() if k.validate is not None and "factor" in EXAMPLES[n]])
def test_entry_factor_below_one_is_rejected(name):
    codes = [p.code for p in rt.validate({**EXAMPLES[name], "factor": 0.5}, GEOM)]
    assert "KV204" in codes


def test_longrope_list_length_is_checked_per_list():
    # the upstream bug: a wrong length in either list must be caught on its own
    for key in ("short_factor", "long_factor"):
        bad = {**EXAMPLES["longrope"], key: [1.0] * (DIM // 2 + 1)}
        probs = [(p.code, p.key) for p in rt.validate(bad, GEOM)]
        assert probs == [("KV207", key)]
    bad = {**EXAMPLES["longrope"], "long_factor": "1.0"}
    assert [(p.code, p.key) for p in rt.validate(bad, GEOM)] == [("KV207", "long_factor")]


def test_llama3_equal_band_is_allowed_and_reversed_is_not():
    eq = {**EXAMPLES["llama3"], "low_freq_factor": 1.0, "high_freq_factor": 1.0}  # Llama 4 Scout ships this
    assert rt.validate(eq, GEOM) == []
    inv, _ = rt.compute(eq, GEOM)
    assert np.all(np.isfinite(inv))
    rev = {**EXAMPLES["llama3"], "low_freq_factor": 4.0, "high_freq_factor": 1.0}
    assert [p.code for p in rt.validate(rev, GEOM)] == ["KV208"]


def test_yarn_beta_order_and_types():
    assert [p.code for p in rt.validate({**EXAMPLES["yarn"], "beta_fast": 1, "beta_slow": 32}, GEOM)] == ["KV215"]
    assert [p.code for p in rt.validate({**EXAMPLES["yarn"], "truncate": "no"}, GEOM)] == ["KV215"]
    assert [p.code for p in rt.validate({**EXAMPLES["yarn"], "original_max_position_embeddings": -1}, GEOM)] == ["KV215"]


def test_unknown_type_and_aliases():
    assert [p.code for p in rt.validate({"rope_type": "gptj"}, GEOM)] == ["KV201"]
    assert rt.kind_of("su").name == "longrope" and rt.kind_of("mrope").name == "default"
    assert rt.validate({"type": "su", "original_max_position_embeddings": 512, **LISTS}, GEOM) == []


def test_served_context_follows_vllm():
    # vllm 0.33 _get_and_verify_max_len: yarn keeps max_position_embeddings (tests/oracle/test_vllm_facts.py)
    assert rt.served_context(EXAMPLES["yarn"], 999) == 999
    assert rt.served_context({"rope_type": "yarn", "original_max_position_embeddings": 512}, 999) is None
    assert rt.served_context({"rope_type": "made-up"}, 999) is None
    assert rt.served_context(EXAMPLES["linear"], 4096) == 4096 * 4
    assert rt.served_context(EXAMPLES["dynamic"], 4096) == 4096 * 4
    assert rt.served_context(EXAMPLES["llama3"], 131072) == 131072
    assert rt.served_context(EXAMPLES["longrope"], 131072) == 131072
    assert rt.served_context(EXAMPLES["default"], 2048) == 2048


def test_ntk_and_alpha_reduce_to_default_at_one():
    base = freqs.base_inv_freq(10000.0, DIM)
    inv, _ = rt.compute({"rope_type": "ntk", "factor": 1.0}, GEOM)
    np.testing.assert_allclose(inv, base)
    inv, _ = rt.compute({"rope_type": "ntk", "factor": 4.0, "mixed_b": 0.5}, GEOM)
    assert inv[0] < base[0] and inv[-1] < base[-1]
    inv, _ = rt.compute({"rope_type": "dynamic", "alpha": 1.0}, GEOM)
    np.testing.assert_allclose(inv, base)


def test_deepseek_yarn_matches_yarn_with_mscale_ratio():
    p = EXAMPLES["deepseek_yarn"]
    inv_d, att_d = rt.compute(p, GEOM)
    inv_y, att_y = rt.compute({**p, "rope_type": "yarn"}, GEOM)
    np.testing.assert_allclose(inv_d, inv_y)
    assert math.isclose(att_d, att_y)


# --- against transformers' own ROPE_INIT_FUNCTIONS ------------------------------------------------
TRANSFORMERS_CASES = {
    "linear": lambda f: {"factor": f},
    "dynamic": lambda f: {"factor": f},
    "yarn": lambda f: {"factor": f, "original_max_position_embeddings": 1024},
    "yarn-mscale": lambda f: {"factor": f, "original_max_position_embeddings": 1024, "mscale": 0.707,
                              "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2},
    "yarn-notruncate": lambda f: {"factor": f, "original_max_position_embeddings": 4096, "truncate": False},
    "llama3": lambda f: {"factor": f, "original_max_position_embeddings": 1024, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0},
    "longrope": lambda f: {"original_max_position_embeddings": 1024, "factor": f},
    "proportional": lambda f: {"factor": f, "partial_rotary_factor": 0.25},
}


@pytest.mark.parametrize("case", sorted(TRANSFORMERS_CASES))
@pytest.mark.parametrize("head_dim", [64, 96, 128])
def test_matches_transformers(case, head_dim):
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope_type = case.split("-")[0]
    for factor in (1.5, 4.0, 32.0):
        params = {"rope_type": rope_type, "rope_theta": 500000.0, **TRANSFORMERS_CASES[case](factor)}
        if rope_type == "longrope":
            params["short_factor"] = [1.0 + 0.01 * i for i in range(head_dim // 2)]
            params["long_factor"] = [1.0 + 0.3 * i for i in range(head_dim // 2)]
        cfg = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim,
                          max_position_embeddings=8192, rope_parameters=dict(params))
        g = rt.Geometry(dim=head_dim, theta=500000.0, max_position_embeddings=8192, head_dim=head_dim)
        for seq_len in (None, 4 * 8192):
            want, want_att = ROPE_INIT_FUNCTIONS[rope_type](cfg, "cpu", seq_len=seq_len)
            got, got_att = rt.compute(params, g, seq_len)
            np.testing.assert_allclose(got, want.double().numpy(), rtol=2e-6, err_msg=f"{case} f={factor} s={seq_len}")
            assert math.isclose(got_att, float(want_att), rel_tol=1e-9)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_default_matches_transformers(head_dim):
    pytest.importorskip("torch")
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    want = LlamaRotaryEmbedding(cfg).inv_freq.double().numpy()
    got, att = rt.compute({"rope_type": "default"}, rt.Geometry(dim=head_dim, theta=1e6))
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert att == 1.0
