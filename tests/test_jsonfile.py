"""kvtool/io/jsonfile.py: integers too long to parse and deep nesting are refused with the key and line."""

from __future__ import annotations

import pytest

from kvtool.errors import InputError
from kvtool.io.jsonfile import MAX_INT_DIGITS, MAX_JSON_DEPTH, load_json_object, parse_json


def test_long_integer_names_key_and_line(tmp_path) -> None:
    p = tmp_path / "config.json"
    p.write_text('{\n  "a": 1,\n  "num_hidden_layers": ' + "9" * 5000 + "\n}")
    with pytest.raises(InputError) as e:
        load_json_object(p, what="config")
    assert e.value.field == "num_hidden_layers"
    assert "an integer with 5000 digits at line 3" in e.value.message


def test_integers_up_to_the_limit_parse() -> None:
    assert parse_json("[" + "9" * MAX_INT_DIGITS + "]", "x")[0] == int("9" * MAX_INT_DIGITS)
    with pytest.raises(InputError):
        parse_json("[-" + "9" * (MAX_INT_DIGITS + 1) + "]", "x")


@pytest.mark.parametrize("depth,ok", [(MAX_JSON_DEPTH, True), (MAX_JSON_DEPTH + 1, False), (100_000, False)])
def test_nesting(depth, ok) -> None:
    text = "[" * depth + "]" * depth
    if ok:
        parse_json(text, "x")
    else:
        with pytest.raises(InputError, match=f"nested more than {MAX_JSON_DEPTH} levels"):
            parse_json(text, "x")


def test_nonstandard_tokens_recorded(tmp_path) -> None:
    p = tmp_path / "c.json"
    p.write_text('{"a": NaN, "b": -Infinity}')
    doc = load_json_object(p)
    assert sorted(doc.nonstandard) == ["-Infinity", "NaN"]
