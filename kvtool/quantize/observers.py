"""Observers: what turns the K or V tensors one layer wrote into its cache into an FP8 scale.

One registry (`OBSERVERS`, kvtool.quantize.observer_specs: the spec check, torch-free); the built-ins below are
declared there by class name, an extension registers with `@register(name)`; looked up with
`make_observer("name[:arg]", ...)`, as llm-compressor registers its observers. Each observer sees every
calibration batch of one layer and one role (K or V), shaped [batch, kv_heads, seq, head_dim], and returns a float32 scale of
shape [1] (strategy "tensor") or [kv_heads] (strategy "attn_head").

- `absmax[:H]`: running maximum of |x| over all batches (not the last batch, not an average);
  scale = H * amax / fmax. H (headroom, default 1) leaves room for values the calibration text
  never produced: FP8 is a floating-point format, so headroom costs resolution only for values
  below fmax's subnormal limit (amax * H / 28672 for e4m3), while a value above the calibrated
  range is clipped.
- `absmax-pow2[:H]` (the default, H = 2): H * amax / fmax rounded up to a power of two. e4m3
  has 3 mantissa bits, so for every value in its normal range the relative rounding error does not
  depend on the scale; a power-of-two scale s only moves the exponent window: x / s is exact and
  every value that is a normal FP8 number under scale 1.0 rounds exactly as under 1.0, values below
  2^-6 get a finer grid, and nothing up to H..2H times the calibrated maximum is clipped. Pointwise
  its error is never larger than scale 1.0's there, and it equals the error of e4m3 rounding with an
  unbounded exponent (the floor of any static scale) on all but a few tenths of a percent of the
  values. With s > 1 (K/V beyond 448 / H) it stops the clipping that scale 1.0 would do.
- `attn-out[:H]`: output-aware. Candidates H * amax / fmax * 2^(j/8), j = 0..7 (the eight grid
  offsets of one octave) after absmax-pow2:H's power of two; calibrate() reruns the layer's
  attention on the calibration inputs with each candidate and keeps the one whose attention output
  is closest to the unquantized one (K first, then V with K at its choice). Same headroom as
  absmax-pow2:H. About 18 attention reruns per layer. Offered, not the default: it lowers the
  attention-output error (SmolLM2: median 9% for K, 1% for V) and Gemma-3's KLD by 11% over 4092
  held-out tokens (2.5 SE), not SmolLM2's beyond noise, and its PPL is within noise of scale 1.0
  on both (docs/quantize-kv.md).
- `percentile:P`: the P-th percentile of |x| (clips the top 100-P percent on purpose).
- `mse`: the scale, among amax/fmax shrunk by 0..79 %, that minimises the squared FP8
  quantization error on the calibration values (it clips: higher PPL and KLD than scale 1.0 on
  SmolLM2).

Measured (docs/quantize-kv.md; bench/quantize_kv_quality.py): what separates observers
is clipping; observers that clip nothing are statistically indistinguishable from each other and
from scale 1.0, because e4m3's 3-bit mantissa sets the error, not the scale.

Observers that need the values keep them for one layer only (calibration runs layer by layer).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtool.quantize.formats import Fp8Format, roundtrip
from kvtool.quantize.observer_specs import (DEFAULT_OBSERVER, OBSERVERS, ObserverEntry, canonical,  # noqa: F401
                                            declare, parse_spec, usage)


class Observer:
    """Base: keeps the running per-head maximum of |x|; subclasses decide the scale."""

    name = ""
    output_aware = False  # True: calibrate() tries candidates() on the layer and calls choose()

    def __init__(self, num_heads: int, per_head: bool, fmt: Fp8Format, arg: float | None = None):
        self.num_heads = num_heads
        self.per_head = per_head
        self.fmt = fmt
        self.arg = arg
        self.amax_heads: torch.Tensor | None = None  # [heads], float32
        self.batches = 0
        self.values = 0

    def update(self, x: torch.Tensor) -> None:
        if x.dim() != 4 or x.shape[1] != self.num_heads:
            raise ValueError(f"observer expects [batch, {self.num_heads}, seq, head_dim], got {list(x.shape)}")
        a = x.detach().abs().amax(dim=(0, 2, 3)).float()
        self.amax_heads = a if self.amax_heads is None else torch.maximum(self.amax_heads, a)
        self.batches += 1
        self.values += x.numel()
        self._keep(x)

    def _keep(self, x: torch.Tensor) -> None:
        """Subclasses that need the values store them here."""

    def amax(self) -> torch.Tensor:
        """Observed maximum of |x|: [heads] or [1]."""
        if self.amax_heads is None:
            raise RuntimeError("observer saw no data")
        return self.amax_heads if self.per_head else self.amax_heads.max().reshape(1)

    def scale(self) -> torch.Tensor:
        return _finite_positive(self._scale())

    def _scale(self) -> torch.Tensor:
        raise NotImplementedError

    def candidates(self) -> torch.Tensor:
        """Output-aware observers: [n, groups] scales for calibrate() to try, the preferred one first."""
        raise NotImplementedError

    def choose(self, errors: torch.Tensor) -> None:
        """Output-aware observers: errors[n] of the layer's attention output, one per candidate."""
        raise NotImplementedError


def _finite_positive(s: torch.Tensor) -> torch.Tensor:
    # a head that only ever wrote zeros gets scale 1.0 (vLLM's default): any positive value round-trips 0 exactly
    s = s.detach().float().cpu()
    return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))


def register(name: str, *, arg: str | None = None, default: float | None = None,
             check: Callable[[float], bool] | None = None, help: str = ""):
    """Class decorator: make an observer available as --observer NAME[:ARG]."""

    def deco(cls):
        declare(name, cls, arg=arg, default=default, check=check, help=help)
        cls.name = name
        return cls

    return deco


def make_observer(spec: str, *, num_heads: int, per_head: bool, fmt: Fp8Format) -> Observer:
    entry, value = parse_spec(spec)
    return entry.cls(num_heads, per_head, fmt, value)


# --- observers -------------------------------------------------------------------------------
class AbsMaxObserver(Observer):
    name = "absmax"
    def _scale(self) -> torch.Tensor:
        return self.amax() * float(self.arg or 1.0) / self.fmt.max


class AbsMaxPow2Observer(Observer):
    name = "absmax-pow2"
    def _scale(self) -> torch.Tensor:
        s = self.amax() * float(self.arg or 2.0) / self.fmt.max
        return torch.exp2(torch.ceil(torch.log2(s.clamp_min(torch.finfo(torch.float32).tiny))))


class _ValuesObserver(Observer):
    """Keeps |x| per head for the current layer (the calibration holds one layer at a time)."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self._chunks: list[torch.Tensor] = []

    def _keep(self, x: torch.Tensor) -> None:
        # [heads, n]: per head, every value this layer wrote
        self._chunks.append(x.detach().abs().float().transpose(0, 1).reshape(self.num_heads, -1))

    def groups(self) -> torch.Tensor:
        """[groups, n]: one row per head (attn_head) or one row for the whole tensor."""
        v = torch.cat(self._chunks, dim=1)
        return v if self.per_head else v.reshape(1, -1)


class PercentileObserver(_ValuesObserver):
    name = "percentile"
    def _scale(self) -> torch.Tensor:
        v = self.groups()
        n = v.shape[1]
        k = min(n, max(1, int(round(float(self.arg) / 100.0 * n))))
        # kthvalue, not quantile: torch.quantile refuses inputs above 16M values
        return v.kthvalue(k, dim=1).values / self.fmt.max


class MseObserver(_ValuesObserver):
    name = "mse"
    SHRINK = torch.arange(0, 80) / 100.0  # candidate scales amax/fmax * (1 - shrink)

    def _scale(self) -> torch.Tensor:
        v = self.groups()
        base = v.amax(dim=1) / self.fmt.max  # [groups]
        best_err = torch.full_like(base, float("inf"))
        best = base.clone()
        for f in (1.0 - self.SHRINK).tolist():
            s = (base * f).clamp_min(torch.finfo(torch.float32).tiny)[:, None]
            err = (roundtrip(v, s, self.fmt) - v).pow_(2).sum(dim=1)
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best = torch.where(better, s[:, 0], best)
        return best


class AttentionOutputObserver(Observer):
    name = "attn-out"
    """Picks the FP8 grid by the layer's attention output: candidates H * amax / fmax * 2^(j/8),
    j = 0..7 (eight offsets of e4m3's grid within one octave), after the power of two absmax-pow2:H
    takes (tried first, so it wins ties). Every candidate keeps the headroom: nothing up to H times
    the calibrated maximum is clipped. Per-head scales (attn_head) share the offset j of a layer."""

    output_aware = True
    OFFSETS = 8

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.chosen: torch.Tensor | None = None
        self.errors: torch.Tensor | None = None

    def candidates(self) -> torch.Tensor:
        base = _finite_positive(self.amax() * float(self.arg or 2.0) / self.fmt.max)
        pow2 = torch.exp2(torch.ceil(torch.log2(base)))
        steps = torch.exp2(torch.arange(self.OFFSETS, dtype=torch.float32) / self.OFFSETS)
        return torch.cat([pow2[None], base[None] * steps[:, None]])

    def choose(self, errors: torch.Tensor) -> None:
        cands = self.candidates()
        if errors.shape != (cands.shape[0],):
            raise ValueError(f"expected {cands.shape[0]} errors, got {list(errors.shape)}")
        self.errors = errors
        self.chosen = cands[int(torch.argmin(errors))]  # argmin: the first minimum, so pow2 on ties

    def _scale(self) -> torch.Tensor:
        return self.chosen if self.chosen is not None else self.candidates()[0]
