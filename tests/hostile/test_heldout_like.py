"""Hostile inputs found by probing past the other hostile suites: each class, every command that reads it.

config.json whose top level is a JSON scalar (null, a number, a string); a `layer_types` that
transformers would refuse (unknown names, wrong length, not a list), which commands used to
accept and then compute every per-layer figure (and the converted model) from.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import check_refusal

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"


def _commands(m: Path, out: Path) -> dict:
    recipe = out.parent / "r.yaml"
    recipe.write_text("version: 1\nname: r\nsteps:\n  - convert: {to: mqa}\n")
    return {
        "lint": (["lint", m], None),
        "kv-budget": (["kv-budget", m, "--gpu", "L4"], None),
        "convert": (["convert", m, out, "--to", "mqa"], out),
        "convert-dry-run": (["convert", m, "--to", "mqa", "--dry-run"], None),
        "rope": (["rope", m, out, "--type", "linear", "--factor", "2"], out),
        "rope-show": (["rope", m, "--show"], None),
        "apply": (["apply", recipe, m, out], out),
    }


@pytest.fixture
def model(tmp_path):
    folder = tmp_path / "m"
    shutil.copytree(TINY, folder)
    return folder


@pytest.mark.parametrize("command", ["lint", "kv-budget", "convert", "rope-show", "apply"])
@pytest.mark.parametrize("text", ["null", "7", '"llama"', "true"])
def test_config_json_that_is_a_json_scalar(model, tmp_path, command, text) -> None:
    (model / "config.json").write_text(text)
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(model / "config.json")])


LAYER_TYPES = {
    "unknown-names": (["bogus"] * 4, "layer_types[0]"),
    "too-few": (["full_attention"] * 2, "layer_types"),
    "too-many": (["full_attention"] * 9, "layer_types"),
    "not-a-list": ("full_attention", "layer_types"),
}


@pytest.mark.parametrize("command", ["kv-budget", "convert", "convert-dry-run", "rope", "rope-show", "apply"])
@pytest.mark.parametrize("case", sorted(LAYER_TYPES))
def test_commands_refuse_layer_types_transformers_refuses(model, tmp_path, command, case) -> None:
    value, field = LAYER_TYPES[case]
    cfg = json.loads((model / "config.json").read_text())
    cfg["layer_types"] = value
    (model / "config.json").write_text(json.dumps(cfg))
    args, dst = _commands(model, tmp_path / "out")[command]
    check_refusal(args, sources=[model], dst=dst, names=[str(model / "config.json"), f": {field}: "])
