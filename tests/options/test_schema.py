"""The committed recipe schema's step definitions are generated from the declared options."""

from __future__ import annotations

import json

import pytest

from kvtool.errors import UsageError
from kvtool.model.rope import types as rt
from kvtool.options import load_all
from kvtool.options import rope as rope_options
from kvtool.options.fields import fields_of
from kvtool.options.schema import STEP_DEFS, recipe_schema, schema_path, step_schema


def test_the_committed_schema_is_the_generated_one():
    committed = json.loads(schema_path().read_text(encoding="utf-8"))
    assert committed == recipe_schema(committed), "run: python -m kvtool.options --write"


@pytest.mark.parametrize("cmd", sorted(set(load_all()) & set(STEP_DEFS)))
def test_a_step_accepts_exactly_its_declared_recipe_keys(cmd):
    cls = load_all()[cmd]
    s = step_schema(cls)
    assert s["additionalProperties"] is False
    top = {f.recipe_key.split(".")[0] for f in fields_of(cls) if f.recipe_key}
    assert set(s["properties"]) == top
    for f in fields_of(cls):
        if f.recipe_key and "." not in f.recipe_key and f.spec.pattern is not None:  # choices then name forms
            assert s["properties"][f.recipe_key]["pattern"] == f"^(?:{f.spec.pattern})$"
        elif f.recipe_key and "." not in f.recipe_key and f.choices and not f.registry_choices:
            assert s["properties"][f.recipe_key]["enum"] == list(f.choices)


def test_rope_choices_are_what_the_rope_planner_accepts(tiny_llama_config):
    """Every declared layout is one the planner writes (it has no list of its own), each differently."""
    from kvtool.model.spec import build_spec
    from kvtool.rope.apply import plan_rope

    spec = build_spec(tiny_llama_config)
    configs = []
    for layout in rope_options.LAYOUTS:
        o = rope_options.RopeOptions(src="m", dst="out", type="linear", factor=2.0, layout=layout)
        configs.append(repr(plan_rope(spec, o)))
    assert len(set(configs)) == len(rope_options.LAYOUTS)


def test_registry_choices_are_filled_in_when_a_recipe_is_loaded():
    """RoPE types and merge methods come from their registries: a new one needs no schema edit."""
    from kvtool.convert.methods import available_methods
    from kvtool.options.schema import fill_choices

    committed = json.loads(schema_path().read_text(encoding="utf-8"))
    assert "enum" not in committed["$defs"]["rope"]["properties"]["type"]
    filled = fill_choices(committed)
    assert filled["$defs"]["rope"]["properties"]["type"] == {"enum": rt.applicable_types()}
    assert filled["$defs"]["convert"]["properties"]["method"] == {"enum": available_methods()}


def test_a_recipe_naming_an_unregistered_method_is_refused(tmp_path):
    from kvtool.errors import InputError
    from kvtool.recipes.load import load_recipe

    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - convert: {to: mqa, method: median}\n")
    with pytest.raises(InputError) as exc:
        load_recipe(p)
    assert exc.value.field == "steps[0].convert.method"
    assert "must be one of aware, mean, got 'median'" in exc.value.message


def test_a_recipe_error_names_the_steps_key(tmp_path, tiny_llama_config):
    from kvtest import write_config
    from kvtool.model.preflight import preflight
    from kvtool.recipes.load import load_recipe
    from kvtool.recipes.plan import plan_recipe

    write_config(tmp_path / "src", tiny_llama_config)
    p = tmp_path / "r.yaml"
    p.write_text("version: 1\nsteps:\n  - lint: {}\n  - rope: {type: yarn, factor: 2, layer_type: sliding_attention}\n")
    with pytest.raises(UsageError) as exc:
        plan_recipe(load_recipe(p), preflight(tmp_path / "src", require_weights=False))
    assert exc.value.field == "steps[1].rope.layer_type"
    assert "line 4: step 2 (rope):" in exc.value.message and "no 'sliding_attention' layers" in exc.value.message


def test_the_declared_gates_are_the_gates_eval_knows():
    from kvtool.eval.gate import GATES
    from kvtool.options.eval import GATE_FIELDS

    assert tuple(GATES) == GATE_FIELDS  # (quantize-kv's strategies: tests/quantize, which has torch)


def test_a_step_error_at_run_time_names_the_steps_key(tmp_path, tiny_llama_config):
    """An error a library raises while a step runs (a field the step spells) names steps[i].kind.key."""
    from kvtool.errors import InputError
    from kvtool.recipes.apply import _name_step_key
    from kvtool.recipes.load import Step

    e = InputError("must be at least 2, got 1", option="max_tokens")
    _name_step_key(e, Step(kind="eval", options={}, index=3, line=9))
    assert e.line() == "steps[2].eval.max_tokens: must be at least 2, got 1"
    device = UsageError("no CUDA GPU", option="device")  # apply's own --device: left for the CLI to spell
    _name_step_key(device, Step(kind="eval", options={}, index=1, line=3))
    assert device.field is None
