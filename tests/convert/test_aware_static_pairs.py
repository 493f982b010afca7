"""RoPE pairs that barely turn over the served context merge as one real subspace (keys.static_pairs)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.convert.aware.attention import LayerInputs, Proj, head_contexts  # noqa: E402
from kvtool.convert.aware.keys import pair_angles, static_pairs  # noqa: E402
from kvtool.convert.aware.merge import MergeSettings, merge_layer  # noqa: E402
from kvtool.convert.aware.method import STATIC_ANGLE  # noqa: E402

H, KV, HD, D, B, T = 4, 2, 8, 24, 2, 32
P = HD // 2


def _rope(inv_freq, positions=T):
    ang = torch.outer(torch.arange(positions, dtype=torch.float64), inv_freq)
    emb = torch.cat((ang, ang), dim=-1)
    return emb.cos().expand(B, -1, -1), emb.sin().expand(B, -1, -1)


@pytest.mark.parametrize("rope", [{"rope_type": "default"},
                                  {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                                  {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 8192}])
def test_static_pairs_are_those_transformers_turns_least(rope):
    """The angle per position is read from the layer's own cos/sin; transformers' inv_freq says which pairs
    turn by less than the bound over the horizon (rope scaling included, yarn's attention factor ignored)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, head_dim=128, max_position_embeddings=32768,
                      rope_parameters={"rope_theta": 500000.0, **rope})
    emb = LlamaRotaryEmbedding(cfg)
    x = torch.zeros(1, 4, 512)
    cos, sin = emb(x, torch.arange(4)[None])
    for horizon, angle in ((32768, 1.0), (1024, 0.5), (8192, 2.0)):
        want = emb.inv_freq.to(torch.float64) * horizon < angle
        got = static_pairs(pair_angles(cos, sin), horizon, angle)
        assert torch.equal(got, want), (horizon, angle)
    assert 0 < int(static_pairs(pair_angles(cos, sin), 32768, 1.0).sum()) < 64


def _mixing_heads(seed=0):
    """Two KV heads: the rotating pairs related by a complex scale, the last two pairs by a real map that
    mixes them (the per-pair merge cannot fold that; the subspace merge can)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    q = torch.randn(H * HD, D, generator=g, dtype=torch.float64)
    o = torch.randn(D, H * HD, generator=g, dtype=torch.float64)
    k0 = torch.randn(HD, D, generator=g, dtype=torch.float64)
    v0 = torch.randn(HD, D, generator=g, dtype=torch.float64)
    coef = torch.randn(P, generator=g, dtype=torch.complex128)
    z = torch.complex(k0[:P], k0[P:]) * coef[:, None]
    k1 = torch.cat((z.real, z.imag))
    dims = torch.tensor([P - 2, P - 1, HD - 2, HD - 1])  # the last two pairs, both halves
    k1[dims] = torch.randn(4, 4, generator=g, dtype=torch.float64) @ k0[dims]
    v1 = torch.randn(HD, HD, generator=g, dtype=torch.float64) @ v0
    return x, Proj(q, torch.cat((k0, k1)), torch.cat((v0, v1)), o)


def _merge(x, src, inv_freq, window=None, **settings):
    cos, sin = _rope(inv_freq)
    inp = LayerInputs(x, cos, sin, HD ** -0.5, sliding_window=window)
    new, rep = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=None, **settings))
    want = head_contexts(inp, src, H, HD) @ src.o.T
    got = head_contexts(inp, new.to(torch.float64), H, HD) @ new.o.to(torch.float64).T
    return rep, float((got - want).pow(2).mean() / want.pow(2).mean())


def test_pairs_that_do_not_turn_merge_exactly_as_a_subspace():
    x, src = _mixing_heads()
    inv = torch.tensor([1.0, 0.3, 0.0, 0.0], dtype=torch.float64)  # the last two pairs never turn
    rep, err = _merge(x, src, inv, context=T, static_angle=1.0)
    assert rep.static_pairs == 2 and rep.err_merged < 1e-8 and err < 1e-8
    rep_off, err_off = _merge(x, src, inv, context=T, static_angle=0.0)
    assert rep_off.static_pairs == 0 and err_off > 1e-3  # per-pair complex scales cannot mix the pairs


def test_slowly_turning_pairs_are_static_only_within_the_horizon():
    x, src = _mixing_heads(1)
    inv = torch.tensor([1.0, 0.3, 2e-3, 1e-3], dtype=torch.float64)
    # over 4096 positions they turn by 8 and 4 radians: not static
    assert _merge(x, src, inv, context=4096, static_angle=1.0)[0].static_pairs == 0
    # a sliding-window layer only looks back its window: 256 positions, 0.51 and 0.26 radians
    assert _merge(x, src, inv, window=256, context=4096, static_angle=1.0)[0].static_pairs == 2
    rep, err = _merge(x, src, inv, context=T, static_angle=1.0)
    assert rep.static_pairs == 2
    # over the calibration's 32 positions the map barely fails to commute with the small rotation left
    assert err < 0.1 * _merge(x, src, inv, context=T, static_angle=0.0)[1]


def test_rotating_pairs_are_never_static():
    x, src = _mixing_heads(2)
    inv = torch.tensor([1.0, 0.5, 0.3, 0.2], dtype=torch.float64)
    assert _merge(x, src, inv, context=T, static_angle=1.0)[0].static_pairs == 0


def test_the_served_context_reaches_the_provenance(tmp_path, smollm2_path):
    """Default: the config's max_position_embeddings; --serve-context overrides it; static_angle=0 turns it
    off."""
    from aware_helpers import convert, tiny_model

    src = tiny_model(tmp_path / "src", "llama", smollm2_path)
    rows = {}
    for name, opts in (("default", []), ("short", ["--serve-context", "16"]),
                       ("off", ["--method-opt", "static_angle=0"])):
        assert convert(src, tmp_path / name, "--to", "mqa", "--method", "aware", "--calib-tokens", "256",
                        "--seq-len", "64", *opts) == 0
        rows[name] = json.loads((tmp_path / name / "kvtool.json").read_text())["method_details"]
    # head_dim 16, theta 1e4: inv_freq 1e4^(-p/8); over 1024 positions only p = 7 turns by less than the default
    # 1 rad (0.32; p = 6: 1.02); over 16 positions p = 3 .. 7 do (0.51 .. 0.005; p = 2: 1.6)
    assert STATIC_ANGLE == 1.0 and rows["default"]["static_angle"] == STATIC_ANGLE
    assert rows["default"]["serve_context"] == 1024 and rows["default"]["rope_static_pairs"] == [1, 1]
    assert rows["short"]["serve_context"] == 16 and rows["short"]["rope_static_pairs"] == [5, 5]
    assert rows["off"]["static_angle"] == 0 and rows["off"]["rope_static_pairs"] == [0, 0]


def _scores(x, q, k, inv_freq, heads, kv_heads):
    """Pre-softmax scores [B, H, T, T] of query heads against the KV heads they read, with RoPE."""
    from kvtool.convert.aware.attention import apply_rope

    cos, sin = _rope(inv_freq)
    qh = apply_rope((x @ q.T).view(B, T, heads, HD).transpose(1, 2), cos, sin)
    kh = apply_rope((x @ k.T).view(B, T, kv_heads, HD).transpose(1, 2), cos, sin)
    return qh @ kh.repeat_interleave(heads // kv_heads, dim=1).transpose(-1, -2)


def test_the_shared_basis_is_the_one_whose_folded_maps_turn_with_rope():
    """Any basis of the shared subspace gives the same scores at distance 0; the chosen one errs least once
    the static pairs turn (here up to 0.6 and 0.3 radians over the 32 positions)."""
    from kvtool.convert.aware.keys import merge_keys
    from kvtool.convert.aware.linalg import augment, augmented_covariance

    x, src = _mixing_heads(3)
    g = torch.Generator().manual_seed(4)
    k = src.k.clone()
    k[HD:] += 0.5 * torch.randn(HD, D, generator=g, dtype=torch.float64)  # the heads now differ: no exact merge
    inv = torch.tensor([1.0, 0.3, 2e-2, 1e-2], dtype=torch.float64)
    static = torch.tensor([False, False, True, True])
    want = _scores(x, src.q, k, inv, H, KV)
    cov = augmented_covariance(x)
    errs = {}
    for name, angles in (("chosen", inv), ("any", torch.zeros_like(inv))):  # zero angles: nothing to choose by
        nq, nk = merge_keys(augment(src.q, None), augment(k, None), cov, num_heads=H, num_kv_heads=KV,
                            target_kv_heads=1, head_dim=HD, rotary_dim=HD, static=static, angles=angles)
        got = _scores(x, nq[:, :-1], nk[:, :-1], inv, H, 1)
        errs[name] = float((got - want).pow(2).mean() / want.pow(2).mean())
        diag = torch.diagonal(got - want, dim1=-2, dim2=-1)  # distance 0: the basis does not matter there
        errs[name + "@0"] = float(diag.pow(2).mean())
    assert errs["chosen"] < 0.8 * errs["any"]
    assert errs["chosen@0"] == pytest.approx(errs["any@0"], rel=1e-6)
