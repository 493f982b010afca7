"""Gates: thresholds as data; lower-is-better and higher-is-better both understood."""

from __future__ import annotations

import math

import pytest

from kvtool.errors import UsageError
from kvtool.eval.gate import GATES, check

SUMMARY = {"ppl": 10.3, "baseline_ppl": 10.0, "ppl_ratio": 1.03, "kld_mean": 0.02, "top1_agreement": 0.93}


@pytest.mark.parametrize("option,limit,passed", [
    ("max_ppl_increase", 0.02, False), ("max_ppl_increase", 0.05, True),
    ("max_kld", 0.01, False), ("max_kld", 0.02, True),
    ("min_top1", 0.95, False), ("min_top1", 0.93, True),
])
def test_each_gate_direction(option, limit, passed):
    (r,) = check(SUMMARY, {option: limit})
    assert r.passed is passed and r.option == option and r.metric == GATES[option].metric
    flag = "--" + option.replace("_", "-")  # keyed by field, shown by flag
    assert ("FAILED" in r.line()) is (not passed) and f"({flag})" in r.line() and r.as_dict()["option"] == flag


def test_ppl_increase_is_relative():
    (r,) = check(SUMMARY, {"max_ppl_increase": 0.02})
    assert r.value == pytest.approx(0.03)


def test_nan_fails():
    (r,) = check({**SUMMARY, "kld_mean": math.nan}, {"max_kld": 1.0})
    assert not r.passed


def test_relative_gate_needs_baseline():
    with pytest.raises(UsageError):
        check({"ppl": 10.0}, {"max_kld": 0.1})


def test_unknown_gate():
    with pytest.raises(UsageError):
        check(SUMMARY, {"max_foo": 1.0})
