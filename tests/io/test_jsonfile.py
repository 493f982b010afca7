"""kvtool/io/jsonfile.py: integers too long to parse and deep nesting are refused with the key and line, decided
exactly as a Python parse_int callback and a walk of the parsed value decide (property test on generated JSON)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtool.errors import InputError
from kvtool.io.jsonfile import MAX_INT_DIGITS, MAX_JSON_DEPTH, _locate_huge, load_json_object, parse_json


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


def test_long_integer_is_located_past_digits_in_strings_and_floats() -> None:
    """The key and line name the integer json refused, not an earlier run of digits in a string or a float."""
    text = ('{\n  "note": "' + "1" * 150 + '",\n  "pi": 3.' + "1" * 150 + ',\n  "e": 1e' + "0" * 150
            + ',\n  "hidden_size": ' + "7" * 101 + "\n}")
    with pytest.raises(InputError) as e:
        parse_json(text, "config.json", what="config")
    assert e.value.field == "hidden_size"
    assert "an integer with 101 digits at line 5" in e.value.message


@pytest.mark.parametrize("text,ok", [
    ('["' + "[" * 100 + '"]', True),  # brackets inside a string are not nesting
    ('["\\"' + "[" * 100 + '"]', True),  # nor after an escaped quote
    ('["\\\\", ' + "[" * 64 + "]" * 64 + "]", False),  # an escaped backslash ends no string: 65 levels
    ('{"a": "]]]]", "b": ' + "[" * 63 + '"}}}"' + "]" * 63 + "}", True),  # 64 levels, closers in strings
    ('{"a": "]]]]", "b": ' + "[" * 64 + '"{{{"' + "]" * 64 + "}", False),
    ("[" + ", ".join(["[[{}]]"] * 1000) + "]", True),  # wide, not deep
])
def test_nesting_counts_brackets_outside_strings_only(text, ok) -> None:
    if ok:
        parse_json(text, "x")
    else:
        with pytest.raises(InputError, match="nested more than"):
            parse_json(text, "x")


# --- the bounds, checked at C speed, decide exactly as json's parse_int callback and a walk of the value did ---

class _Huge(Exception):
    pass


def _reference(text: str):
    """The implementation before issue 30: every integer through a Python parse_int, then a Python walk of
    the parsed value for its depth. Returns (message, field) of the error, or ("ok", repr of the value)."""
    found: list[str] = []

    def _constant(token):
        found.append(token)
        return float(token.replace("Infinity", "inf").replace("NaN", "nan"))

    def _int(token):
        if len(token.lstrip("-")) > MAX_INT_DIGITS:
            raise _Huge(token)
        return int(token)

    try:
        data = json.loads(text, parse_constant=_constant, parse_int=_int)
    except _Huge as exc:
        key, line = _locate_huge(text)
        return (f"an integer with {len(exc.args[0].lstrip('-'))} digits at line {line}; numbers in "
                f"JSON file files have at most {MAX_INT_DIGITS} digits", key)
    except json.JSONDecodeError as exc:
        return f"invalid JSON at line {exc.lineno} column {exc.colno}: {exc.msg}", None
    except RecursionError:
        return f"JSON nested more than {MAX_JSON_DEPTH} levels deep", None
    stack = [(data, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            return f"JSON nested more than {MAX_JSON_DEPTH} levels deep", None
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else ()
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return "ok", repr(data), found


def _outcome(text: str):
    found: list[str] = []
    try:
        return "ok", repr(parse_json(text, "x", nonstandard=found)), found
    except InputError as exc:
        return exc.message, exc.field


# strings built to confuse a scanner: quotes, backslashes, brackets, digits, non-ASCII, controls, surrogates
_TRICKY = st.lists(st.sampled_from(list('"\\[]{}09ab :,\n\t') + ["\\\"", "\\\\", "é", "\u2028", "\x00", "\ud800",
                                                                    "𝄞", "0" * 60]), max_size=12).map("".join)
_LEAVES = (st.none() | st.booleans() | st.integers(-(10 ** 110), 10 ** 110) | st.floats()
           | st.decimals(allow_nan=False, allow_infinity=False, places=3).map(float) | _TRICKY
           | st.integers(95, 110).map(lambda n: "9" * n))  # a long digit run inside a string
_VALUES = st.recursive(_LEAVES, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_TRICKY, kids, max_size=4),
                       max_leaves=40)


@st.composite
def _documents(draw) -> str:
    value = draw(_VALUES)
    levels = draw(st.sampled_from([0, 1, 2, MAX_JSON_DEPTH - 3, MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH])
                  | st.integers(0, MAX_JSON_DEPTH + 3))  # nesting around the limit
    for kind in draw(st.lists(st.booleans(), min_size=levels, max_size=levels)):
        value = [draw(_LEAVES), value] if kind else {draw(_TRICKY): value}
    text = json.dumps(value, ensure_ascii=draw(st.booleans()), indent=draw(st.sampled_from([None, 0, 2])))
    if "9" * (MAX_INT_DIGITS + 1) not in text and draw(st.booleans()):  # an integer of about the limit
        n = draw(st.integers(MAX_INT_DIGITS - 1, MAX_INT_DIGITS + 2))
        text = text.replace("true", "-" * draw(st.booleans()) + "8" * n, 1)
    for _ in range(draw(st.integers(0, 2))):  # and broken ones: a character deleted or inserted
        i = draw(st.integers(0, len(text)))
        if draw(st.booleans()):
            text = text[:i] + text[i + 1:]
        else:
            text = text[:i] + draw(st.sampled_from(list('"\\[]{},:0 '))) + text[i:]
    return text


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_documents())
@example('{"a": "\\\\"}')
@example('["\\\\\\"]", [[]]]')
@example("[" * 65 + "]" * 65)
@example('[1e' + "0" * 120 + ", " + "1" * 101 + "]")
def test_bounds_decide_as_the_python_walk_did(text: str) -> None:
    assert _outcome(text) == _reference(text)
