"""kvtool/commands/argv.py: a command line it reads gives the options typer gives; the rest goes to typer (help,
usage errors); lint, kv-budget and rope run without importing typer or click (convert without the typer CLI)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtest import REPO
from kvtool.commands import argv as direct
from kvtool.commands.options_cli import command
from kvtool.errors import KvtoolError
from kvtool.options import load_all
from kvtool.options.fields import OPERATIONS, argument, fields_of, operation, option

EXAMPLE = str(REPO / "examples" / "llama-gqa-tiny")


@operation("argv-test", recipe=False)
class _EveryKind:
    """One field of every kind the declaration has (the three direct commands have most, not all)."""

    item: str = argument(help="An argument.")
    count: int | None = option(None, short="-c", help="An optional integer with a short flag.")
    ratio: float = option(0.5, help="A float with a default.")
    name: str = option("x", flags=("--name", "--alias"), help="Two spellings.")
    where: Path | None = option(None, help="A path.")
    strict: bool | None = option(None, negatable=True, help="--strict / --no-strict.")
    quiet: bool = option(False, help="A switch.")
    tags: list[str] | None = option(None, repeatable=True, help="Repeatable.")
    hidden: int = option(3, cli=False, help="No flag.")


del OPERATIONS["argv-test"]  # a test class, no operation of kvtool's
CLASSES = {cls.COMMAND: cls for cls in (_EveryKind, *(load_all()[c] for c in direct.DIRECT))}


def _made(cls, kwargs: dict) -> str:
    """repr of the options object, or the error its own checks raise (the same object the command body gets, through
    the callback both readers call: kvtool.commands.options_cli.command, which checks the paths first)."""
    from kvtool.options.fields import check_paths

    try:
        check_paths(cls, kwargs)
        return repr(cls(**kwargs))
    except KvtoolError as exc:
        return f"{type(exc).__name__}: {exc.message}"


def _typer_reads(cls, args: list[str]) -> str | None:
    """_made of what typer hands the command for `args`, or None when click refuses them."""
    got = []
    app = typer.Typer()
    app.callback()(lambda: None)  # a group, as kvtool's app is
    command(app, cls, help="")(lambda opts: got.append(repr(opts)) or 0)
    try:
        typer.main.get_command(app).main(args=[cls.COMMAND, *args], prog_name="kvtool", standalone_mode=False)
    except (click.ClickException, click.exceptions.Exit, ValueError):
        return None
    except KvtoolError as exc:
        return f"{type(exc).__name__}: {exc.message}"
    return got[0]


def _words(cls) -> list[str]:
    out = ["--help", "-h", "--", "-", "--bogus", "-tp2", "--quiet=1", "--strict=true"]
    for f in fields_of(cls):
        if f.spec.cli and not f.spec.positional:
            out += [*f.flags, *([f.spec.short] if f.spec.short else [])]
            out += [f"--no-{s[2:]}" for s in f.flags if f.spec.negatable]
            out += [f"{f.flags[0]}=", f"{f.flags[0]}=7", f"{f.flags[0]}=a=b"]
    return out


_INTS = ["1", "-1", "+3", " 7 ", "1_000", "١٢", "0x1f", "1.0"]  # the last two: refused by int()
_FLOATS = [*_INTS, "1.5", "nan", "-inf", "1e3"]
_VALUES = [*_FLOATS, "", "x", "a b", "json", "/nonexistent/p", EXAMPLE, "KV1,KV2", "auto", "-", "--help"]


@st.composite
def _command_lines(draw):
    """Mostly well-formed command lines (arguments, flags with values in either spelling, in any order), some with
    a stray word from _words or _VALUES."""
    cls = CLASSES[draw(st.sampled_from(sorted(CLASSES)))]
    n = draw(st.sampled_from([1, 1, 1, 2, 2, 0, 3]))
    chunks = [[v] for v in draw(st.lists(st.sampled_from([EXAMPLE, "out", "x", ""]), min_size=n, max_size=n))]
    flags = [f for f in fields_of(cls) if f.spec.cli and not f.spec.positional]
    required = [f for f in flags if f.required and draw(st.integers(0, 9))]  # a required option, mostly given
    for f in required + draw(st.lists(st.sampled_from(flags), max_size=5, unique_by=lambda f: f.name
                                      if draw(st.booleans()) else None)):  # a flag given twice now and then
        spelling = draw(st.sampled_from([*f.flags, *([f.spec.short] if f.spec.short else [])]))
        values = {int: _INTS, float: _FLOATS}.get(f.base_type, _VALUES)
        if f.base_type is bool:
            chunks.append([draw(st.sampled_from([spelling, f"--no-{spelling[2:]}"])) if f.spec.negatable else spelling])
        elif draw(st.booleans()):
            chunks.append([spelling, draw(st.sampled_from(values))])
        else:
            chunks.append([f"{spelling}={draw(st.sampled_from(values))}"])
    for _ in range(draw(st.integers(0, 2)) if draw(st.booleans()) else 0):
        chunks.insert(draw(st.integers(0, len(chunks))), [draw(st.sampled_from(_words(cls) + _VALUES))])
    return cls, [w for c in draw(st.permutations(chunks)) for w in c]


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_command_lines())
@example((OPERATIONS["lint"], [EXAMPLE, "--select", "--help", "-tp", "2", "--no-strict", "--format=json"]))
@example((OPERATIONS["rope"], [EXAMPLE, "out", "--factor", "-1", "--type", "yarn", "--in-place"]))
@example((_EveryKind, ["a", "--tags", "x", "--tags=", "--alias", "y", "-c", " 7 ", "--where", "", "--strict"]))
def test_what_argv_reads_typer_reads_the_same(case):
    cls, args = case
    kwargs = direct.read(cls, args)
    if kwargs is not None:  # None: typer reads it (the path every command line took before)
        assert _made(cls, kwargs) == _typer_reads(cls, args)


@pytest.mark.parametrize("args", [
    ["lint", EXAMPLE, "--isolated"],
    ["lint", EXAMPLE, EXAMPLE, "--format", "json", "--select=KV1", "-tp", "2", "--strict"],
    ["kv-budget", EXAMPLE, "--gpu", "H100-80GB", "--max-model-len", "4096", "--format", "json"],
    ["rope", EXAMPLE, "--show"],
    ["rope", EXAMPLE, "out", "--type", "yarn", "--factor", "4", "--layout", "v5"],
    ["convert", EXAMPLE, "out", "--to", "gqa", "--groups", "2", "--no-eval", "--no-progress"],
    ["convert", EXAMPLE, "--to", "mqa", "--dry-run", "--method-opt", "a=1", "--method-opt", "b=2"],
])
def test_the_usual_command_lines_are_read_without_typer(args):
    assert direct.direct_call(args) is not None


@pytest.mark.parametrize("args", [["lint", "--help"], ["lint", "-h", EXAMPLE], ["lint"], ["lint", "--strct", EXAMPLE],
                                  ["lint", EXAMPLE, "--isolated", "--isolated"], ["rope", EXAMPLE, "a", "b"],
                                  ["kv-budget", EXAMPLE, "--batch", "two"], ["convert", EXAMPLE, "out"], ["eval", EXAMPLE],
                                  []])
def test_help_usage_errors_and_other_commands_go_to_typer(args):
    assert direct.direct_call(args) is None


@pytest.mark.parametrize("args,numpy", [(["lint", EXAMPLE, "--isolated"], False), (["kv-budget", EXAMPLE], False),
                                        (["rope", EXAMPLE, "--show"], True),  # rope computes frequencies in numpy
                                        (["convert", EXAMPLE, "--to", "mqa", "--dry-run"], False)])
def test_lint_kv_budget_rope_and_convert_import_neither_typer_nor_click(tmp_path, args, numpy):
    code = ("import sys\n"
            "from kvtool.cli import main\n"
            f"assert main({args!r}) in (0, 1)\n"
            "print(sorted(m for m in ('typer', 'click', 'yaml', 'numpy', 'torch') if m in sys.modules))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.splitlines()[-1] == str(["numpy"] if numpy else [])
