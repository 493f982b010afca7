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
        # param_type_name, not isinstance(click.Argument): typer's TyperArgument is not one in every typer release
        assert (p.param_type_name == "argument") == f.spec.positional, f.name
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


def test_a_field_no_declaration_of_the_command_holds_is_spelled_as_a_flag():
    from kvtool.commands.options_cli import cli_spelling
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.kv_budget import KvBudgetOptions

    assert cli_spelling(KvBudgetOptions, "batch") == "--batch"  # the first of --batch / --concurrency
    assert cli_spelling(ConvertOptions, "dst") == "DST"
    assert cli_spelling(ConvertOptions, "max_tokens") == "--max-tokens"  # raised by kvtool.eval under convert --eval


@pytest.mark.parametrize("argv, line", [
    (["kv-budget", "{cfg}", "--batch", "0"], "kvtool: error: --batch: must be at least 1, got 0"),
    (["kv-budget", "{cfg}", "--concurrency", "0"], "kvtool: error: --batch: must be at least 1, got 0"),
    (["convert", "{dir}", "--to", "mqa", "--groups", "2", "--dry-run"],
     "kvtool: error: --groups: --to mqa means one KV head; drop --groups"),
    (["convert", "{dir}", "--to", "mqa"], "kvtool: error: DST: missing required argument (only --dry-run goes "
                                          "without one)"),
    (["apply", "{recipe}", "{dir}", "{out}", "--device", "tpu"],
     "kvtool: error: --device: must be one of auto, cpu, cuda, cuda:N, got 'tpu'"),
])
def test_error_lines_name_the_flag_the_user_typed(capsys, tmp_path, tiny_llama_config, argv, line):
    import json

    import numpy as np

    from kvtest import write_safetensors

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_llama_config))
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32)})
    (tmp_path / "r.yaml").write_text("version: 1\nsteps:\n  - lint: {}\n")
    subs = {"cfg": str(d / "config.json"), "dir": str(d), "recipe": str(tmp_path / "r.yaml"), "out": str(tmp_path / "o")}
    assert main([a.format(**subs) for a in argv]) == 2
    assert capsys.readouterr().err.strip() == line


def test_a_recipe_error_on_the_command_line_names_the_steps_key(capsys, tmp_path, tiny_llama_config):
    import json

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_llama_config))
    r = tmp_path / "r.yaml"
    r.write_text("version: 1\nsteps:\n  - rope: {type: yarn, factor: 2, layer_type: sliding_attention}\n")
    assert main(["apply", str(r), str(d), str(tmp_path / "o"), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvtool: error: {r}: steps[0].rope.layer_type: line 3: step 1 (rope): ")


@pytest.mark.parametrize("cmd", sorted(OPERATIONS))
def test_an_option_for_some_targets_or_methods_is_listed_under_them(capsys, cmd):
    """`applies` ("--to mla", "--method aware") names a declared flag and one of its choices (a flag alone for a
    switch), and --help lists the option in that section, not among every target's options."""
    cls = OPERATIONS[cmd]
    for f in fields_of(cls):
        for label in f.spec.applies:
            flag, _, value = label.partition(" ")
            other = next((g for g in fields_of(cls) if flag in g.flags), None)
            assert other is not None, f"{f.name}: {label}: no such flag"
            assert (value in (other.choices or ())) if value else other.base_type is bool, f"{f.name}: {label}"
    assert main([cmd, "--help"]) == 0
    sections, title = {}, None
    for line in capsys.readouterr().out.splitlines():
        if line and not line.startswith(" "):
            title = line.rstrip(":")
        elif line.startswith("  -"):
            sections.setdefault(title, []).append(line.split()[0].rstrip(","))
    for f in fields_of(cls):
        if f.spec.cli and not f.spec.positional:
            where = f"With {f.applies_to}" if f.applies_to else "Options"
            assert f.spec.short or f.flags[0] in sections.get(where, []), (f.name, where, sections)


def test_convert_help_groups_its_options_by_target():
    from kvtool.options.convert import ConvertOptions

    applies = {f.name: f.spec.applies for f in fields_of(ConvertOptions)}
    assert applies["kv_rank"] == applies["mla_solve"] == ("--to mla",) and applies["groups"] == ("--to gqa",)
    # --to mla calibrates too (kvtool/convert/mla/plan.py reads these): they are no --method aware options only
    for name in ("calib_dataset", "calib_text", "calib_tokens", "seq_len", "refine_steps", "distill_steps",
                 "serve_context"):
        assert "--to mla" in applies[name], name
    assert applies["grouping"] == ("--method aware",)  # --to mla refuses it
