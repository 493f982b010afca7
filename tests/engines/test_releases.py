"""kvtool.engines.releases: requirements, ranges over the known releases, the defaults."""

from __future__ import annotations

import pytest

from kvtool.engines import releases as rel
from kvtool.errors import UsageError


def test_a_pin_checks_that_release_even_when_unlisted() -> None:
    (tf, vllm) = rel.resolve(["transformers==4.44.2", "vllm==0.99.0"], source="--engine")
    assert tf.versions == ("4.44.2",) and vllm.versions == ("0.99.0",)
    assert tf.source == "--engine" and tf.requirement == "transformers==4.44.2"


def test_a_range_checks_every_known_release_inside_it() -> None:
    (tf, _) = rel.resolve(["transformers>=4.45,<5"], source="--engine")
    known = rel.known()["transformers"]
    assert tf.versions == tuple(v for v in known if v.startswith("4.") and (4, 45) <= tuple(map(int, v.split(".")[:2])))
    assert tf.versions[0] == "4.45.0" and tf.versions[-1] == "4.57.6"


def test_two_requirements_of_one_engine_are_joined() -> None:
    (tf, _) = rel.resolve(["transformers==4.44.2", "transformers==5.0.0"], source="pyproject.toml")
    assert tf.versions == ("4.44.2", "5.0.0")


def test_an_engine_not_named_gets_its_default(monkeypatch) -> None:
    monkeypatch.setattr(rel, "installed", lambda engine: "5.24.0" if engine == "transformers" else None)
    (tf, vllm) = rel.resolve(["transformers==4.44.2"], source="--engine")
    assert vllm.versions == (rel.newest("vllm"),) and vllm.source == "newest known"
    assert rel.default("transformers").source == "installed"


def test_installed_reads_package_metadata_without_importing(monkeypatch) -> None:
    import sys

    before = "transformers" in sys.modules
    v = rel.installed("transformers")
    assert ("transformers" in sys.modules) == before
    from importlib import metadata

    try:
        assert v == metadata.version("transformers")
    except metadata.PackageNotFoundError:
        assert v is None


@pytest.mark.parametrize("req,words", [
    ("tensorflow==2.0", "unknown engine"),
    ("transformers>=>4", "invalid version specifier"),
    ("transformers<4.0", "matches no transformers release"),
    ("", "expected ENGINE"),
])
def test_bad_requirements_are_one_line_usage_errors(req: str, words: str) -> None:
    with pytest.raises(UsageError, match=words):
        rel.resolve([req], source="--engine", option="engine")


def test_one_release_refuses_a_range() -> None:
    with pytest.raises(UsageError, match="give one"):
        rel.one_release("vllm>=0.28", "vllm", option="engine")
    assert rel.one_release("vllm==0.28.0", "vllm", option="engine").versions == ("0.28.0",)


def test_one_release_of_refuses_another_engines_requirement_as_itself() -> None:
    # --engine is one list of requirements everywhere; kv-budget follows vLLM: a transformers requirement beside a
    # vLLM one is refused by name, not counted as a second vLLM release
    with pytest.raises(UsageError, match=r"'transformers==5.25.0': this option takes a vllm release"):
        rel.one_release_of(["transformers==5.25.0", "vllm==0.33.0"], "vllm", option="engine")
    with pytest.raises(UsageError, match=r"given 2 times \('vllm==0.32.0', 'vllm==0.33.0'\)"):
        rel.one_release_of(["vllm==0.32.0", "vllm==0.33.0"], "vllm", option="engine")
    assert rel.one_release_of(["vllm==0.32.0"], "vllm", option="engine").versions == ("0.32.0",)


def test_ci_tests_against_the_newest_transformers_release_kvtool_has_read() -> None:
    from pathlib import Path

    lines = (Path(__file__).resolve().parents[2] / ".ci" / "constraints.txt").read_text().splitlines()
    pins = [ln.split("==", 1)[1].strip() for ln in lines if ln.startswith("transformers==")]
    from kvtool.model.engine_tables import newest_read

    assert pins == [newest_read("transformers")]
