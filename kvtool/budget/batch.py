"""vLLM's default scheduler step (max_num_batched_tokens) and sequence cap (max_num_seqs), as data.

`vllm serve` and the offline LLM class pick both from the GPU they find when the flags are not given
(EngineArgs.get_batch_defaults): by release, platform, memory tier, device name and capability
(batch_defaults.json, each tier cited; tests/budget/test_batch_defaults.py runs every release's own function
against every GPU of gpus.json). kv-budget sizes what sliding / chunked layers reserve with the step.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtool.budget.gpus import GIB, Gpu
from kvtool.engines.ranges import contains
from kvtool.model.engine_tables import Table, load

USAGES = ("serve", "llm")  # UsageContext.OPENAI_API_SERVER, UsageContext.LLM_CLASS
OLDEST_READ = "0.10.2"


@lru_cache(maxsize=1)
def table() -> Table:
    data = load("kvtool/budget/batch_defaults.json")
    for t in data["tiers"]:
        if set(t["platforms"]) - {"cuda", "rocm", "cpu"} or set(USAGES) - set(t):
            raise ValueError(f"batch_defaults.json: tier {t.get('id')!r}")
    return data


@dataclass(frozen=True)
class BatchDefaults:
    max_num_batched_tokens: int
    max_num_seqs: int
    tier: str  # the tier's `says`
    citation: str
    release: str
    read: bool  # False: a release older than any read; the oldest read rules stand in
    clamp: bool  # the release cuts a default step to max_num_seqs x max_model_len


def _holds(t: dict, gpu: Gpu | None) -> bool:
    platform = gpu.platform if gpu is not None else "cuda"
    if platform not in t["platforms"]:
        return False
    memory = gpu.memory_bytes if gpu is not None else 0  # no GPU: vLLM's failed device query (memory 0)
    if memory < t.get("min_memory_gib", 0) * GIB:
        return False
    name = gpu.device_name.lower() if gpu is not None else ""
    if any(x in name for x in t.get("exclude_names", ())):
        return False
    return not (gpu is not None and gpu.capability in t.get("exclude_capabilities", ()))


def defaults(gpu: Gpu | None, release: str, usage: str = "serve", world_size: int = 1) -> BatchDefaults:
    """What vLLM `release` defaults to on `gpu` (None: no GPU named) for `usage` (serve | llm)."""
    data = table()
    read = contains(f">={OLDEST_READ}", release)
    at = release if read else OLDEST_READ
    for t in data["tiers"]:
        if contains(t["releases"], at) and _holds(t, gpu):
            scale = world_size if t.get("per_world_size") else 1
            return BatchDefaults(t[usage]["max_num_batched_tokens"] * scale, t[usage]["max_num_seqs"] * scale,
                                 t["says"], str(t["citation"]), release, read,
                                 contains(data["clamp"]["releases"], at))
    raise ValueError(f"batch_defaults.json: no tier for {gpu} at vLLM {release}")  # the last tier takes any GPU


def step(d: BatchDefaults, max_model_len: int) -> int:
    """The default step vLLM settles on for one model (the clamp of releases that have it)."""
    return min(d.max_num_batched_tokens, d.max_num_seqs * max_model_len) if d.clamp else d.max_num_batched_tokens
