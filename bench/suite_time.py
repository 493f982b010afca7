"""The test command's time at two revisions, measured in the same run on the same machine.

    python bench/suite_time.py tests/hostile tests/oracle          # these folders, before vs after
    python bench/suite_time.py --all                               # the whole default suite (README's command)
    python bench/suite_time.py --before 7758a76 --after HEAD --workers 2 --rounds 2 tests/hostile

Each revision is unpacked with `git archive` into a temporary folder (the committed tree only: no build outputs,
no caches) and its tests run there with `python -m pytest -q -n WORKERS -p no:cacheprovider PATHS`, with
PYTHONPATH pointing at that folder, one revision after the other, alternating over `--rounds`. Reported per run:
wall time, the CPU time of pytest and everything it started (user + system, from the children's rusage), the
1-minute load average when it started, and pytest's summary line; then the after / before ratios of the medians.
On a shared machine wall time follows the load; CPU time much less so: read both, with the load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from child_cpu import measured

REPO = Path(__file__).resolve().parents[1]
BEFORE = "7758a76"  # main before issue 40's part 4 (the suite's time)


def unpack(rev: str, into: Path) -> Path:
    """The committed tree of `rev` in a fresh folder."""
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", "--format=tar", rev], check=True,
                             capture_output=True).stdout
    with tempfile.TemporaryFile() as fh:
        fh.write(archive)
        fh.seek(0)
        with tarfile.open(fileobj=fh) as tar:
            tar.extractall(into, filter="data") if hasattr(tarfile, "data_filter") else tar.extractall(into)
    return into


def run_suite(tree: Path, paths: list[str], workers: int, extra: list[str]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree), PYTHONDONTWRITEBYTECODE="1")
    env.pop("PYTEST_ADDOPTS", None)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *extra]
    cmd += ["-n", str(workers)] if workers else ["-p", "no:xdist"]
    cmd += paths
    load = os.getloadavg()[0]
    p, wall, cpu = measured(cmd, cwd=tree, env=env)
    tail = [ln for ln in p.stdout.splitlines() if ln.strip()]
    summary = next((ln for ln in reversed(tail) if re.search(r"\d+ (passed|failed|errors?|tests? collected)\b", ln)),
                   f"{sum('::' in ln for ln in tail)} test ids listed" if "--co" in extra else tail[-1] if tail else "")
    return {"rc": p.returncode, "wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load_1m": round(load, 2),
            "summary": summary.strip("= "), "stdout_tail": "\n".join(tail[-30:])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("paths", nargs="*", help="test folders or files, relative to the repository root")
    ap.add_argument("--all", action="store_true", help="the whole default suite (pytest's testpaths)")
    ap.add_argument("--before", default=BEFORE, help=f"revision measured first in each round (default {BEFORE}; "
                    "'none': the after revision alone)")
    ap.add_argument("--after", default="HEAD", help="revision measured second (default HEAD)")
    ap.add_argument("--workers", type=int, default=2, help="pytest -n (0: no xdist; default 2, the README's)")
    ap.add_argument("--rounds", type=int, default=1, help="before/after pairs, alternating (default 1)")
    ap.add_argument("--json", type=Path, help="write the runs here too")
    ap.add_argument("--pytest-arg", action="append", default=[], help="one more pytest argument (repeatable)")
    a = ap.parse_args(argv)
    if not a.paths and not a.all:
        ap.error("name test paths, or --all")
    paths = [] if a.all else a.paths
    work = Path(tempfile.mkdtemp(prefix="kvtool-suite-time-"))
    runs: list[dict] = []
    sides = [(label, rev) for label, rev in (("before", a.before), ("after", a.after)) if rev != "none"]
    try:
        trees = {label: unpack(rev, work / label) for label, rev in sides}
        revs = {label: subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", rev], check=True,
                                      capture_output=True, text=True).stdout.strip()
                for label, rev in sides}
        for rnd in range(a.rounds):
            for label in trees:
                r = run_suite(trees[label], paths, a.workers, a.pytest_arg)
                r.update(label=label, rev=revs[label], round=rnd + 1)
                runs.append(r)
                print(f"{label:6} {revs[label]}  round {rnd + 1}: {r['wall_s']:7.1f} s wall  {r['cpu_s']:7.1f} s CPU"
                      f"  load {r['load_1m']:5.2f}  rc {r['rc']}  {r['summary']}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    med = {label: {k: statistics.median(r[k] for r in runs if r["label"] == label) for k in ("wall_s", "cpu_s")}
           for label in trees}
    print(f"paths: {' '.join(paths) or '(whole suite)'}; workers {a.workers}; rounds {a.rounds}")
    for k, name in (("wall_s", "wall"), ("cpu_s", "CPU")):
        if "before" not in med or "after" not in med:
            continue
        b, f = med["before"][k], med["after"][k]
        print(f"{name:4}: before {b:7.1f} s  after {f:7.1f} s  after/before {f / b:.2f}" if b else f"{name}: -")
    if a.json:
        a.json.write_text(json.dumps({"paths": paths, "workers": a.workers, "runs": runs, "median": med}, indent=1))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
