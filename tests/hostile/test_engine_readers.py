"""A model file kvtool reads must be one the engine's own reader reads: a difference lets lint and kv-budget
answer for a checkpoint that vLLM / transformers cannot load.

The class: bytes that Python's permissive decoding accepts and the engines' readers refuse. A UTF-8 byte order
mark is dropped by Python's utf-8-sig (kvtool.io.inputfile.read_text), but transformers reads config.json,
tokenizer_config.json and the index with json.loads (`Unexpected UTF-8 BOM`) and tokenizer.json with serde_json:
kvtool refuses such a file with one line, and the oracle test asks transformers itself.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from harness import check_refusal

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"
BOM = b"\xef\xbb\xbf"

COMMANDS = {
    "lint": lambda m: ["lint", m],
    "kv-budget": lambda m: ["kv-budget", m],
    "rope": lambda m: ["rope", m, "--show"],
    "convert": lambda m: ["convert", m, "--dry-run", "--to", "mqa"],
    "eval": lambda m: ["eval", m, "--dry-run"],
    "quantize-kv": lambda m: ["quantize-kv", m, m.parent / "out", "--dry-run"],
}
# the file, and the commands that read it before anything is loaded (the loading commands' preflight reads them all)
READERS = {
    "config.json": sorted(COMMANDS),
    "tokenizer.json": ["eval", "quantize-kv"],
    "tokenizer_config.json": ["eval", "quantize-kv"],
}
CASES = [(name, cmd) for name, cmds in READERS.items() for cmd in cmds]


def _with_bom(tmp_path: Path, name: str) -> Path:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    (m / name).write_bytes(BOM + (m / name).read_bytes())
    return m


@pytest.mark.parametrize("name,command", CASES)
def test_a_byte_order_mark_is_refused_as_the_engine_refuses_it(tmp_path, name, command) -> None:
    m = _with_bom(tmp_path, name)
    check_refusal(COMMANDS[command](m), sources=[m], dst=tmp_path / "out", names=[str(m / name), "byte order mark"])


@pytest.mark.torch
@pytest.mark.parametrize("name", sorted(READERS))
def test_transformers_refuses_the_same_files(tmp_path, name) -> None:
    """The oracle: the engine's loader fails on each file the test above has kvtool refuse."""
    from transformers import AutoConfig, AutoTokenizer

    m = _with_bom(tmp_path, name)
    load = AutoConfig.from_pretrained if name == "config.json" else AutoTokenizer.from_pretrained
    with pytest.raises((OSError, ValueError)):  # json.JSONDecodeError is a ValueError
        load(str(m))
