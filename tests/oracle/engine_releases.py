"""The transformers releases the engine lane runs, where they live, and how they get there.

Each release is installed once with `pip install --target ~/.cache/kvtool/engines/transformers-X transformers==X`
(beside the installed CPU torch, which the target folder does not carry) and reused: `python
tests/oracle/engine_releases.py install` (what scripts/engine_lane.sh runs first). 4.38 / 4.39 need tokenizers
< 0.19 (their pin), which pip resolves itself inside the target. The release installed in the environment itself
(transformers 5.24 here, 5.25 in CI) runs from site-packages.

`run_probe(version, cases)` starts tests/oracle/engine_probe.py in a subprocess with the release's folder first
on sys.path (PYTHONPATH) and returns what the release did with each case.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("KVTOOL_ENGINE_CACHE", Path.home() / ".cache" / "kvtool" / "engines"))
# Six-plus releases from 4.38 to the newest, one per behaviour change the facts table names (4.43 rope_type,
# 4.45 llama head_dim, 4.51 qwen3 / gemma3 types, 4.53 layer_types, 4.56 dtype, 5.0 rope_parameters), and the newest
# read (the one CI installs, .ci/constraints.txt) beside the one before it.
RELEASES = ("4.38.2", "4.40.2", "4.43.4", "4.44.2", "4.46.3", "4.51.3", "4.57.6", "5.0.0", "5.24.0", "5.25.0")
# pins a release needs beside it, from its own dependency table: pip's newest tokenizers would not import in 4.38-4.39;
# 5.0.0 builds no model with the environment's kernels 0.19 (5.25's: "Either a revision or a version must be
# specified"), and kernels is an optional import pip does not install into the target
EXTRA = {"4.38.2": ("tokenizers<0.19",), "4.39.3": ("tokenizers<0.19",), "5.0.0": ("kernels>=0.10.2,<0.11",)}


def installed_release() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("transformers")
    except metadata.PackageNotFoundError:
        return None


def folder(version: str) -> Path | None:
    """The --target folder of a release (None: the environment's own install is that release)."""
    return None if version == installed_release() else CACHE / f"transformers-{version}"


def is_ready(version: str) -> bool:
    f = folder(version)
    return f is None or (f / ".complete").is_file()


def install(version: str) -> None:
    """pip install --target the release (and its own dependencies, torch excepted) into the cache, atomically."""
    target = folder(version)
    if target is None or is_ready(version):
        return
    tmp = Path(tempfile.mkdtemp(prefix=f".transformers-{version}-", dir=CACHE))
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-cache-dir", "--target", str(tmp),
           f"transformers=={version}", *EXTRA.get(version, ())]
    subprocess.run(cmd, check=True)
    for heavy in ("torch", "nvidia", "bin"):  # never shadow the environment's CPU torch
        subprocess.run(["rm", "-rf", str(tmp / heavy)], check=True)
    (tmp / ".complete").touch()
    if target.exists():
        subprocess.run(["rm", "-rf", str(target)], check=True)
    tmp.rename(target)


def run_probe(version: str, cases: list[dict], *, timeout: float = 1800) -> dict[str, dict]:
    """case id -> what `version` did with it (tests/oracle/engine_probe.py), in a subprocess."""
    env = dict(os.environ)
    f = folder(version)
    env["PYTHONPATH"] = str(f) if f is not None else ""  # the release first; never the checkout's kvtool
    env["HF_HUB_OFFLINE"] = "1"
    env["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        inp, out = Path(tmp) / "cases.jsonl", Path(tmp) / "out.jsonl"
        inp.write_text("".join(json.dumps(c) + "\n" for c in cases), encoding="utf-8")
        subprocess.run([sys.executable, str(HERE / "engine_probe.py"), str(inp), str(out)], env=env, check=True,
                       timeout=timeout, cwd=tmp)
        lines = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    head, results = lines[0], lines[1:]
    if head["transformers"] != version:
        raise RuntimeError(f"asked for transformers {version}, the probe ran {head['transformers']} ({head['file']})")
    return {r["id"]: r for r in results}


if __name__ == "__main__":
    if sys.argv[1:] != ["install"]:
        raise SystemExit("usage: python tests/oracle/engine_releases.py install")
    CACHE.mkdir(parents=True, exist_ok=True)
    for v in RELEASES:
        print(f"transformers {v}: {'ready' if is_ready(v) else 'installing'}", flush=True)
        install(v)
