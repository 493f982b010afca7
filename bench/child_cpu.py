"""One child process, timed: wall seconds and the CPU seconds it and its children used (user + system).

On the shared machine the CPU seconds are the measure the benchmarks compare: other users' load stretches wall
time unevenly between two runs, not the work done. Imported by the scripts beside it (run as `python bench/X.py`).
"""

from __future__ import annotations

import resource
import subprocess
import time


def measured(cmd: list[str], **run) -> tuple[subprocess.CompletedProcess, float, float]:
    """subprocess.run(cmd, capture_output=True, text=True, **run), its wall seconds and its CPU seconds."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, **run)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return out, wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
