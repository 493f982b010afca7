"""Per-token quality metrics accumulated window by window (logits are never kept for the stream).

For each scored token t with baseline log-probs b and candidate log-probs c over the vocabulary:
  nll_c = -c[y], nll_b = -b[y]                    PPL = exp(mean nll)  (sum over tokens / count)
  d = nll_c - nll_b                               log PPL ratio = mean d; PPL ratio = exp(mean d)
  kl = sum_v exp(b_v) (b_v - c_v)                 KL(baseline || candidate), nats per token
  top1 = argmax b == argmax c
  dp = exp(c[y]) - exp(b[y])                      change in the probability of the correct token
The sums and their summary (standard errors included) are kvtool.eval.sums, shared with the served path.
"""

from __future__ import annotations

import torch

from kvtool.eval.sums import Moments, Sums

__all__ = ["Accumulator", "Moments"]

# Bound the float32 temporaries of one chunk (tokens x vocabulary) to ~64M elements.
_CHUNK_ELEMENTS = 64 * 2**20


class Accumulator(Sums):
    """Sums for one candidate (and, when given, its comparison with the baseline) from full logits."""

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
        self._add_terms(logits, targets, None if base_logits is None else _base_terms(base_logits, targets))

    def _add_terms(self, logits, targets, base: "tuple | None") -> None:
        c = torch.log_softmax(logits.float(), dim=-1)
        lc = c.gather(-1, targets[:, None])[:, 0]
        self.nll.add(-lc)
        if base is None:
            return
        b, pb, lb, top = base
        self.base_nll.add(-lb)
        self.diff.add(lb - lc)
        # clamp: rounding can make a per-token KL of identical distributions -1e-9
        self.kld.add((pb * (b - c)).sum(-1).clamp_min(0.0))
        self.top1.add((top == c.argmax(-1)).to(torch.float64))
        self.dp.add(lc.exp() - lb.exp())


def _base_terms(base_logits, targets) -> tuple:
    """What every candidate's comparison needs of the baseline: log-probs, probs, the target's, the argmax."""
    b = torch.log_softmax(base_logits.float(), dim=-1)
    return b, b.exp(), b.gather(-1, targets[:, None])[:, 0], b.argmax(-1)


def add_many(accs: list, logits: list, targets: torch.Tensor, base_logits: torch.Tensor) -> None:
    """Several candidates against one baseline on the same targets (`eval --kv-sweep`): Accumulator.add for each,
    the baseline's terms computed once per chunk instead of once per candidate (the same arithmetic)."""
    v = base_logits.shape[-1]
    base_logits = base_logits.reshape(-1, v)
    targets = targets.reshape(-1).to(base_logits.device)
    flat = [x.reshape(-1, v) for x in logits]
    for x in flat:
        if x.shape[0] != targets.shape[0]:
            raise ValueError(f"{x.shape[0]} rows of logits for {targets.shape[0]} targets")
    step = max(1, _CHUNK_ELEMENTS // v)
    for i in range(0, targets.shape[0], step):
        sl = slice(i, i + step)
        base = _base_terms(base_logits[sl], targets[sl])
        for acc, x in zip(accs, flat):
            acc._add_terms(x[sl].to(base_logits.device), targets[sl], base)
