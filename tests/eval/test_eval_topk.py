"""The top-k KL estimator (kvtool.eval.topk): exact with the whole vocabulary, a lower bound when the candidate
returned every token the baseline did, zero for identical answers."""

from __future__ import annotations

import math

import numpy as np

from kvtool.eval import topk


def _logsoftmax(x):
    x = x - x.max()
    return x - math.log(np.exp(x).sum())


def _full_kl(b, c):
    return float((np.exp(b) * (b - c)).sum())


def test_whole_vocabulary_gives_the_exact_kl():
    rng = np.random.default_rng(0)
    for _ in range(20):
        b, c = _logsoftmax(rng.normal(size=50)), _logsoftmax(rng.normal(size=50))
        est = topk.kld(topk.truncate(b, 3, 50), topk.truncate(c, 3, 50), 50)
        assert math.isclose(est, _full_kl(b, c), rel_tol=1e-9)


def test_truncated_is_a_lower_bound_when_the_candidate_covers_the_baseline():
    rng = np.random.default_rng(1)
    for _ in range(200):
        b = _logsoftmax(rng.normal(size=200) * 2)
        c = _logsoftmax(b + rng.normal(size=200) * 0.3)
        k = int(rng.integers(1, 20))
        base, cand = topk.truncate(b, 7, k), topk.truncate(c, 7, 200)  # the candidate knows every token
        assert topk.kld(base, cand, 200) <= _full_kl(b, c) + 1e-12


def test_identical_answers_give_zero_and_agree_on_top1():
    rng = np.random.default_rng(2)
    b = _logsoftmax(rng.normal(size=100))
    t = topk.truncate(b, 5, 20)
    assert topk.kld(t, dict(t), 20) == 0.0
    assert topk.top1(t) == f"id:{int(np.argmax(b))}"


def test_a_token_missing_on_the_candidate_side_gets_at_most_its_kth_largest():
    base = {"a": math.log(0.5), "b": math.log(0.3)}
    cand = {"a": math.log(0.6), "c": math.log(0.35)}  # k = 2: b has at most 0.35, and at most 0.05 is left
    # q^(b) = min(0.35, 0.05) = 0.05, rest: p 0.2 vs q 1 - 0.6 - 0.05 = 0.35
    want = 0.5 * math.log(0.5 / 0.6) + 0.3 * math.log(0.3 / 0.05) + 0.2 * math.log(0.2 / 0.35)
    assert math.isclose(topk.kld(base, cand, 2), want, rel_tol=1e-12)
    assert topk.kth_largest(cand, 2) == math.log(0.35) and topk.kth_largest(cand, 5) == math.log(0.35)
