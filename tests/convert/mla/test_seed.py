"""kvtool.convert.mla.seed: the aware MQA merge as an MLA solution, run through transformers' DeepseekV3Attention."""

from __future__ import annotations

import pytest
import torch
from test_solve import HD, HEADS, HIDDEN, THETA, _deepseek, _inputs, _llama, _rel, _source, _weights

from kvtool.convert.mla.rope import SourceRope
from kvtool.convert.mla.shape import MlaShape
from kvtool.convert.mla.solve import SolveOptions, solve_layer
from kvtool.convert.mla.stats import MlaStats

ROPE = SourceRope(theta=THETA, head_dim=HD, rotary_dim=HD)
HORIZON = 16  # pairs 2 and 3 turn less than 1 rad over 16 positions: the merge's static pairs


def _case(kv_heads: int = 2):
    cfg, attn, rotary = _llama(kv_heads)
    x = _inputs()
    return cfg, attn, rotary, x, _source(attn, rotary, x)


def _aware_mqa(attn, rotary, x, kv_heads: int, o_ridge):
    """`--to mqa --method aware`'s closed form for this layer (kvtool.convert.aware.merge.merge_layer)."""
    from kvtool.convert.aware.attention import LayerInputs, Proj, attention_output
    from kvtool.convert.aware.merge import MergeSettings, merge_layer

    pos = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
    cos, sin = rotary(x, pos)
    inp = LayerInputs(x, cos, sin, attn.scaling)
    src = Proj(*(getattr(attn, f"{n}_proj").weight.detach() for n in "qkvo"))
    s = MergeSettings(num_heads=HEADS, num_kv_heads=kv_heads, target_kv_heads=1, head_dim=HD, grouping="contiguous",
                      o_ridge=o_ridge, context=HORIZON, static_angle=1.0)
    new, _ = merge_layer(inp, src, s)
    return attention_output(inp, new, HEADS, HD)


@pytest.mark.parametrize("o_ridge", [None, 2.0])
def test_mqa_seed_at_rope_head_dim_is_the_aware_mqa_merge(o_ridge):
    # rope = head_dim holds the MQA key, a latent of head_dim the MQA value; without the latent norm the MLA block
    # computes what the aware MQA merge does (its static pairs and o refit included)
    _, attn, rotary, x, y = _case()
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD, qk_rope_head_dim=HD, qk_nope_head_dim=0,
                     v_head_dim=HD)
    opts = SolveOptions(seed="mqa", norm="identity", o_ridge=o_ridge, horizon=HORIZON)
    t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE, opts)
    mqa = _aware_mqa(attn, rotary, x, 2, o_ridge)
    assert _rel(_deepseek(shape, ROPE, t, x, identity_norm=True), mqa) < 1e-4
    assert _rel(mqa, y) > 0.05  # the merge loses something, so the match above is not trivial


def test_residual_nope_keys_recover_what_the_mqa_key_misses():
    # per-head NoPE keys on the static pairs, read from a latent with room for them, bring the block closer to the
    # source than the MQA seed alone. Both KV heads get the same values, so the merge loses keys only.
    cfg, attn, rotary = _llama(2)
    with torch.no_grad():
        attn.v_proj.weight[HD:] = attn.v_proj.weight[:HD]
    x = _inputs()
    y = _source(attn, rotary, x)
    errs = {}
    for angle in (0.0, 1.0):
        shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD + 8, qk_rope_head_dim=HD,
                         qk_nope_head_dim=8, v_head_dim=HD)
        opts = SolveOptions(seed="mqa", norm="identity", o_ridge=None, horizon=HORIZON, residual_angle=angle)
        t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE, opts)
        errs[angle] = _rel(_deepseek(shape, ROPE, t, x, identity_norm=True), y)
    assert errs[1.0] < 0.9 * errs[0.0]


def test_slow_pairs_move_to_the_latent():
    # rope 4 of 8: the MQA key's two slowest pairs come from the latent unrotated; over 24 positions they barely
    # turn, so the block stays near the rope = head_dim one
    _, attn, rotary, x, y = _case()
    outs = {}
    for dr in (HD, 4):
        shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD + HD - dr, qk_rope_head_dim=dr,
                         qk_nope_head_dim=HD - dr, v_head_dim=HD)
        opts = SolveOptions(seed="mqa", norm="identity", o_ridge=None, horizon=HORIZON)
        t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE, opts)
        outs[dr] = _deepseek(shape, ROPE, t, x, identity_norm=True)
    assert _rel(outs[4], outs[HD]) < 0.05


def test_constant_dimension_keeps_the_seed_close_under_the_latent_norm():
    _, attn, rotary, x, y = _case()
    mqa = _aware_mqa(attn, rotary, x, 2, None)
    errs = {}
    for norm in ("constant", "span", "none"):
        shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD + (norm == "constant"), qk_rope_head_dim=HD,
                         qk_nope_head_dim=0, v_head_dim=HD)
        t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE,
                        SolveOptions(seed="mqa", norm=norm, o_ridge=None, horizon=HORIZON))
        errs[norm] = _rel(_deepseek(shape, ROPE, t, x), mqa)
    assert errs["constant"] < 0.5 * errs["none"]
    assert errs["span"] < 0.5 * errs["none"]


def test_source_values_use_a_latent_wider_than_the_mqa_seed():
    # Two KV heads with different values: the MQA seed holds one value head, so a latent with room for both
    # (2 x head_dim) gains nothing from it; seed_values "source" gives the latent both heads' values and the
    # block comes closer to the source. Keys are left as the seed makes them (rope = head_dim, the MQA key).
    _, attn, rotary, x, y = _case()
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=2 * HD, qk_rope_head_dim=HD,
                     qk_nope_head_dim=0, v_head_dim=HD)
    errs = {}
    for values in ("mqa", "source"):
        opts = SolveOptions(seed="mqa", norm="identity", o_ridge=None, horizon=HORIZON, seed_values=values)
        t = solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE, opts)
        errs[values] = _rel(_deepseek(shape, ROPE, t, x, identity_norm=True), y)
    assert errs["source"] < 0.9 * errs["mqa"]


def test_unknown_seed_values_is_refused():
    _, attn, rotary, x, y = _case()
    shape = MlaShape(hidden_size=HIDDEN, num_heads=HEADS, kv_lora_rank=HD, qk_rope_head_dim=HD, qk_nope_head_dim=0,
                     v_head_dim=HD)
    with pytest.raises(ValueError, match="seed_values 'both'"):
        solve_layer(_weights(attn), MlaStats.of(x, y, attn.scaling), shape, ROPE,
                    SolveOptions(seed="mqa", seed_values="both"))
