"""Built-in GPU memory table (gpus.json) and `--gpu-memory` parsing."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import lru_cache

from kvtool.errors import UsageError
from kvtool.model.engine_tables import load
from kvtool.units import parse_size

GIB = 2**30


PLATFORMS = ("cuda", "rocm", "cpu")


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int
    basis: str  # nvidia-smi | nominal | user
    # what vLLM's batch defaults read besides memory (kvtool/budget/batch_defaults.json); a --gpu-memory size
    # has no name or capability: vLLM's tiers then see only its memory
    platform: str = "cuda"
    device_name: str = ""  # Platform.get_device_name
    capability: str | None = None  # "9.0"


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


@lru_cache(maxsize=1)
def table() -> dict[str, Gpu]:
    """Normalised name or alias -> Gpu."""
    data = load("kvtool/budget/gpus.json")
    out: dict[str, Gpu] = {}
    for row in data["gpus"]:
        if row["platform"] not in PLATFORMS:
            raise ValueError(f"gpus.json: {row['name']}: platform {row['platform']!r}")
        gpu = Gpu(row["name"], int(row["memory_mib"]) * 2**20, row["basis"], row["platform"], row["device_name"],
                  row.get("capability"))
        for key in (row["name"], *row.get("aliases", ())):
            out[_norm(key)] = gpu
    return out


def names() -> list[str]:
    return sorted({g.name for g in table().values()})


def resolve(text: str) -> Gpu:
    """'80GiB' / '85899345920' / 'H100-80GB' / 'nvidia h200' -> Gpu. UsageError names the option."""
    key = _norm(text).removeprefix("nvidia")
    if key in table():
        return table()[key]
    try:
        size = parse_size(text)
    except ValueError:
        raise UsageError(f"{text!r} is neither a size (80GiB, 24GB) nor a known GPU ({', '.join(names())})",
                         option="gpu_memory") from None
    if size <= 0:
        raise UsageError(f"{text!r}: GPU memory must be positive", option="gpu_memory")
    return Gpu(text.strip(), size, "user")
