"""kvtool.options.fields.check: a declared field's choices and bounds are the enforced ones (issue 30).

Every declared field of every operation that has choices, a pattern, a minimum, an exclusive minimum or a
maximum gets a value just past each: the Python API (the options object), the command line and a recipe
(`kvtool apply --dry-run`) must refuse it, each with the same message, the field named as that caller spells
it. No model is needed: the options are refused before any file is opened.
"""

from __future__ import annotations

import json
import typing

import pytest

from kvtool.cli import main
from kvtool.errors import UsageError
from kvtool.options import load_all
from kvtool.options.fields import Field, fields_of


def _past(f: Field) -> list:
    """Values just outside what `f` declares."""
    s, out = f.spec, []
    if f.choices is not None:
        out.append("no-such-choice")
    step = 1 if f.base_type is int else 0.5
    if s.minimum is not None:
        out.append(s.minimum - step)
    if s.exclusive_minimum is not None:
        out.append(s.exclusive_minimum if f.base_type is float else int(s.exclusive_minimum))
    if s.maximum is not None:
        out.append(s.maximum + step)
    if s.pattern is not None:
        out.append("cuda:x")
    return [type(v)(v) if f.base_type is not int else int(v) for v in out]


CASES = [(cmd, f.name, value) for cmd, cls in load_all().items() for f in fields_of(cls)
         if not f.spec.positional for value in _past(f)]


def test_the_walk_covers_every_bounded_field():
    """A guard on the walk: every operation with a bounded field is in it, and the fields issue 30 named."""
    bounded = {(cmd, f.name) for cmd, cls in load_all().items() for f in fields_of(cls)
               if any(x is not None for x in (f.spec.choices, f.spec.minimum, f.spec.maximum,
                                              f.spec.exclusive_minimum, f.spec.pattern))}
    assert bounded == {(cmd, name) for cmd, name, _ in CASES}
    for want in [("convert", "seq_len"), ("convert", "calib_tokens"), ("convert", "grouping"), ("convert", "to"),
                 ("quantize-kv", "seq_len"), ("quantize-kv", "calib_tokens"), ("eval", "max_tokens"),
                 ("kv-budget", "gpu_memory_utilization"), ("rope", "type"), ("apply", "device")]:
        assert want in bounded
    assert len(CASES) >= 40


def _options(cmd: str, **values):
    cls = load_all()[cmd]
    given = {f.name: (["x"] if f.is_list else "x") for f in fields_of(cls) if f.spec.positional and f.required}
    required = {f.name: f.choices[0] for f in fields_of(cls) if f.required and not f.spec.positional}
    return cls(**{**given, **required, **values})


def _yaml_value(value) -> str:
    return json.dumps(value)  # YAML reads JSON scalars as the same int / float / string


def _recipe_step(cmd: str, key: str, value) -> str:
    cls = load_all()[cmd]
    body: dict = {}
    for f in fields_of(cls):
        if f.spec.recipe_required and f.recipe_key != key:
            body[f.recipe_key] = f.choices[0]
    node = body
    *parents, leaf = key.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return json.dumps(body)


@pytest.mark.parametrize(("cmd", "name", "value"), CASES, ids=[f"{c}-{n}-{v}" for c, n, v in CASES])
def test_the_api_the_command_line_and_a_recipe_refuse_alike(cmd, name, value, tmp_path, capsys):
    cls = load_all()[cmd]
    f = next(x for x in fields_of(cls) if x.name == name)
    # the Python API: the options object refuses the value when it is made, naming the field
    with pytest.raises(UsageError) as api:
        _options(cmd, **{name: value})
    assert api.value.option == name and api.value.field is None
    message = api.value.message
    assert message.startswith("must be ") and "got " in message
    # an object changed after it was made is refused by the same check (each plan runs it again)
    o = _options(cmd)
    setattr(o, name, value)
    with pytest.raises(UsageError) as again:
        o.check()
    assert again.value.message == message

    if f.spec.cli:  # the command line: the same line, the field named by its flag
        positional = [a for x in fields_of(cls) if x.spec.positional and x.required for a in ["x"]]
        required = [a for x in fields_of(cls) if x.required and not x.spec.positional
                    for a in (x.flag, x.choices[0])]
        rc = main([cmd, *positional, *required, f.flag, str(value)])
        err = capsys.readouterr().err
        assert rc == 2 and err == f"kvtool: error: {f.flag}: {message}\n", err

    if f.recipe_key and cls.RECIPE_STEP:  # a recipe: the same message at the step's key and line
        r = tmp_path / "r.yaml"
        r.write_text(f"version: 1\nsteps:\n  - {cmd}: {_recipe_step(cmd, f.recipe_key, value)}\n")
        rc = main(["apply", str(r), str(tmp_path / "src"), str(tmp_path / "out"), "--dry-run"])
        err = capsys.readouterr().err
        assert rc == 2 and err == f"kvtool: error: {r}: steps[0].{cmd}.{f.recipe_key}: line 3: {message}\n", err
        assert not (tmp_path / "out").exists()


def test_a_value_of_the_wrong_type_is_refused_by_the_declaration_too():
    """The Python API has no click to parse its values: a string where a count goes is refused by name."""
    for cmd, name, value in (("convert", "seq_len", "64"), ("convert", "serve_context", True),
                             ("kv-budget", "gpu_memory_utilization", float("nan")), ("convert", "to", 3)):
        with pytest.raises(UsageError) as exc:
            _options(cmd, **{name: value})
        assert exc.value.option == name and exc.value.message.startswith("must be "), exc.value.message


def test_a_declared_value_inside_the_bounds_is_accepted():
    o = _options("convert", seq_len=8, calib_tokens=8, grouping="similarity", to="gqa", groups=1)
    assert (o.seq_len, o.calib_tokens, o.grouping) == (8, 8, "similarity")
    assert typing.get_type_hints(type(o))["seq_len"] == int | None
