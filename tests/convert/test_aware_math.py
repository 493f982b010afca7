"""The merge maths on explicit weights: exact where the heads are related by foldable maps."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvtool.convert.aware.attention import LayerInputs, Proj, apply_rope, head_contexts  # noqa: E402
from kvtool.convert.aware.merge import MergeSettings, merge_layer  # noqa: E402

H, KV, HD, D, B, T = 4, 2, 8, 24, 2, 32


def _inputs(rotary=HD, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    inv = 1.0 / (100.0 ** (torch.arange(0, rotary, 2, dtype=torch.float64) / max(rotary, 1)))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat((ang, ang), dim=-1)
    return LayerInputs(x, emb.cos().expand(B, -1, -1), emb.sin().expand(B, -1, -1), HD ** -0.5), g


def _complex_scale(k_rows, coef, rotary):
    """Scale each rotate_half pair (i, i + r/2) of one head's rows by a complex number."""
    P = rotary // 2
    z = torch.complex(k_rows[:P], k_rows[P:2 * P]) * coef[:, None]
    return torch.cat((z.real, z.imag, k_rows[2 * P:]))


@pytest.mark.parametrize("rotary", [HD, HD // 2, 0])  # full, partial and no RoPE
def test_heads_related_by_foldable_maps_merge_exactly(rotary):
    inp, g = _inputs(rotary)
    q = torch.randn(H * HD, D, generator=g, dtype=torch.float64)
    o = torch.randn(D, H * HD, generator=g, dtype=torch.float64)
    k0 = torch.randn(HD, D, generator=g, dtype=torch.float64)
    v0 = torch.randn(HD, D, generator=g, dtype=torch.float64)
    coef = torch.randn(rotary // 2, generator=g, dtype=torch.complex128)
    k1 = _complex_scale(k0, coef, rotary)
    k1[rotary:] = torch.randn(HD - rotary, HD - rotary, generator=g, dtype=torch.float64) @ k0[rotary:]
    v1 = torch.randn(HD, HD, generator=g, dtype=torch.float64) @ v0  # any invertible map folds into o
    src = Proj(q, torch.cat((k0, k1)), torch.cat((v0, v1)), o)
    new, rep = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=None))
    assert new.k.shape == (HD, D) and new.v.shape == (HD, D)
    want = head_contexts(inp, src, H, HD) @ o.T
    got = head_contexts(inp, new.to(torch.float64), H, HD) @ new.o.to(torch.float64).T
    torch.testing.assert_close(got, want, rtol=2e-4, atol=2e-4)
    assert rep.err_merged < 1e-8


def test_complex_scaling_commutes_with_rope():
    inp, g = _inputs()
    k = torch.randn(B, 1, T, HD, generator=g, dtype=torch.float64)
    coef = torch.randn(HD // 2, generator=g, dtype=torch.complex128)

    def scale(t):
        z = torch.complex(t[..., : HD // 2], t[..., HD // 2:]) * coef
        return torch.cat((z.real, z.imag), dim=-1)

    torch.testing.assert_close(apply_rope(scale(k), inp.cos, inp.sin), scale(apply_rope(k, inp.cos, inp.sin)))


def test_o_refit_and_unrelated_heads_reduce_error():
    inp, g = _inputs()
    src = Proj(*(torch.randn(s, generator=g, dtype=torch.float64) * 0.3 for s in
                 ((H * HD, D), (KV * HD, D), (KV * HD, D), (D, H * HD))))
    _, folded = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=None))
    _, refit = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=2.0))
    assert 0 < refit.err_final < folded.err_final < 1.5


def test_refinement_lowers_the_calibration_loss_with_shared_positions():
    from kvtool.convert.aware.refine import refine

    inp, g = _inputs()
    inp = LayerInputs(inp.x.float(), inp.cos[:1].float(), inp.sin[:1].float(), inp.scaling)  # batch-1 cos/sin
    src = Proj(*(torch.randn(s, generator=g) * 0.3 for s in ((H * HD, D), (KV * HD, D), (KV * HD, D), (D, H * HD))))
    start, _ = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=None))
    target = head_contexts(inp, src, H, HD) @ src.o.T
    new, before, after = refine(inp, start, target, num_heads=H, head_dim=HD, steps=30)
    assert after < before and new.k.shape == start.k.shape


def _refine_case(batch=4, seed=0):
    inp, g = _inputs(seed=seed)
    x = torch.randn(batch, T, D, generator=g, dtype=torch.float64).float()
    inp = LayerInputs(x, inp.cos[:1].float(), inp.sin[:1].float(), inp.scaling)
    src = Proj(*(torch.randn(s, generator=g) * 0.3 for s in ((H * HD, D), (KV * HD, D), (KV * HD, D), (D, H * HD))))
    start, _ = merge_layer(inp, src, MergeSettings(H, KV, 1, HD, o_ridge=None))
    return inp, start, head_contexts(inp, src, H, HD) @ src.o.T


def test_held_out_sequences_are_not_trained_on():
    from kvtool.convert.aware.refine import refine

    inp, start, target = _refine_case()
    stats: dict = {}
    held_out, _, _ = refine(inp, start, target, num_heads=H, head_dim=HD, steps=6, holdout_every=2, check_every=6,
                            stats=stats)
    train = LayerInputs(inp.x[[0, 2]], inp.cos, inp.sin, inp.scaling)  # rows 1 and 3 are held out
    plain, _, _ = refine(train, start, target[[0, 2]], num_heads=H, head_dim=HD, steps=6)
    if stats["best_step"] == 6:
        assert torch.allclose(held_out.k, plain.k) and torch.allclose(held_out.q, plain.q)
    else:  # the steps did not help the held-out rows: the start comes back
        assert stats["best_step"] == 0 and torch.equal(held_out.k, start.k)
    assert stats["holdout_best"] <= stats["holdout_start"]


def test_early_stopping_keeps_the_best_held_out_step():
    from kvtool.convert.aware.refine import refine

    inp, start, target = _refine_case()
    stats: dict = {}
    # a step size that overshoots: the held-out loss rises, and the start (or an early check) is kept
    new, before, after = refine(inp, start, target, num_heads=H, head_dim=HD, steps=24, lr=3.0, holdout_every=2,
                                check_every=4, stats=stats)
    assert stats["holdout_best"] <= stats["holdout_start"] and stats["best_step"] < 24
    ok, _, _ = refine(inp, start, target, num_heads=H, head_dim=HD, steps=24, holdout_every=2, check_every=4,
                      stats=(good := {}))
    assert good["best_step"] > 0 and good["holdout_best"] < good["holdout_start"]


def test_covariance_shrinkage_is_the_mixture_with_an_isotropic_prior():
    from kvtool.convert.aware.linalg import augmented_covariance, shrink_covariance

    g = torch.Generator().manual_seed(3)
    x = torch.randn(256, D, generator=g, dtype=torch.float64) * torch.linspace(0.01, 3, D, dtype=torch.float64) + 0.5
    cov = augmented_covariance(x)
    assert shrink_covariance(cov, 0.0) is cov
    alpha = 0.25
    s = shrink_covariance(cov, alpha)
    mu = cov[:D, :D].diagonal().mean()
    # E over the mixture (1 - alpha) data + alpha N(0, mu I) of [x, 1][x, 1]^T
    prior = torch.zeros_like(cov)
    prior[:D, :D] = mu * torch.eye(D, dtype=cov.dtype)
    prior[D, D] = 1.0
    assert torch.allclose(s, (1 - alpha) * cov + alpha * prior)
    assert torch.linalg.eigvalsh(s).min() > 0  # still a covariance; directions the data never excites gain weight
    assert torch.linalg.eigvalsh(s[:D, :D]).min() >= alpha * mu * (1 - 1e-9)


def test_shrinkage_reaches_the_layer_merge():
    inp, g = _inputs()
    src = Proj(q=torch.randn(H * HD, D, generator=g, dtype=torch.float64),
               k=torch.randn(KV * HD, D, generator=g, dtype=torch.float64),
               v=torch.randn(KV * HD, D, generator=g, dtype=torch.float64),
               o=torch.randn(D, H * HD, generator=g, dtype=torch.float64))
    base = MergeSettings(num_heads=H, num_kv_heads=KV, target_kv_heads=1, head_dim=HD, o_ridge=None)
    plain, _ = merge_layer(inp, src, base)
    shrunk, _ = merge_layer(inp, src, MergeSettings(**{**vars(base), "cov_shrink": 0.5}))
    assert not torch.allclose(plain.k, shrunk.k)


def test_refinement_regularised_toward_the_merge_stays_closer_to_it():
    from kvtool.convert.aware.refine import refine

    inp, start, target = _refine_case()

    def distance(p):
        return sum(float((getattr(p, f) - getattr(start, f)).pow(2).sum() / getattr(start, f).pow(2).sum())
                   for f in ("q", "k", "v", "o"))

    free, before, after_free = refine(inp, start, target, num_heads=H, head_dim=HD, steps=30)
    pulled, _, after_pulled = refine(inp, start, target, num_heads=H, head_dim=HD, steps=30, reg=10.0)
    assert after_free < before and after_pulled < before
    assert distance(pulled) < 0.5 * distance(free)
    assert after_free <= after_pulled  # the pull costs calibration fit, which is what it is for


@pytest.mark.parametrize("value", [-1, "x", True])
def test_refine_reg_refusals(value):
    from kvtool.convert.aware.method import AwareMerge
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="refine_reg must be a number >= 0"):
        AwareMerge(refine_reg=value)
