"""The typer flags of every command are the declared fields (kvtool/commands/options_cli.py generates them)."""

from __future__ import annotations

import click
import pytest
import typer

from kvtool.cli import app, main
from kvtool.options import load_all
from kvtool.options.fields import fields_of

OPERATIONS = load_all()


def _command(name: str) -> click.Command:
    return typer.main.get_command(app).commands[name]


@pytest.mark.parametrize("cmd", sorted(OPERATIONS))
def test_the_commands_parameters_are_its_declared_fields(cmd):
    cls = OPERATIONS[cmd]
    params = {p.name: p for p in _command(cmd).params if p.name != "help"}
    declared = [f for f in fields_of(cls) if f.spec.cli]
    assert list(params) == [f.name for f in declared]
    for f in declared:
        p = params[f.name]
        assert isinstance(p, click.Argument) == f.spec.positional, f.name
        assert p.required == f.required, f.name
        if not f.required:
            assert p.default == f.default, f.name
        if f.spec.positional:
            continue
        assert p.opts == list(f.flags) + ([f.spec.short] if f.spec.short else []), f.name
        assert p.secondary_opts == ([f"--no-{n[2:]}" for n in f.flags] if f.spec.negatable else []), f.name
        assert p.help == f.spec.help, f.name
        assert p.multiple == (f.is_list and not f.spec.positional), f.name


@pytest.mark.parametrize("cmd", sorted(OPERATIONS))
def test_help_lists_every_declared_flag(capsys, cmd):
    assert main([cmd, "--help"]) == 0
    out = capsys.readouterr().out
    for f in fields_of(OPERATIONS[cmd]):
        if f.spec.cli and not f.spec.positional:
            assert f.flag in out, f.name


def test_a_library_error_naming_a_field_names_its_flag_on_the_command_line(capsys, tmp_path, tiny_llama_config):
    import json

    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(tiny_llama_config))
    # rope.apply raises option="layer_type"; the line the user sees names --layer-type, as before
    assert main(["rope", str(cfg), "--type", "yarn", "--factor", "2", "--layer-type", "sliding_attention",
                 "--show"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtool: error: --layer-type: ") and "no 'sliding_attention' layers" in err
