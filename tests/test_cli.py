"""kvtool.cli: one error format for usage errors, plain --help, and what to install when torch is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtool.cli import main
from kvtool.commands import MODULES as COMMAND_MODULES

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = str(REPO / "examples" / "llama-gqa-tiny")
COMMANDS = [m.replace("_", "-") for m in COMMAND_MODULES] + ["rule"]


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.parametrize("args,line", [
    (["convert"], "kvtool: error: SRC: missing required argument; usage: kvtool convert [OPTIONS] SRC DST "
                  "(see kvtool convert --help)"),
    (["convert", EXAMPLE], "kvtool: error: --to: missing required option; usage: kvtool convert [OPTIONS] SRC DST "
                           "(see kvtool convert --help)"),
    (["lint", "--bogus", EXAMPLE], "kvtool: error: --bogus: no such option; usage: kvtool lint [OPTIONS] PATHS... "
                                   "(see kvtool lint --help)"),
    (["convert", EXAMPLE, "x", "--to", "gqa", "--groups", "two"],
     "kvtool: error: --groups: 'two' is not a valid integer; usage: kvtool convert [OPTIONS] SRC DST "
     "(see kvtool convert --help)"),
    (["frobnicate"], "kvtool: error: no such command 'frobnicate'; usage: kvtool [OPTIONS] COMMAND [ARGS]... "
                     "(see kvtool --help)"),
])
def test_usage_errors_are_one_line_in_the_documented_format(capsys, args, line):
    rc, out, err = _run(capsys, *args)
    assert (rc, out, err) == (2, "", line + "\n")


def test_misspelt_option_suggests_the_right_one(capsys):
    rc, _, err = _run(capsys, "lint", "--strct", EXAMPLE)
    assert rc == 2 and err.startswith("kvtool: error: --strct: no such option (did you mean ") and "--strict" in err


def test_convert_dst_is_required_except_with_dry_run(capsys):
    rc, _, err = _run(capsys, "convert", EXAMPLE, "--to", "mqa")
    assert rc == 2 and err == "kvtool: error: DST: missing required argument (only --dry-run goes without one)\n"
    rc, out, _ = _run(capsys, "convert", EXAMPLE, "--to", "mqa", "--dry-run")
    assert rc == 0 and "kvtool convert plan" in out


@pytest.mark.parametrize("command", COMMANDS)
def test_help_has_no_escaped_brackets_and_describes_arguments(capsys, command):
    rc, out, _ = _run(capsys, command, "--help")
    assert rc == 0 and out.startswith(f"Usage: kvtool {command} ")
    assert "\\[" not in out  # typer escapes [required] / [default: ...] for rich; plain help must not show it
    assert out.count("rguments:") <= 1, out  # one arguments section, not click's and typer's both
    import typer

    from kvtool.cli import app

    params = typer.main.get_command(app).commands[command].params
    has_arguments = any(p.param_type_name == "argument" for p in params)
    assert ("Arguments:" in out) == has_arguments, out  # (the check below ran only when a section was found)
    if has_arguments:
        section = out.split("rguments:", 1)[1].split("Options:", 1)[0]
        for line in section.strip().splitlines():
            if line.startswith("  ") and not line.startswith("    "):  # one row per argument
                assert len(line.split()) > 1, f"argument without help: {line!r}"


def test_top_level_help_lists_every_command(capsys):
    rc, out, _ = _run(capsys, "--help")
    assert rc == 0 and all(f"  {c} " in out for c in COMMANDS if c != "rule") and "\\[" not in out


def test_convert_usage_shows_dst_as_required(capsys):
    _, out, _ = _run(capsys, "convert", "--help")
    assert out.startswith("Usage: kvtool convert [OPTIONS] SRC DST\n")
    assert "required, except with --dry-run" in out
    _, out, _ = _run(capsys, "rope", "--help")
    assert "required unless --in-place or --show" in out


# --- torch missing: what to install, one line, exit 2 ----------------------------------------------------

NO_TORCH = ("import sys\n"
            "for name in ('torch', 'transformers', 'safetensors', 'accelerate'):\n"
            "    sys.modules[name] = None  # an installation without the kvtool[torch] extra\n"
            "from kvtool.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")


def _without_torch(tmp_path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVTOOL_DEBUG", None)
    return subprocess.run([sys.executable, "-c", NO_TORCH, *args], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


@pytest.mark.parametrize("args,who", [
    (["eval", EXAMPLE], "kvtool eval"),
    (["convert", EXAMPLE, "out", "--to", "mqa", "--eval"], "kvtool convert --eval"),
    (["convert", EXAMPLE, "out", "--to", "mqa", "--method", "aware"], "kvtool convert --method aware"),
    (["quantize-kv", EXAMPLE, "out"], "kvtool quantize-kv"),
])
def test_missing_torch_says_what_to_install(tmp_path, args, who):
    p = _without_torch(tmp_path, *args)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    line = lines[0]
    assert line.startswith(f"kvtool: error: {who} needs torch, which is not installed")
    assert "internal error" not in line and "Traceback" not in p.stderr
    assert "pip install torch==2.13.0" in line and 'pip install "kvtool[torch]"' in line
    assert not (tmp_path / "out").exists()  # refused before any work


def test_missing_torch_deep_inside_a_command_is_the_same_line(tmp_path):
    """A ModuleNotFoundError for torch from any lazy import site becomes the same message (kvtool.cli.main)."""
    code = ("import sys\n"
            "sys.modules['torch'] = None\n"
            "import typer\n"
            "from kvtool.cli import app, main\n"
            "@app.command('needs-torch')\n"
            "def needs_torch() -> None:\n"
            "    import torch  # noqa: F401\n"
            "sys.exit(main(['needs-torch']))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("KVTOOL_DEBUG", None)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "pip install torch==2.13.0" in p.stderr, p.stderr
    assert p.stderr.startswith("kvtool: error: kvtool needs-torch needs torch, which is not installed")


def test_torch_free_commands_still_work_without_torch(tmp_path):
    p = _without_torch(tmp_path, "convert", EXAMPLE, "out", "--to", "mqa", "--no-eval", "--no-progress")
    assert p.returncode == 0 and (tmp_path / "out" / "config.json").is_file(), p.stderr


def test_an_error_raised_after_a_signal_is_the_interrupts(capsys, monkeypatch):
    # numpy interrupted mid-import raises ImportError ("PyCapsule_Import could not import module datetime"), not
    # KeyboardInterrupt: once kvtool's handler has seen a signal, that error exits 130 with the interrupt's line
    import kvtool.commands.argv as argv_mod
    from kvtool import errors

    def interrupted_import(_argv):
        errors.SIGNALS_RECEIVED.append(2)
        raise ImportError("PyCapsule_Import could not import module \"datetime\"")

    monkeypatch.setattr(argv_mod, "direct_call", interrupted_import)
    try:
        rc, _, err = _run(capsys, "lint", EXAMPLE)
        assert (rc, err.strip()) == (130, "kvtool: interrupted: nothing was written")
    finally:
        errors.SIGNALS_RECEIVED.clear()
    monkeypatch.setattr(argv_mod, "direct_call", lambda _argv: (_ for _ in ()).throw(ImportError("x")))
    rc, _, err = _run(capsys, "lint", EXAMPLE)  # without a signal the same error is kvtool's own
    assert rc == 2 and "internal error: ImportError" in err
