"""Shared helpers for the kv-budget tests: run the CLI in-process and read its JSON."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.cli import main

DATA = Path(__file__).resolve().parents[1] / "data" / "budget"
GIB = 2**30


def config(name: str) -> str:
    return str(DATA / f"{name}.json")


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = main(["kv-budget", *args])
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *args: str, rc_expected: int = 0) -> dict:
    rc, out, err = run(capsys, *args, "--format", "json")
    assert rc == rc_expected, (rc, err)
    return json.loads(out)
