"""Running sums of the per-token quality metrics and their summary, torch-free: the local path
(kvtool.eval.metrics, torch tensors) and the served path (kvtool.eval.served, numpy arrays from log-probabilities
a server returns) add to the same sums, so their figures and standard errors are computed by one code.

Standard errors treat tokens as independent (sqrt(var / n); the delta method for PPL and the ratio), as llama.cpp's
perplexity tool does; neighbouring tokens are correlated, so they are a lower bound on the real uncertainty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np


@dataclass
class Moments:
    """Running count, sum and sum of squares in float64. A torch tensor's sums stay on its device until read (no
    host sync per window); a numpy array or a list is summed on the host."""

    n: int = 0
    _s: object = 0.0
    _ss: object = 0.0

    def add(self, x) -> None:
        if hasattr(x, "detach"):  # torch, without importing it here
            x = x.detach().double()
            self.n += x.numel()
        else:
            x = np.asarray(x, dtype=np.float64)
            self.n += x.size
        self._s = self._s + x.sum()
        self._ss = self._ss + (x * x).sum()

    @property
    def s(self) -> float:
        return float(self._s)

    @property
    def ss(self) -> float:
        return float(self._ss)

    @property
    def mean(self) -> float:
        return self.s / self.n if self.n else float("nan")

    @property
    def rms(self) -> float:
        return math.sqrt(self.ss / self.n) if self.n else float("nan")

    @property
    def se(self) -> float:
        """Standard error of the mean."""
        if self.n < 2:
            return float("nan")
        var = max(self.ss / self.n - self.mean ** 2, 0.0) * self.n / (self.n - 1)
        return math.sqrt(var / self.n)


@dataclass
class Sums:
    """Sums for one candidate (and, when given, its comparison with the baseline); `summary` reads them."""

    nll: Moments = field(default_factory=Moments)
    base_nll: Moments = field(default_factory=Moments)
    diff: Moments = field(default_factory=Moments)
    kld: Moments = field(default_factory=Moments)
    top1: Moments = field(default_factory=Moments)
    dp: Moments = field(default_factory=Moments)

    @property
    def has_baseline(self) -> bool:
        return self.base_nll.n > 0

    def summary(self) -> dict:
        """The metrics as plain floats (the comparison's keys are absent without a baseline)."""
        n = self.nll.n
        ppl = math.exp(self.nll.mean) if n else float("nan")
        out = {"tokens": n, "ppl": ppl, "ppl_se": ppl * self.nll.se, "nll_mean": self.nll.mean}
        if not self.has_baseline:
            return out
        base_ppl = math.exp(self.base_nll.mean)
        ratio = math.exp(self.diff.mean)
        p = self.top1.mean
        out.update({
            "baseline_ppl": base_ppl,
            "baseline_ppl_se": base_ppl * self.base_nll.se,
            "ppl_ratio": ratio,
            "ppl_ratio_se": ratio * self.diff.se,
            "log_ppl_ratio": self.diff.mean,
            "log_ppl_ratio_se": self.diff.se,
            "kld_mean": self.kld.mean,
            "kld_se": self.kld.se,
            "top1_agreement": p,
            "top1_se": math.sqrt(p * (1 - p) / n) if n else float("nan"),
            "dp_mean": self.dp.mean,
            "dp_rms": self.dp.rms,
            "dp_se": self.dp.se,
        })
        return out
