"""A test-only seam for races: change a source file at a chosen moment inside a kvtool subprocess.

`env(file=..., when=..., change=...)` gives the environment for harness.run_kvtool / check_refusal: it
puts tests/hostile/race_site first on PYTHONPATH, whose sitecustomize.py calls `install` before kvtool
starts. Nothing in kvtool knows about it; it wraps two kvtool functions from outside:

- when="validated": right after the file's safetensors header was first read and validated
  (kvtool.io.safetensors_header.read_header), i.e. between the checks and any copy;
- when="opened": right after kvtool opened the file to copy or read it (kvtool.io.outputfile.open_source),
  i.e. during the copy.

change: truncate (to half), append (8 bytes), rewrite (the last 8 bytes, in place: same inode and size),
replace (a same-size file with other bytes renamed over it: a new inode).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ENV = "KVTOOL_TEST_RACE"
SITE = Path(__file__).with_name("race_site")
REPO = Path(__file__).resolve().parents[2]
WHEN = ("validated", "opened")
CHANGES = ("truncate", "append", "rewrite", "replace")


def env(*, file: str, when: str, change: str, nth: int = 1) -> dict:
    """nth: change the file after the nth validation or opening of it (a command may check it more than once)."""
    assert when in WHEN and change in CHANGES
    path = os.pathsep.join([str(SITE), str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {ENV: json.dumps({"file": file, "when": when, "change": change, "nth": nth}), "PYTHONPATH": path}


def mutate(path: Path, change: str) -> None:
    data = path.read_bytes()
    if change == "truncate":
        os.truncate(path, len(data) // 2)
    elif change == "append":
        with open(path, "ab") as fh:
            fh.write(b"\0" * 8)
    elif change == "rewrite":
        with open(path, "r+b") as fh:
            fh.seek(len(data) - 8)
            fh.write(bytes(b ^ 0xFF for b in data[-8:]))
    else:
        other = path.with_name(path.name + ".racing")
        other.write_bytes(data[:-8] + bytes(b ^ 0xFF for b in data[-8:]))
        os.replace(other, path)


def install() -> None:
    spec = json.loads(os.environ[ENV])
    state = {"seen": 0}

    def fire(path) -> None:
        if Path(path).name == spec["file"]:
            state["seen"] += 1
            if state["seen"] == spec["nth"]:
                mutate(Path(path), spec["change"])

    import kvtool.io.outputfile as outputfile
    import kvtool.io.safetensors_header as header

    real_read, real_open = header.read_header, outputfile.open_source

    def read_header(path, file=None):
        h = real_read(path, file)
        if spec["when"] == "validated":
            fire(path)
        return h

    def open_source(path, expect=None):
        opened = real_open(path, expect)
        if spec["when"] == "opened":
            fire(path)
        return opened

    header.read_header = read_header  # before any kvtool module binds the names
    outputfile.open_source = open_source
