"""The quality report says whether the calibrated scales are worse than scale 1.0 beyond noise."""

from __future__ import annotations

from types import SimpleNamespace

from kvtool.quantize.report import versus_scale_one


def _row(label, log_ratio, log_se, kld, kld_se):
    return SimpleNamespace(label=label, metrics={"log_ppl_ratio": log_ratio, "log_ppl_ratio_se": log_se,
                                                 "kld_mean": kld, "kld_se": kld_se})


def _rows(cal_log, cal_kld):
    return [_row("original", 0.0, 0.0, 0.0, 0.0), _row("fp8 scale 1.0", 0.010, 0.002, 0.0100, 0.0003),
            _row("fp8 calibrated (absmax-pow2:2, tensor)", cal_log, 0.002, cal_kld, 0.0003)]


def test_within_two_standard_errors_is_not_worse():
    line = versus_scale_one(_rows(0.0140, 0.0105))  # +0.40% PPL, SE sqrt(2) * 0.2% = 0.28%: 1.4 SE
    assert "not worse than scale 1.0 beyond noise" in line
    assert "PPL +0.40% (SE 0.28)" in line and "KLD +0.00050 (SE 0.00042)" in line


def test_worse_beyond_noise_names_the_metric():
    line = versus_scale_one(_rows(0.0160, 0.0105))  # +0.60% PPL: 2.1 SE
    assert "WORSE than scale 1.0 beyond noise on PPL" in line and "KLD" not in line.split("noise on")[1]
    both = versus_scale_one(_rows(0.0160, 0.0112))
    assert both.endswith("WORSE than scale 1.0 beyond noise on PPL and KLD")


def test_better_is_not_worse_and_missing_rows_give_no_line():
    assert "not worse" in versus_scale_one(_rows(0.002, 0.008))
    assert versus_scale_one(_rows(0.01, 0.01)[:2]) is None
