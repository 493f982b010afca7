"""KL divergence, top-1 agreement and the other comparisons from the top-k log-probabilities a server returns
(torch-free). The estimator, stated once (docs/eval.md repeats it with its measured bias):

For one position, the baseline returns probabilities p_v for the tokens v in B (its top k and the target) and the
candidate q_v for C (its top k and the target). The vocabulary is coarsened to B plus one "rest" bucket:

    q^_v   = q_v                                   v in B and C
           = min(q_(k), (1 - sum_C q) / |B \\ C|)   v in B, not in C (q_(k): the candidate's k-th largest)
    p_rest = 1 - sum_B p_v,   q^_rest = 1 - sum_B q^_v
    KL^    = sum_B p_v log(p_v / q^_v) + p_rest log(p_rest / q^_rest)

With C containing B this is the KL divergence of the coarsened distributions, a lower bound of the full one (the
data-processing inequality); a token missing from C gets the most mass it can have, which also errs low. So KL^
is biased low; its bias against the full-vocabulary KL is measured on the local path (bench/topk_kld_bias.py).
Top-1 agreement compares the largest entry of each side (exact whenever k >= 1); the NLL, the PPL ratio and the
change in p(correct) use the target's own log-probability, which both sides return: exact.
"""

from __future__ import annotations

import math
from typing import Mapping

import numpy as np

TINY = 1e-30


def kth_largest(top: Mapping[str, float], k: int) -> float:
    """The k-th largest log-probability in `top` (its smallest when it has fewer): no token outside `top` can have
    more."""
    values = sorted(top.values(), reverse=True)
    return values[min(k, len(values)) - 1]


def kld(base: Mapping[str, float], cand: Mapping[str, float], k: int) -> float:
    """KL^(baseline || candidate) of one position from the log-probabilities each side returned (the estimator in
    the module docstring), in nats, >= 0."""
    keys = list(base)
    p = np.exp(np.array([base[v] for v in keys], dtype=np.float64))
    missing = [i for i, v in enumerate(keys) if v not in cand]
    # the same exp as p's: identical answers give exactly 0
    q = np.exp(np.array([cand.get(v, -np.inf) for v in keys], dtype=np.float64))
    if missing:
        left = max(1.0 - float(np.exp(np.array(list(cand.values()), dtype=np.float64)).sum()), 0.0)
        q[missing] = min(math.exp(kth_largest(cand, k)), left / len(missing))
    q = np.maximum(q, TINY)
    p_rest = max(1.0 - float(p.sum()), 0.0)
    q_rest = max(1.0 - float(q.sum()), TINY)
    out = float((p * (np.log(np.maximum(p, TINY)) - np.log(q))).sum())
    if p_rest > 0:
        out += p_rest * (math.log(p_rest) - math.log(q_rest))
    return max(out, 0.0)


def top1(top: Mapping[str, float]) -> str:
    return max(top, key=top.__getitem__)


def truncate(logprobs, target: int, k: int) -> dict[str, float]:
    """What a server returns for one position of a full log-probability vector: its top k and the target, keyed
    like kvtool.eval.protocol ("id:N"); the local path's top-k figures for the bias measurement."""
    from kvtool.eval.protocol import id_key

    lp = np.asarray(logprobs, dtype=np.float64)
    idx = np.argpartition(-lp, k - 1)[:k] if k < lp.size else np.arange(lp.size)
    out = {id_key(int(i)): float(lp[i]) for i in idx}
    out[id_key(target)] = float(lp[target])
    return out
