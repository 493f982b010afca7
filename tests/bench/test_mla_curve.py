"""bench/mla_curve.py: the PPL-ratio-against-KV-bytes figure drawn from the rows bench/mla_quality.py writes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from mla_curve import served_by_vllm, texts_of, write_curve_plot  # noqa: E402

from kvtool.errors import InputError, UsageError  # noqa: E402

PNG = b"\x89PNG\r\n\x1a\n"


def _row(label, kind, dims, ratios):
    return {"conversion": label, "kind": kind, "cached_dims": dims, "kv_bytes_per_token": dims * 60,
            **{t: {"ppl_ratio": r, "ppl_ratio_se": 0.05 * (r - 1)} for t, r in ratios.items()}}


DATA = {"title": "synthetic", "rows": [
    _row("original", "merge", 384, {"a": 1.0, "b": 1.0}),
    _row("MLA 128", "mla", 128, {"a": 2.7, "b": 2.5}),
    _row("MLA 256", "mla", 256, {"a": 1.9, "b": 1.7}),
    _row("aware MQA", "merge", 128, {"a": 3.2, "b": 2.7}),
]}


def test_texts_are_those_every_row_has():
    rows = [*DATA["rows"], _row("partial", "mla", 192, {"a": 2.0})]
    assert texts_of(DATA["rows"]) == ["a", "b"]
    assert texts_of(rows) == ["a"]


def test_points_vllm_cannot_serve_are_marked():
    """MLA rows of 128 / 256 values are transformers-only (vLLM 0.33.0 serves 320, 512, 576); merges always count."""
    assert [served_by_vllm(r) for r in DATA["rows"]] == [True, False, False, True]
    assert served_by_vllm(_row("MLA 320", "mla", 320, {"a": 1.5}))
    assert not served_by_vllm(_row("MLA 320", "mla", 320, {"a": 1.5}), release="0.17.0")  # 576 only then


def test_writes_a_png_and_leaves_no_temporary(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "curve.png"
    write_curve_plot(DATA, out)
    assert out.read_bytes()[:8] == PNG
    write_curve_plot(DATA, out)  # redrawn over its own figure
    assert [p.name for p in tmp_path.iterdir()] == ["curve.png"]


def test_refuses_to_write_through_a_link(tmp_path):
    pytest.importorskip("matplotlib")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep")
    (tmp_path / "curve.png").symlink_to(victim)
    with pytest.raises(InputError):
        write_curve_plot(DATA, tmp_path / "curve.png")
    assert victim.read_text() == "keep"


def test_refuses_other_suffixes_and_missing_folders(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(UsageError, match="png"):
        write_curve_plot(DATA, tmp_path / "curve.txt")
    with pytest.raises(InputError, match="folder does not exist"):
        write_curve_plot(DATA, tmp_path / "no" / "curve.png")
    assert list(tmp_path.iterdir()) == []
