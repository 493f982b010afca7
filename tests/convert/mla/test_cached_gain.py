"""kvtool.convert.mla.solve.cached_gain: the cached latent's dims share one scale, and the model is unchanged."""

from __future__ import annotations

import torch

from kvtool.convert.mla.solve import cached_gain


def _latent(n: int = 4096, rank: int = 16) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    c = 0.05 * torch.randn(n, rank, generator=g, dtype=torch.float64)
    c[:, -1] = 30.0 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)  # the near-constant dimension
    c[:, 3] = 0.0  # a spare dimension the solve left empty
    return c


def _fp8_error(cached: torch.Tensor, scale: float) -> float:
    """Relative error of the small dims cached as e4m3 with one scale (vLLM's fp8 latent cache; 1.0 by default)."""
    back = (cached / scale).to(torch.float8_e4m3fn).to(torch.float64) * scale
    small = cached[:, :-1]
    return float((back[:, :-1] - small).norm() / small.norm())


def test_the_gain_is_exact_and_puts_every_live_dim_at_unit_rms():
    c = _latent()
    gain = cached_gain(c)
    b = torch.randn(40, c.shape[1], dtype=torch.float64)
    assert torch.allclose((c * gain) @ (b / gain).T, c @ b.T, rtol=1e-12, atol=1e-9)
    rms = (c * gain).pow(2).mean(0).sqrt()
    live = torch.ones(c.shape[1], dtype=torch.bool)
    live[3] = False
    assert torch.allclose(rms[live], torch.ones(int(live.sum()), dtype=torch.float64))
    assert gain[3] == 1.0


def test_under_vllms_default_fp8_scale_the_gain_keeps_small_dims_out_of_the_subnormals():
    c = _latent()
    c[:, :-1] *= 0.2  # RMS 0.01 beside a dimension near 30
    with_gain = c * cached_gain(c)
    assert _fp8_error(with_gain, 1.0) < 0.03 < 0.05 < _fp8_error(c, 1.0)
    # with an absmax scale e4m3's range holds both anyway: the gain costs nothing there
    assert abs(_fp8_error(with_gain, float(with_gain.abs().max()) / 448) - _fp8_error(c, float(c.abs().max()) / 448)) < 0.005
