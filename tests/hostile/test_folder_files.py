"""Files kvtool does not parse itself but transformers opens: every one gets the link and size check first.

The cases are generated from kvtool's table (kvtool.io.model_files.MODEL_FILES, which tests/io/test_model_files.py
checks against transformers' own loaders): each listed file, planted as a symlink to a secret outside the
folder, is refused by name in every command before anything reads it; an oversized chat template is refused
by its size, unread.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from harness import check_refusal, command_args

from kvtool.io.model_files import MODEL_FILES, TEMPLATE_DIR, TEMPLATE_LIMIT

TINY = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
SECRET = '{"api_token": "hunter2"}'


def _commands(m: Path, ws: Path) -> dict:
    return command_args(m, ws)


COMMANDS = ["lint", "kv-budget", "convert", "eval", "quantize-kv", "rope", "apply"]


@pytest.fixture
def ws(tmp_path) -> Path:
    shutil.copytree(TINY, tmp_path / "m")
    (tmp_path / "secret.json").write_text(SECRET)
    return tmp_path


def _plant_link(m: Path, rel: str, secret: Path) -> Path:
    path = m / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists():
        path.unlink()
    path.symlink_to(secret)
    return path


def _index_outside(m: Path, ws: Path) -> Path:
    """A real index (naming the real shard), kept outside and linked in: it must still not be read."""
    from safetensors import safe_open

    with safe_open(str(m / "model.safetensors"), "np") as f:
        names = list(f.keys())
    outside = ws / "index.json"
    outside.write_text(json.dumps({"metadata": {}, "weight_map": {n: "model.safetensors" for n in names}}))
    return outside


# The files the issue names, in every command
NAMED = ["model.safetensors.index.json", "tokenizer_config.json", "chat_template.jinja",
         f"{TEMPLATE_DIR}/tool_use.jinja", "tokenizer.model", "special_tokens_map.json"]


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("rel", NAMED)
def test_every_command_refuses_a_listed_file_linked_outside(ws, command, rel) -> None:
    m = ws / "m"
    secret = _index_outside(m, ws) if rel == "model.safetensors.index.json" else ws / "secret.json"
    link = _plant_link(m, rel, secret)
    args, dst = _commands(m, ws)[command]
    r = check_refusal(args, sources=[m, secret], dst=dst, names=[str(link), "outside the model folder"])
    assert "hunter2" not in r.stdout + r.stderr


# Every row of the table (one name each pattern matches), in the command that hands the folder to transformers
ROWS = [r for r in MODEL_FILES if r.kind in ("json", "template", "vocabulary") and r.pattern != "config.json"]


@pytest.mark.parametrize("pattern", [r.pattern for r in ROWS])
def test_eval_refuses_every_table_file_linked_outside(ws, pattern) -> None:
    m = ws / "m"
    link = _plant_link(m, pattern.replace("*", "x"), ws / "secret.json")
    args, dst = _commands(m, ws)["eval"]
    check_refusal(args, sources=[m, ws / "secret.json"], dst=dst, names=[str(link), "outside the model folder"])


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("rel", ["chat_template.jinja", f"{TEMPLATE_DIR}/default.jinja"])
def test_every_command_refuses_an_oversized_chat_template_unread(ws, command, rel) -> None:
    """A 300 MiB template (sparse: no disk used) is refused by its size in seconds, never read whole."""
    m = ws / "m"
    path = m / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("wb") as fh:
        fh.truncate(300 * 1024 * 1024)
    args, dst = _commands(m, ws)[command]
    r = check_refusal(args, sources=[m], dst=dst, names=[str(path), f"{TEMPLATE_LIMIT} byte limit"], timeout=30)
    assert r.seconds < 15


@pytest.mark.parametrize("field,name", [("configuration_files", "config.json"),
                                        ("fast_tokenizer_files", "tokenizer_config.json")])
def test_a_file_list_naming_a_path_outside_is_refused_before_a_load(ws, field, name) -> None:
    """transformers picks a versioned file from these lists and opens it joined to the folder."""
    m = ws / "m"
    (ws / "config.9.9.json").write_text((m / "config.json").read_text())
    data = json.loads((m / name).read_text())
    data[field] = ["../config.9.9.json"]
    (m / name).write_text(json.dumps(data))
    args, dst = _commands(m, ws)["eval"]
    check_refusal(args, sources=[m], dst=dst, names=[str(m / name), f"{field}[0]"])
