"""Per-token quality metrics accumulated window by window (logits are never kept for the stream).

For each scored token t with baseline log-probs b and candidate log-probs c over the vocabulary:
  nll_c = -c[y], nll_b = -b[y]                    PPL = exp(mean nll)  (sum over tokens / count)
  d = nll_c - nll_b                               log PPL ratio = mean d; PPL ratio = exp(mean d)
  kl = sum_v exp(b_v) (b_v - c_v)                 KL(baseline || candidate), nats per token
  top1 = argmax b == argmax c
  dp = exp(c[y]) - exp(b[y])                      change in the probability of the correct token
Standard errors treat tokens as independent (sqrt(var / n); the delta method for PPL and the
ratio), as llama.cpp's perplexity tool does; neighbouring tokens are correlated, so they are a
lower bound on the real uncertainty.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

# Bound the float32 temporaries of one chunk (tokens x vocabulary) to ~64M elements.
_CHUNK_ELEMENTS = 64 * 2**20


@dataclass
class Moments:
    """Running count, sum and sum of squares (float64; sums stay on the device until read)."""

    n: int = 0
    _s: object = 0.0
    _ss: object = 0.0

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().to(torch.float64)
        self.n += x.numel()
        self._s = self._s + x.sum()  # no host sync per window
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
class Accumulator:
    """Sums for one candidate (and, when given, its comparison with the baseline)."""

    nll: Moments = field(default_factory=Moments)
    base_nll: Moments = field(default_factory=Moments)
    diff: Moments = field(default_factory=Moments)
    kld: Moments = field(default_factory=Moments)
    top1: Moments = field(default_factory=Moments)
    dp: Moments = field(default_factory=Moments)

    @property
    def has_baseline(self) -> bool:
        return self.base_nll.n > 0

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base_logits: torch.Tensor | None = None) -> None:
        """logits / base_logits: [..., V] predicting targets [...] (same leading shape)."""
        v = logits.shape[-1]
        logits = logits.reshape(-1, v)
        targets = targets.reshape(-1).to(logits.device)
        if targets.shape[0] != logits.shape[0]:  # gather would silently score the first rows only
            raise ValueError(f"{logits.shape[0]} rows of logits for {targets.shape[0]} targets")
        if base_logits is not None:
            if base_logits.shape[-1] != v:
                raise ValueError(f"baseline logits have {base_logits.shape[-1]} classes, candidate {v}")
            base_logits = base_logits.reshape(-1, v).to(logits.device)
        step = max(1, _CHUNK_ELEMENTS // v)
        for i in range(0, logits.shape[0], step):
            sl = slice(i, i + step)
            self._add_chunk(logits[sl], targets[sl], None if base_logits is None else base_logits[sl])

    def _add_chunk(self, logits, targets, base_logits) -> None:
        c = torch.log_softmax(logits.float(), dim=-1)
        lc = c.gather(-1, targets[:, None])[:, 0]
        self.nll.add(-lc)
        if base_logits is None:
            return
        b = torch.log_softmax(base_logits.float(), dim=-1)
        lb = b.gather(-1, targets[:, None])[:, 0]
        self.base_nll.add(-lb)
        self.diff.add(lb - lc)
        # clamp: rounding can make a per-token KL of identical distributions -1e-9
        self.kld.add((b.exp() * (b - c)).sum(-1).clamp_min(0.0))
        self.top1.add((b.argmax(-1) == c.argmax(-1)).to(torch.float64))
        self.dp.add(lc.exp() - lb.exp())

    def summary(self) -> dict:
        """The metrics as plain floats (NaN-free keys are absent without a baseline)."""
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
