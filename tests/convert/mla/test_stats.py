"""kvtool.convert.mla.stats: what a forward gives per layer, and sequential calibration."""

from __future__ import annotations

import torch

from kvtool.convert.mla.rope import SourceRope
from kvtool.convert.mla.stats import collect_stats


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                      num_hidden_layers=3, vocab_size=50)
    return LlamaForCausalLM(cfg).eval()


def test_stats_are_each_layers_attention_input_and_output():
    model = _model()
    ids = torch.randint(0, 50, (2, 12))
    stats = collect_stats(model, ids)
    assert sorted(stats) == [0, 1, 2]
    layer = model.model.layers[0]
    x = layer.input_layernorm(model.model.embed_tokens(ids))
    assert torch.allclose(stats[0].x, x, atol=1e-6)
    assert stats[0].cov.shape == (33, 33) and abs(float(stats[0].cov[-1, -1]) - 1.0) < 1e-12
    assert stats[0].target.shape == (2, 12, 32) and stats[0].scaling == 8 ** -0.5


def test_sequential_calibration_feeds_the_converted_output_on():
    model = _model()
    ids = torch.randint(0, 50, (2, 12))
    plain = collect_stats(model, ids)
    seen = []

    def convert(i, st):
        seen.append(i)
        return lambda x: torch.zeros_like(st.target)  # a converted block that outputs nothing

    seq = collect_stats(model, ids, convert)
    assert seen == [0, 1, 2]
    assert torch.allclose(seq[0].x, plain[0].x)
    assert not torch.allclose(seq[1].x, plain[1].x)  # layer 1 sees the stream without layer 0's attention
    # the hooks are gone: a plain forward gives the plain statistics again
    assert torch.allclose(collect_stats(model, ids)[2].x, plain[2].x)


def test_source_rope_from_config():
    r = SourceRope.of_config({"hidden_size": 576, "num_attention_heads": 9, "head_dim": 64,
                                "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}})
    assert (r.theta, r.head_dim, r.rotary_dim, r.scaling) == (100000.0, 64, 64, None)
    r = SourceRope.of_config({"hidden_size": 64, "num_attention_heads": 2, "rope_theta": 5e5,
                                "partial_rotary_factor": 0.5, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})
    assert (r.theta, r.head_dim, r.rotary_dim, r.scaling["rope_type"]) == (5e5, 32, 16, "llama3")
