"""kvtool.convert.aware.grouping: what a candidate group costs, and the layer merge that searches with it."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvtool.convert.aware.attention import LayerInputs, Proj, head_contexts  # noqa: E402
from kvtool.convert.aware.grouping import GroupCost, permute_heads  # noqa: E402
from kvtool.convert.aware.linalg import augmented_covariance  # noqa: E402
from kvtool.convert.aware.merge import MergeSettings, merge_layer  # noqa: E402

H, KV, HD, D, B, T = 8, 4, 8, 24, 2, 48


def _inputs(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    inv = 1.0 / (100.0 ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
    emb = torch.cat((torch.outer(torch.arange(T, dtype=torch.float64), inv),) * 2, dim=-1)
    return LayerInputs(x, emb.cos().expand(B, -1, -1), emb.sin().expand(B, -1, -1), HD ** -0.5), g


def _layer(g, twins):
    """Random projections whose KV heads twins[i] copy heads i (keys scaled per RoPE pair, values mapped)."""
    q = torch.randn(H * HD, D, generator=g, dtype=torch.float64)
    k = torch.randn(KV, HD, D, generator=g, dtype=torch.float64)
    v = torch.randn(KV, HD, D, generator=g, dtype=torch.float64)
    for i, j in twins.items():
        coef = torch.randn(HD // 2, generator=g, dtype=torch.complex128)
        z = torch.complex(k[i, : HD // 2], k[i, HD // 2:]) * coef[:, None]
        k[j] = torch.cat((z.real, z.imag))
        v[j] = torch.randn(HD, HD, generator=g, dtype=torch.float64) @ v[i]
    o = torch.randn(D, H * HD, generator=g, dtype=torch.float64)
    return Proj(q, k.reshape(KV * HD, D), v.reshape(KV * HD, D), o)


def _cost(inp, src, heads, tokens=B * T):
    return GroupCost(inp, src, augmented_covariance(inp.x), num_heads=H, num_kv_heads=KV, head_dim=HD,
                     tokens=tokens)(heads)


def test_a_group_of_foldable_copies_costs_nothing_and_others_do():
    inp, g = _inputs()
    src = _layer(g, {0: 2, 1: 3})
    energy = float((head_contexts(inp, src, H, HD) @ src.o.T).pow(2).sum(-1).mean())
    assert _cost(inp, src, (0, 2)) < 1e-10 * energy and _cost(inp, src, (1, 3)) < 1e-10 * energy
    assert _cost(inp, src, (0, 1)) > 1e-3 * energy and _cost(inp, src, (2, 3)) > 1e-3 * energy


def test_the_cost_is_the_layer_merge_of_those_heads_alone():
    inp, g = _inputs(1)
    src = _layer(g, {})
    heads = (1, 3)
    sub = permute_heads(src, list(heads), num_heads=H, head_dim=HD, num_kv_heads=KV)
    _, rep = merge_layer(inp, sub, MergeSettings(H // KV * 2, 2, 1, HD, grouping="contiguous", o_ridge=None))
    target = float((head_contexts(inp, sub, H // KV * 2, HD) @ sub.o.T).pow(2).mean())
    assert _cost(inp, src, heads) == pytest.approx(rep.err_merged * target * D, rel=1e-4)


def test_the_layer_merge_groups_by_measured_error():
    inp, g = _inputs(2)
    src = _layer(g, {0: 3, 1: 2})  # copies scattered: contiguous pairs (0, 1) and (2, 3) are the wrong ones
    notes: list[str] = []
    new, rep = merge_layer(inp, src, MergeSettings(H, KV, 2, HD, o_ridge=None), on_note=notes.append)
    assert rep.order == [0, 3, 1, 2] and rep.err_merged < 1e-8
    assert notes[-1] == "grouping, 6 candidate groups merged"
    _, contiguous = merge_layer(inp, src, MergeSettings(H, KV, 2, HD, grouping="contiguous", o_ridge=None))
    assert contiguous.order == [0, 1, 2, 3] and contiguous.err_merged > 1e-3


def test_groups_are_measured_on_the_first_sequences_with_the_whole_covariance():
    inp, g = _inputs(3)
    src = _layer(g, {})
    cov = augmented_covariance(inp.x)
    first = LayerInputs(inp.x[:1], inp.cos[:1], inp.sin[:1], inp.scaling)
    one = GroupCost(inp, src, cov, num_heads=H, num_kv_heads=KV, head_dim=HD, tokens=T + 5)
    alone = GroupCost(first, src, cov, num_heads=H, num_kv_heads=KV, head_dim=HD, tokens=B * T)
    assert one((0, 2)) == pytest.approx(alone((0, 2)), rel=1e-6)
    assert one((0, 2)) != pytest.approx(_cost(inp, src, (0, 2)), rel=1e-3)  # the second sequence counts otherwise
