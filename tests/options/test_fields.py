"""kvtool.options.fields: one declaration gives the flag, the recipe key, the type and the default."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import MISSING

from kvtool.errors import UsageError
from kvtool.options import load_all
from kvtool.options.fields import argument, field_named, fields_of, flag_of, from_recipe, operation, option, recipe_key_of


@operation("_demo")
class DemoOptions:
    src: str = argument(help="Input.")
    groups: int | None = option(None, short="-g", minimum=1, help="KV heads.")
    tokens: int = option(64, recipe="calibration.tokens", help="Calibration tokens.")
    eval: bool | None = option(None, negatable=True, recipe=False, help="Evaluate.")
    text: list[str] = option(default_factory=list, repeatable=True, help="Files.")
    to: str = option(choices=("gqa", "mqa"), recipe_required=True, help="Target.")


def test_a_field_declares_its_flag_recipe_key_type_and_default():
    f = {x.name: x for x in fields_of(DemoOptions)}
    assert [x.name for x in fields_of(DemoOptions)] == ["src", "groups", "tokens", "eval", "text", "to"]
    assert f["src"].flag == "SRC" and f["src"].recipe_key is None and f["src"].required
    assert f["groups"].flags == ("--groups",) and f["groups"].base_type is int and f["groups"].default is None
    assert f["tokens"].recipe_key == "calibration.tokens" and f["tokens"].default == 64
    assert f["eval"].flag == "--eval" and f["eval"].recipe_key is None
    assert f["text"].is_list and f["text"].base_type is str and f["text"].default == []
    assert f["to"].default is MISSING and f["to"].spec.choices == ("gqa", "mqa")


def test_names_map_to_each_callers_spelling():
    assert flag_of(DemoOptions, "groups") == "--groups"
    assert flag_of(DemoOptions, "eval") == "--eval"
    assert recipe_key_of(DemoOptions, "tokens") == "calibration.tokens"
    assert flag_of(DemoOptions, "not_a_field") == "not_a_field"
    assert field_named(DemoOptions, "nope") is None


def test_options_from_a_recipe_step_read_nested_keys_and_keep_defaults():
    o = from_recipe(DemoOptions, {"to": "gqa", "groups": 2, "calibration": {"tokens": 8}}, src="m")
    assert (o.src, o.to, o.groups, o.tokens, o.text, o.eval) == ("m", "gqa", 2, 8, [], None)
    assert from_recipe(DemoOptions, {"to": "mqa"}, src="m").tokens == 64


def test_an_error_names_the_field_until_a_caller_spells_it():
    e = UsageError("must be at least 1, got 0", option="groups")
    assert e.line() == "groups: must be at least 1, got 0"
    e.name_option(flag_of(DemoOptions, e.option))
    assert e.line() == "--groups: must be at least 1, got 0" and str(e) == e.line()
    assert UsageError("bad", file="c.json", field="model_type", option="x").line() == "c.json: model_type: bad"


def test_only_kvtools_own_declarations_are_operations():
    assert "_demo" not in load_all() and "rope" in load_all()


def test_every_operation_is_declared_and_the_declarations_import_neither_typer_nor_torch():
    code = ("import sys; from kvtool.options import load_all; ops = load_all(); "
            "print(sorted(ops)); print([m for m in ('typer', 'click', 'torch', 'transformers') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[1] == "[]"
    assert set(eval(out[0])) == set(load_all())
