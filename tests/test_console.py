"""kvtool/console.py: the one writer of stdout / stderr, and what it escapes.

The GitHub runner's parsing is emulated from its source (kvtest.runner_command), so the tests can ask what a
line makes the runner do.
"""

from __future__ import annotations

import ast
import io
import json
import sys
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtest import HOSTILE_PIECES, REPO, raw_controls, runner_command
from kvtool import console

BIDI_CONTROLS = {"LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI"}
hostile = st.lists(st.sampled_from(HOSTILE_PIECES), min_size=1, max_size=8).map("".join) | st.text(max_size=20)


def test_every_control_separator_format_and_surrogate_character_is_escaped():
    cats = {"Cc", "Cf", "Zl", "Zp", "Cs"}
    missed = [hex(i) for i in range(sys.maxunicode + 1)
              if (unicodedata.category(chr(i)) in cats or unicodedata.bidirectional(chr(i)) in BIDI_CONTROLS)
              and console.escape(chr(i)) == chr(i)]
    assert missed == []
    assert console.escape("llama\r\n\x1b]0;t\x07\x9b\u202e\ud800\U000e0041") == \
        "llama\\r\\n\\x1b]0;t\\x07\\x9b\\u202e\\ud800\\U000e0041"


def test_printable_text_is_unchanged():
    s = "Meta-Llama-3.1 8B é 日本語 😀 ü/x:y, 100% [ok]"
    assert console.escape(s) == s and console.lines([s]) == s + "\n"


@settings(max_examples=300, deadline=None)
@given(hostile)
def test_escape_is_one_safe_line_and_idempotent(value):
    shown = console.escape(value)
    assert "\n" not in shown and raw_controls(shown) == []
    assert console.escape(shown) == shown
    shown.encode("utf-8")  # lone surrogates too: never a UnicodeEncodeError on stdout


@settings(max_examples=300, deadline=None)
@given(st.lists(hostile, min_size=1, max_size=4))
def test_lines_keep_each_value_on_its_line_and_start_no_workflow_command(values):
    text = console.lines([f"{v}: {v}" for v in values] + list(values))
    assert isinstance(text, console.Text) and text.endswith("\n")
    out = text[:-1].split("\n")
    assert len(out) == 2 * len(values)
    for line in out:
        assert raw_controls(line) == [] and runner_command(line) is None, line


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(hostile, hostile | st.lists(hostile, max_size=3), max_size=4))
def test_json_text_is_the_same_data_and_nothing_a_terminal_or_runner_acts_on(obj):
    text = console.json_text(obj, indent=2, sort_keys=True)
    assert json.loads(text) == json.loads(json.dumps(obj))  # (two lone surrogates side by side make a pair)
    for line in text.splitlines():
        assert raw_controls(line) == [] and runner_command(line) is None and line.isascii(), line


@settings(max_examples=300, deadline=None)
@given(hostile, hostile, st.lists(hostile, min_size=1, max_size=3))
def test_a_workflow_command_carries_exactly_its_values(file, title, message):
    line = console.lines([console.command("error", {"file": file, "line": 3, "title": title}, message)])[:-1]
    assert "\n" not in line and raw_controls(line) == []
    name, props, data = runner_command(line)
    assert name == "error"
    # the legacy `##[` syntax is shown escaped everywhere, inside a command too
    def shown(v):
        return console.escape(v).replace("##[", "##\\x5b")

    # the runner trims the property list, so the last value loses trailing white space (GitHub has no escape)
    assert props == {k: v for k, v in (("file", shown(file)), ("line", "3"), ("title", shown(title).rstrip())) if v}
    assert data.split("\n") == [shown(m) for m in message]


def test_github_escaping_follows_the_runner():
    line = console.command("warning", {"file": "a,b:c%d", "title": "KV1"}, ["50% off: x", "hint: y"])
    assert line == "::warning file=a%2Cb%3Ac%25d,title=KV1::50%25 off: x%0Ahint: y"
    with pytest.raises(ValueError):
        console.command("error file=x", {}, ["m"])


def test_out_writes_a_plain_string_as_one_line_and_text_as_rendered():
    buf = io.StringIO()
    console.out("a\nb::error::x", stream=buf)
    console.out(console.lines(["c", "d"]), stream=buf)
    console.out(["e\rf", "::notice::n"], stream=buf)
    assert buf.getvalue() == "a\\nb::error::x\nc\nd\ne\\rf\n\\x3a:notice::n\n"


def test_a_full_device_is_output_failed_not_a_traceback():
    class Full(io.StringIO):
        def write(self, s):
            raise OSError(28, "No space left on device")

    with pytest.raises(console.OutputFailed) as exc:
        console.out("x", stream=Full())
    assert exc.value.strerror == "No space left on device"


# --- nothing else prints ------------------------------------------------------------------------------
STREAMS = {"stdout", "stderr", "__stdout__", "__stderr__"}


def printing_calls(source: str) -> list[int]:
    """Lines of `source` that write to stdout / stderr other than through kvtool.console."""
    bad = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Name) and node.id in ("print", "pprint"):
            bad.append(node.lineno)
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            if node.value.id == "sys" and node.attr in STREAMS:
                bad.append(node.lineno)
            elif node.value.id in ("typer", "click") and node.attr in ("echo", "secho"):
                bad.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module in ("sys", "typer", "click", "pprint"):
            if {a.name for a in node.names} & (STREAMS | {"echo", "secho", "pprint"}):
                bad.append(node.lineno)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "write" \
                and isinstance(node.func.value, ast.Name) and node.func.value.id == "os" and node.args \
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in (1, 2):
            bad.append(node.lineno)
    return bad


def test_the_scan_finds_every_way_of_printing():
    src = ("import sys, os\nprint('x')\nsys.stdout.write('x')\nf = sys.stderr\ntyper.echo('x')\nclick.echo('x')\n"
           "from sys import stdout\nos.write(1, b'x')\necho = print\n")
    assert sorted(set(printing_calls(src))) == [2, 3, 4, 5, 6, 7, 8, 9]


def test_only_kvtool_console_writes_to_stdout_or_stderr():
    modules = sorted((REPO / "kvtool").rglob("*.py"))
    assert len(modules) > 100
    bad = [f"{p.relative_to(REPO)}:{line}" for p in modules if p != REPO / "kvtool" / "console.py"
           for line in printing_calls(p.read_text(encoding="utf-8"))]
    assert bad == []


def test_what_a_library_writes_to_the_guarded_streams_is_escaped_too(monkeypatch):
    import logging
    import warnings

    out, err = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", out)
    monkeypatch.setattr(sys, "stderr", err)
    console.guard_streams()
    log = logging.getLogger("a-library")
    log.addHandler(logging.StreamHandler())  # made after the guard, as transformers makes its handler
    log.propagate = False
    log.warning("weights of %s not used\n::error file=x::forged", "q\x1b]0;t\x07")
    # pytest records warnings instead of showing them: show this one as Python does outside pytest
    monkeypatch.setattr(warnings, "_showwarnmsg_impl",
                        lambda msg: sys.stderr.write(warnings._formatwarnmsg_impl(msg)))
    warnings.warn("bad value \u202e\r\n##[error]x")
    sys.stderr.write("a partial line ::\x9b")
    console.out("kvtool's own line", err=True)  # kvtool's output goes underneath, never escaped twice
    console.settle()
    lines = err.getvalue().split("\n")[:-1]
    assert lines[0] == "weights of q\\x1b]0;t\\x07 not used"
    assert lines[1] == "\\x3a:error file=x::forged"
    assert any(ln.endswith("bad value \\u202e\\r") for ln in lines) and "##\\x5berror]x" in lines
    assert "kvtool's own line" in lines and lines[-1] == "a partial line ::\\x9b"
    assert all(raw_controls(ln) == [] and runner_command(ln) is None for ln in lines), lines
    assert out.getvalue() == ""
