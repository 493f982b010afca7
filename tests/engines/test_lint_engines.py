"""`kvtool lint --engine`, `[tool.kvtool] engines`, a recipe's lint `engines`, and the summary line."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main

from test_facts import LLAMA31


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(LLAMA31))
    return folder


def test_engine_flag_checks_that_release(model, capsys) -> None:
    assert main(["lint", str(model), "--engine", "transformers==4.42.4", "--engine", "vllm==0.6.3"]) == 1
    out = capsys.readouterr().out
    assert "KV010 [error] transformers < 4.43.0 refuses rope_type 'llama3' without 'type'" in out
    assert "checked transformers 4.42.4 (transformers==4.42.4 from --engine), vllm 0.6.3 (vllm==0.6.3 from --engine)" in out.splitlines()[-1]


def test_a_range_checks_every_release_in_it(model, capsys) -> None:
    assert main(["lint", str(model), "--engine", "transformers>=4.40,<4.44"]) == 1
    out = capsys.readouterr().out
    assert "checked: 4.40.0, 4.40.1, 4.40.2, 4.41.0" in out
    assert "transformers 16 releases 4.40.0..4.43.4" in out


def test_pyproject_engines_and_the_flag_wins(model, tmp_path, capsys) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.kvtool]\nengines = ["transformers==4.42.4"]\n')
    assert main(["lint", str(model)]) == 1
    assert "transformers 4.42.4 (transformers==4.42.4 from pyproject.toml)" in capsys.readouterr().out
    assert main(["lint", str(model), "--engine", "transformers==4.43.0"]) == 0
    assert "transformers 4.43.0" in capsys.readouterr().out


def test_pyproject_bad_engines_is_exit_2(model, tmp_path, capsys) -> None:
    (tmp_path / "pyproject.toml").write_text('[tool.kvtool]\nengines = "transformers"\n')
    assert main(["lint", str(model)]) == 2
    assert "tool.kvtool.engines" in capsys.readouterr().err


def test_bad_engine_flag_is_one_line_exit_2(model, capsys) -> None:
    assert main(["lint", str(model), "--engine", "tgi==1.0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("kvtool: error: --engine") and "unknown engine" in err and "\n" not in err


def test_json_names_the_releases_checked(model, capsys) -> None:
    assert main(["lint", str(model), "--format", "json", "--engine", "vllm==0.8.5"]) in (0, 1)
    doc = json.loads(capsys.readouterr().out)
    engines = {e["engine"]: e for e in doc["models"][0]["engines"]}
    assert engines["vllm"]["versions"] == ["0.8.5"] and engines["vllm"]["source"] == "--engine"


def test_recipe_lint_step_takes_engines(model, tmp_path, capsys) -> None:
    from kvtool.rules.run import recipe_step_options

    o = recipe_step_options({"engines": ["transformers==4.42.4"]}, str(model))
    assert o.engine == ["transformers==4.42.4"]
