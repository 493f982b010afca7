"""Quality gates: thresholds as data, each knowing whether lower or higher is better."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from kvtool.errors import UsageError
from kvtool.registry import Registry


@dataclass(frozen=True)
class Gate:
    option: str  # the options field that sets it (kvtool/options/eval.py), e.g. max_kld
    metric: str  # name in the report
    better: str  # "lower" | "higher"
    value: Callable[[dict], float]  # the measured value from a report summary
    fmt: Callable[[float], str]
    se_key: str  # its standard error in the summary (shown next to the value)

    @property
    def flag(self) -> str:
        """How reports name the gate: its CLI flag, e.g. --max-kld."""
        return "--" + self.option.replace("_", "-")


GATES: Registry[Gate] = Registry("gate")
for _gate in (
    Gate("max_ppl_increase", "ppl_increase", "lower", lambda s: s["ppl_ratio"] - 1.0, lambda x: f"{x * 100:+.2f}%",
         "ppl_ratio_se"),
    Gate("max_kld", "kld_mean", "lower", lambda s: s["kld_mean"], lambda x: f"{x:.5f}", "kld_se"),
    Gate("min_top1", "top1_agreement", "higher", lambda s: s["top1_agreement"], lambda x: f"{x:.4f}",
         "top1_se"),
):
    GATES.add(_gate.option, _gate)
del _gate


@dataclass(frozen=True)
class GateResult:
    option: str  # the options field, e.g. max_kld
    metric: str
    limit: float
    value: float
    passed: bool
    se: float | None = None  # standard error of value (None: unknown)

    @property
    def flag(self) -> str:
        return GATES[self.option].flag

    def line(self) -> str:
        g = GATES[self.option]
        op = "<=" if g.better == "lower" else ">="
        verdict = "ok" if self.passed else "FAILED"
        se = "" if self.se is None or math.isnan(self.se) else f" (SE {g.fmt(self.se).lstrip('+')})"
        return f"{self.metric} {g.fmt(self.value)}{se} {op} {g.fmt(self.limit)} ({g.flag}): {verdict}"

    def as_dict(self) -> dict:
        return {"option": self.flag, "metric": self.metric, "limit": self.limit, "value": self.value,
                "se": self.se, "passed": self.passed}


def parse_limits(max_ppl_increase: str | float | None = None, max_kld: float | None = None,
                 min_top1: float | None = None) -> dict[str, float]:
    """{field: limit} for the gates given (None: not gated), each refused by its field when it is no limit:
    what `kvtool eval`, `kvtool convert --eval` and a recipe's eval thresholds all accept."""
    from kvtool.units import gate_threshold, parse_percent

    limits: dict[str, float] = {}
    if max_ppl_increase is not None:
        try:
            limits["max_ppl_increase"] = parse_percent(max_ppl_increase)
        except ValueError as exc:
            raise UsageError(str(exc), option="max_ppl_increase") from None
    if max_kld is not None:
        try:
            limits["max_kld"] = gate_threshold(float(max_kld))
        except ValueError as exc:
            raise UsageError(str(exc), option="max_kld") from None
    if min_top1 is not None:
        if not 0.0 <= min_top1 <= 1.0:
            raise UsageError(f"must be between 0 and 1, got {min_top1}", option="min_top1")
        limits["min_top1"] = min_top1
    return limits


def check(summary: dict, limits: dict[str, float]) -> list[GateResult]:
    """Apply {field: limit} (e.g. {"max_kld": 0.01}); a NaN value fails. Relative gates need a baseline."""
    results = []
    for option, limit in limits.items():
        if option not in GATES:
            raise UsageError(f"unknown gate; known: {', '.join(GATES)}", option=option)
        g = GATES[option]
        if "ppl_ratio" not in summary:
            raise UsageError("compares against a baseline; give --baseline", option=option)
        value = g.value(summary)
        ok = not math.isnan(value) and (value <= limit if g.better == "lower" else value >= limit)
        se = summary.get(g.se_key)
        results.append(GateResult(option, g.metric, limit, value, ok, se if isinstance(se, (int, float)) else None))
    return results
