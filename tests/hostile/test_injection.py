"""CI and terminal injection through values (issue 31, class 4), generated.

A hostile string (terminal escapes, CR / LF, U+2028, bidi overrides, lone surrogates, `::error ...::` and
`##[error]` workflow commands, GitHub's own %0A) goes into one place a value comes from: a config field or
key, a folder name, a tensor name, safetensors metadata, tokenizer_config.json, a recipe's name or step
option. Every command that reads that place runs through the harness (a subprocess, as CI runs kvtool), in
every output format, and every line it prints on stdout and stderr must hold no raw control character and
start no workflow command but the annotations `--format github` means; JSON stays JSON with the same data;
and the documented contract holds: exit 0 / 1 / 2, an exit 2 is exactly one `kvtool: error:` line, no
traceback, no internal error.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from contract import check_output
from harness import run_kvtool
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from kvtest import HOSTILE_PIECES, runner_command

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
EXAMPLES = int(os.environ.get("KVTOOL_HOSTILE_EXAMPLES", "3"))  # generated cases per command (CI: 3)
ISSUE = "llama\r\n::error file=x::forged"  # the issue's example: kv-budget printed a workflow command

hostile = st.lists(st.sampled_from(HOSTILE_PIECES), min_size=1, max_size=6).map("".join)


def _set(cfg: dict, dotted: str, value) -> None:
    *parents, last = dotted.split(".")
    node = cfg
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value


def _config(folder: Path, dotted: str, value) -> None:
    path = folder / "config.json"
    cfg = json.loads(path.read_text())
    if dotted == "layer_types.0":
        cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    if dotted == "<key>":
        cfg[value] = 1
    else:
        _set(cfg, dotted, value)
    path.write_text(json.dumps(cfg, indent=2))  # ASCII with \u escapes: lone surrogates survive


def _header(folder: Path, edit) -> None:
    """Edit model.safetensors' header (an extra 4-byte tensor's data appended when edit returns True)."""
    path = folder / "model.safetensors"
    data = path.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    end = len(data) - 8 - n
    tail = b"\0\0\0\0" if edit(header, end) else b""
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data[8 + n:] + tail)


def _tensor(header, end, value):
    header[value] = {"dtype": "F32", "shape": [1], "data_offsets": [end, end + 4]}
    return True


def _metadata(header, end, value):
    header["__metadata__"] = {"format": "pt", "note": value}


def _tokenizer(folder: Path, value) -> None:
    path = folder / "tokenizer_config.json"
    tc = json.loads(path.read_text())
    tc["tokenizer_class"] = value
    path.write_text(json.dumps(tc))


# where a value comes from -> how the case writes it (folder, recipe dict, value)
PLACES = {
    **{f"config:{k}": (lambda f, r, v, k=k: _config(f, k, v)) for k in (
        "model_type", "architectures.0", "hidden_act", "dtype", "rope_parameters.rope_type", "<key>",
        "layer_types.0", "quantization_config.quant_method", "sliding_window", "_name_or_path")},
    "tensor-name": lambda f, r, v: _header(f, lambda h, e: _tensor(h, e, v)),
    "safetensors-metadata": lambda f, r, v: _header(f, lambda h, e: _metadata(h, e, v)),
    "tokenizer_config": lambda f, r, v: _tokenizer(f, v),
    "recipe:name": lambda f, r, v: r.update(name=v),
    "recipe:description": lambda f, r, v: r.update(description=v),
    "recipe:step-option": lambda f, r, v: r["steps"][0]["convert"].update(to=v),
    "folder-name": None,  # the model folder (and DST beside it) named with the value
}


def _folder_name(value: str) -> str:
    """The value as a file name Linux takes: no / or NUL, surrogates only where bytes decode to them."""
    name = "".join(c for c in value if c not in "/\0" and not ("\ud800" <= c < "\udc80"))
    while len(os.fsencode(name)) > 200:
        name = name[:-1]
    return name if name not in ("", ".", "..") else f"m{name}x"


def _case(root: Path, place: str, value: str) -> tuple[Path, Path, Path]:
    """(model folder, recipe, DST) with the value written into `place`."""
    name = _folder_name(value) if place == "folder-name" else "m"
    model = root / name
    shutil.copytree(TINY, model)
    recipe = {"version": 1, "name": "r", "steps": [{"convert": {"to": "mqa"}}]}
    if PLACES[place] is not None:
        PLACES[place](model, recipe, value)
    recipe_path = root / "r.yaml"
    recipe_path.write_text(json.dumps(recipe))  # JSON is YAML; \u escapes carry every value
    return model, recipe_path, root / f"{name}-out"


COMMANDS = {  # name -> (arguments, output format)
    "lint": (lambda m, r, o: ["lint", m], "text"),
    "lint-github": (lambda m, r, o: ["lint", m, "--format", "github"], "github"),
    "lint-json": (lambda m, r, o: ["lint", m, "--format", "json"], "json"),
    "lint-sarif": (lambda m, r, o: ["lint", m, "--format", "sarif"], "json"),
    "lint-recipe": (lambda m, r, o: ["lint", r, "--format", "github"], "github"),
    "kv-budget": (lambda m, r, o: ["kv-budget", m, "--gpu", "L4"], "text"),
    "kv-budget-json": (lambda m, r, o: ["kv-budget", m, "--format", "json"], "json"),
    "rope-show": (lambda m, r, o: ["rope", m, "--show"], "text"),
    "rope": (lambda m, r, o: ["rope", m, o, "--type", "linear", "--factor", "2"], "text"),
    "convert-dry-run": (lambda m, r, o: ["convert", m, "--to", "mqa", "--dry-run"], "text"),
    "convert": (lambda m, r, o: ["convert", m, o, "--to", "mqa", "--no-eval"], "text"),
    "apply-dry-run": (lambda m, r, o: ["apply", r, m, o, "--dry-run"], "text"),
    "apply-json": (lambda m, r, o: ["apply", r, m, o, "--format", "json"], "json"),
    "quantize-kv-dry-run": (lambda m, r, o: ["quantize-kv", m, "--dry-run"], "text"),
    "eval-dry-run": (lambda m, r, o: ["eval", m, "--dry-run"], "text"),
}
def _strings(obj):
    if isinstance(obj, str):
        yield obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)


@pytest.mark.parametrize("command", sorted(COMMANDS))
@settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(place=st.sampled_from(sorted(PLACES)), value=hostile)
@example(place="config:model_type", value=ISSUE)
@example(place="folder-name", value="::error file=x::forged\x1b]0;t\x07\u202e\udcff")
@example(place="recipe:name", value="r\n::set-output name=a::b\u2028##[error]x")
@example(place="tensor-name", value="w\r\n::warning::x\x9b2J")
@example(place="config:<key>", value="%0A::error::k\x7f")
def test_hostile_values_reach_no_terminal_or_ci_log_raw(command, place, value) -> None:
    root = Path(tempfile.mkdtemp(prefix="kvtool-inject-"))
    try:
        model, recipe, out = _case(root, place, value)
        args, fmt = COMMANDS[command]
        r = run_kvtool(args(model, recipe, out))
        check_output(r, fmt, f"kvtool {command} with {place} = {value!r}\nrc={r.rc}\nstdout:\n{r.stdout[-3000:]}"
                             f"\nstderr:\n{r.stderr}")
        if fmt == "json" and r.rc != 2:  # the same data: a value JSON carries is carried exactly
            data = json.loads(r.stdout)
            if command == "kv-budget-json" and place == "config:model_type":
                assert data["model_type"] == value
            if place == "folder-name" and command != "lint-sarif":  # (SARIF names only files with findings)
                assert any(model.name in s for s in _strings(data)), r.stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)


def test_the_issue_example_is_shown_not_run(tmp_path) -> None:
    # kv-budget printed `::error file=x::forged` as a line of its own; now the whole value stays on its line
    model, _, _ = _case(tmp_path, "config:model_type", ISSUE)
    r = run_kvtool(["kv-budget", model])
    assert r.rc == 0, r.stderr
    assert "llama\\r\\n::error file=x::forged" in r.stdout.splitlines()[0]
    assert not any(runner_command(line) for line in r.stdout.splitlines())
