"""`kvtool lint recipe.yaml`: schema problems (KV961) and missing text files (KV962) as findings with lines."""

from __future__ import annotations

import json

from kvtool.cli import main


def _lint_json(path, capsys):
    code = main(["lint", str(path), "--format", "json"])
    return code, json.loads(capsys.readouterr().out)["models"][0]


def test_schema_error_is_kv961_with_line(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - convert:\n      to: gqa\n      metod: aware\n")
    code, model = _lint_json(p, capsys)
    assert code == 1
    (f,) = model["findings"]
    assert (f["code"], f["line"], f["path"]) == ("KV961", 5, "steps[0].convert.metod")


def test_missing_text_files_are_kv962_relative_to_the_recipe(tmp_path, capsys):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "calib.txt").write_text("text")
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n"
                 "  - convert: {to: mqa, method: aware, calibration: {text: data/calib.txt}}\n"
                 "  - eval: {text: [data/calib.txt, data/eval.txt]}\n")
    code, model = _lint_json(p, capsys)
    assert code == 1
    (f,) = model["findings"]
    assert f["code"] == "KV962" and f["line"] == 4 and "'data/eval.txt' not found" in f["message"]
    (tmp_path / "data" / "eval.txt").write_text("text")
    code, model = _lint_json(p, capsys)
    assert code == 0 and model["findings"] == []


def test_shipped_recipes_lint_clean(capsys):
    from kvtest import REPO

    recipes = sorted(str(p) for p in (REPO / "recipes").glob("*.yaml"))
    assert len(recipes) == 5
    assert main(["lint", *recipes]) == 0


def test_a_schema_message_quoting_file_error_words_is_still_a_kv961_finding(tmp_path, capsys):
    """Lint reads the error's fields, not its words: a value that reads "cannot read" is a schema finding."""
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - lint: {select: ['cannot read no such recipe file']}\n")
    code, model = _lint_json(p, capsys)
    assert code == 1 and model.get("error") is None
    (f,) = model["findings"]
    assert (f["code"], f["line"], f["path"]) == ("KV961", 3, "steps[0].lint.select[0]")
    assert f["message"].startswith("'cannot read no such recipe file' does not match")


def test_invalid_yaml_is_a_finding_at_its_line_and_a_missing_file_an_error(tmp_path, capsys):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - lint: {select: [KV1}\n")
    code, model = _lint_json(p, capsys)
    (f,) = model["findings"]
    assert (f["code"], f["line"]) == ("KV961", 3) and f["message"].startswith("invalid YAML: ")
    code, model = _lint_json(tmp_path / "missing.yaml", capsys)
    assert code == 2 and model["error"].endswith("missing.yaml: no such file") and model["findings"] == []


def test_per_file_ignores_apply_to_recipe_files(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.yaml").write_text("version: 1\nsteps:\n  - convert:\n      to: gqa\n      metod: aware\n")
    assert main(["lint", "r.yaml"]) == 1
    (tmp_path / "pyproject.toml").write_text('[tool.kvtool.per-file-ignores]\n"r.yaml" = ["KV961"]\n')
    assert main(["lint", "r.yaml"]) == 0


def test_method_and_rope_type_choices_come_from_the_registries(tmp_path, capsys):
    from kvtool.convert.methods import available_methods
    from kvtool.model.rope.types import applicable_types

    p = tmp_path / "r.yaml"
    for step, choices in (("convert: {to: gqa, groups: 2, method: meen}", available_methods()),
                          ("rope: {type: ntk, factor: 2}", applicable_types())):  # ntk: a type kvtool cannot write
        p.write_text(f"version: 1\nsteps:\n  - {step}\n")
        code, model = _lint_json(p, capsys)
        (f,) = model["findings"]
        assert code == 1 and f["code"] == "KV961" and ", ".join(choices) in f["message"]
