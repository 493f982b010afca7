"""Recipe loading: strict schema, errors naming the line and key, paths relative to the recipe."""

from __future__ import annotations

import pytest

from kvtool.errors import InputError
from kvtool.recipes.load import load_recipe


def _write(tmp_path, text, name="r.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return p


def test_valid_recipe_steps_in_order(tmp_path):
    p = _write(tmp_path, """\
version: 1
name: demo
steps:
  - convert: {to: gqa, groups: 2}
  - rope: {type: yarn, factor: 4}
  - lint: {strict: true}
""")
    r = load_recipe(p)
    assert [s.kind for s in r.steps] == ["convert", "rope", "lint"]
    assert r.steps[1].options == {"type": "yarn", "factor": 4}
    assert r.steps[2].line == 6
    assert r.name == "demo"


@pytest.mark.parametrize("body, line, key, words", [
    ("version: 1\nsteps:\n  - convert:\n      to: mqa\n      metod: aware\n", 5, "steps[0].convert.metod", "unknown key 'metod'"),
    ("version: 1\nsteps:\n  - convert: {to: gqa, groups: 0}\n", 3, "steps[0].convert.groups",
     "must be at least 1, got 0"),
    ("version: 1\nsteps:\n  - rope: {type: yarn, factor: 4}\n    lint: {}\n", 3, "steps[0]", "exactly one key"),
    ("version: 1\nsteps:\n  - eval:\n      thresholds:\n        max_ppl: 2%\n", 5, "steps[0].eval.thresholds.max_ppl", "unknown key"),
    ("version: 2\nsteps:\n  - lint: {}\n", 1, "version", "1 was expected"),
    ("version: 1\nextra: 3\nsteps:\n  - lint: {}\n", 2, "extra", "unknown key"),
    ("version: 1\nsteps:\n  - rope: {type: yarn, factor: 2, target_context: 8192}\n", 3, "steps[0].rope", "not both"),
])
def test_schema_errors_name_line_and_key(tmp_path, body, line, key, words):
    with pytest.raises(InputError) as exc:
        load_recipe(_write(tmp_path, body))
    text = exc.value.line()
    assert f"line {line}:" in text
    assert exc.value.field == key
    assert words in text


def test_duplicate_keys_are_errors(tmp_path):
    body = "version: 1\nsteps:\n  - convert:\n      to: mqa\n      to: gqa\n"
    with pytest.raises(InputError, match="line 5: duplicate key 'to'"):
        load_recipe(_write(tmp_path, body))


def test_invalid_yaml_names_line(tmp_path):
    with pytest.raises(InputError, match=r"line 4 column 1: invalid YAML"):
        load_recipe(_write(tmp_path, "version: 1\nsteps:\n  - convert: {to: [\n"))


def test_paths_resolve_relative_to_recipe(tmp_path):
    sub = tmp_path / "recipes"
    sub.mkdir()
    r = load_recipe(_write(sub, "version: 1\nsteps:\n  - lint: {}\n"))
    assert r.resolve("data/calib.txt") == sub / "data" / "calib.txt"
    assert r.resolve("/abs/x.txt").as_posix() == "/abs/x.txt"


@pytest.mark.parametrize("observer", ["absmax-pow2:2", "attn-out", "percentile:99.9", "mse"])
def test_every_observer_spelling_is_accepted(tmp_path, observer):
    # observer names carry hyphens (the default is absmax-pow2:2): the schema must not reject them
    r = load_recipe(_write(tmp_path, f"version: 1\nsteps:\n  - quantize-kv: {{observer: '{observer}'}}\n"))
    assert r.steps[0].options["observer"] == observer


def test_a_few_aliases_are_fine(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nx-common: &t {max_kld: 0.5}\nsteps:\n  - eval: {thresholds: *t}\n")
    with pytest.raises(InputError, match="x-common"):  # unknown top-level key, but parsed: aliases resolved
        load_recipe(p)


@pytest.mark.parametrize("body,words", [
    ("a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]\n" + "".join(
        f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]\n" for i in range(1, 9)), "expands to more than"),
    ("x: &a [*a]\n", "expands to more than"),
    ("a: &a 1\nb: [" + ", ".join(["*a"] * 101) + "]\n", "more than 100 YAML aliases"),
    ("x: " + "[" * 40 + "]" * 40 + "\n", "nested more than 32 levels"),
])
def test_yaml_bounds(tmp_path, body, words):
    import time

    p = tmp_path / "bomb.yaml"
    p.write_text("version: 1\n" + body + "steps: []\n")
    t0 = time.monotonic()
    with pytest.raises(InputError, match=words) as e:
        load_recipe(p)
    assert e.value.file == str(p) and time.monotonic() - t0 < 2


def test_nan_and_inf_are_refused_with_their_key(tmp_path):
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - eval: {thresholds: {max_kld: .inf}}\n")
    with pytest.raises(InputError) as e:
        load_recipe(p)
    assert e.value.field == "steps[0].eval.thresholds.max_kld" and "line 3" in e.value.message
