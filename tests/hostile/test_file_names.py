"""Names that are not UTF-8: a folder or file of the checkpoint named with bytes that do not decode (Python hands
them over as lone surrogates) must not turn any command into an internal error or invalid output. Each command
either works (JSON output still valid UTF-8 JSON; text shows the name's bytes, as ls does), or refuses in one line.

Found by the second red-team pass (issue 31): a shard named `model\\xff.safetensors` made `convert` hash its name
as UTF-8 and stop with `internal error: UnicodeEncodeError`.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "examples" / "llama-gqa-tiny"
BAD = b"\xff\xfe"  # not UTF-8: os.fsdecode gives "\udcff\udcfe"

WHERE = {
    "model-folder": lambda m: os.rename(m, os.fsencode(m) + BAD) or Path(os.fsdecode(os.fsencode(m) + BAD)),
    "shard": lambda m: os.rename(m / "model.safetensors", os.fsencode(m / "model") + BAD + b".safetensors") or m,
    "side-file": lambda m: [(m / os.fsdecode(b"notes" + BAD + b".md")).write_text("# notes\n"), m][1],
}
COMMANDS = {
    "lint": lambda m, out: ["lint", m],
    "lint-json": lambda m, out: ["lint", m, "--format", "json"],
    "lint-sarif": lambda m, out: ["lint", m, "--format", "sarif"],
    "lint-github": lambda m, out: ["lint", m, "--format", "github"],
    "kv-budget": lambda m, out: ["kv-budget", m],
    "kv-budget-json": lambda m, out: ["kv-budget", m, "--format", "json"],
    "rope-show": lambda m, out: ["rope", m, "--show"],
    "rope": lambda m, out: ["rope", m, out, "--type", "linear", "--factor", "2"],
    "convert-dry-run": lambda m, out: ["convert", m, "--dry-run", "--to", "mqa"],
    "convert": lambda m, out: ["convert", m, out, "--to", "mqa", "--no-eval"],
    "quantize-kv-dry-run": lambda m, out: ["quantize-kv", m, out, "--dry-run"],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("where", sorted(WHERE))
def test_names_that_are_not_utf8(tmp_path, where, command) -> None:
    m = tmp_path / "m"
    shutil.copytree(TINY, m)
    m = WHERE[where](m)
    out = tmp_path / os.fsdecode(b"out" + BAD)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("KVTOOL_DEBUG", None)
    p = subprocess.run([sys.executable, "-m", "kvtool", *map(os.fsencode, COMMANDS[command](m, out))], env=env,
                       capture_output=True, stdin=subprocess.DEVNULL, timeout=120)
    err = p.stderr.decode("utf-8", "replace")
    what = f"{command} ({where}): rc {p.returncode}\n{err}"
    assert "Traceback" not in err and "internal error" not in err, what
    if p.returncode == 2:
        assert len([ln for ln in err.splitlines() if ln.strip()]) == 1, what
        return
    assert p.returncode in (0, 1), what
    if command.endswith(("-json", "-sarif")):  # JSON stays valid UTF-8 JSON, whatever the names were
        json.loads(p.stdout.decode("utf-8"))
    if command in ("rope", "convert"):
        assert (out / "config.json").is_file(), what
