"""Metric accumulation: checked against direct formulas on random logits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kvtool.eval import metrics
from kvtool.eval.metrics import Accumulator, Moments


def _random(n=300, v=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, v, generator=g) * 3
    cand = base + torch.randn(n, v, generator=g) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    return base, cand, targets


def test_identical_models_give_zero_divergence():
    base, _, y = _random()
    acc = Accumulator()
    acc.add(base, y, base.clone())
    s = acc.summary()
    assert s["kld_mean"] == 0.0 and s["ppl_ratio"] == 1.0 and s["top1_agreement"] == 1.0
    assert s["dp_rms"] == 0.0 and s["ppl"] == s["baseline_ppl"]


def test_against_direct_formulas():
    base, cand, y = _random()
    acc = Accumulator()
    acc.add(cand[:100], y[:100], base[:100])  # two windows: sums, not a mean of window means
    acc.add(cand[100:], y[100:], base[100:])
    s = acc.summary()
    lb, lc = torch.log_softmax(base.double(), -1), torch.log_softmax(cand.double(), -1)
    nll_c = -lc[torch.arange(len(y)), y]
    nll_b = -lb[torch.arange(len(y)), y]
    kl = torch.nn.functional.kl_div(lc, lb, log_target=True, reduction="none").sum(-1)
    assert s["tokens"] == 300
    assert s["ppl"] == pytest.approx(math.exp(nll_c.mean()), rel=1e-5)
    assert s["baseline_ppl"] == pytest.approx(math.exp(nll_b.mean()), rel=1e-5)
    assert s["ppl_ratio"] == pytest.approx(s["ppl"] / s["baseline_ppl"], rel=1e-9)
    assert s["log_ppl_ratio"] == pytest.approx(float((nll_c - nll_b).mean()), rel=1e-5)
    assert s["kld_mean"] == pytest.approx(float(kl.mean()), rel=1e-4)
    agree = (lb.argmax(-1) == lc.argmax(-1)).double().mean()
    assert s["top1_agreement"] == pytest.approx(float(agree))
    assert s["top1_se"] == pytest.approx(math.sqrt(float(agree) * (1 - float(agree)) / 300))
    dp = (-nll_c).exp() - (-nll_b).exp()
    assert s["dp_mean"] == pytest.approx(float(dp.mean()), rel=1e-4, abs=1e-7)
    assert s["dp_rms"] == pytest.approx(float(dp.pow(2).mean().sqrt()), rel=1e-4)
    # delta method: SE(ppl) = ppl * SE(mean nll)
    se_nll = float(nll_c.std(unbiased=True)) / math.sqrt(300)
    assert s["ppl_se"] == pytest.approx(s["ppl"] * se_nll, rel=1e-4)


def test_chunking_does_not_change_results(monkeypatch):
    base, cand, y = _random(n=97, v=40)
    whole = Accumulator()
    whole.add(cand, y, base)
    monkeypatch.setattr(metrics, "_CHUNK_ELEMENTS", 40 * 7)  # 7 tokens per chunk
    chunked = Accumulator()
    chunked.add(cand, y, base)
    for k, v in whole.summary().items():
        assert chunked.summary()[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k


def test_without_baseline_only_ppl():
    _, cand, y = _random()
    acc = Accumulator()
    acc.add(cand, y)
    assert set(acc.summary()) == {"tokens", "ppl", "ppl_se", "nll_mean"}


def test_moments_standard_error():
    x = np.random.default_rng(1).normal(size=1000)
    m = Moments()
    m.add(torch.tensor(x[:400]))
    m.add(torch.tensor(x[400:]))
    assert m.mean == pytest.approx(x.mean())
    assert m.se == pytest.approx(x.std(ddof=1) / math.sqrt(1000), rel=1e-6)
    assert m.rms == pytest.approx(math.sqrt((x ** 2).mean()))
    assert math.isnan(Moments().mean) and math.isnan(Moments().se)


def test_vocab_mismatch_is_refused():
    base, cand, y = _random()
    with pytest.raises(ValueError):
        Accumulator().add(cand, y, base[:, :-1])
