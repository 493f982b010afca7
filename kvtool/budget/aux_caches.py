"""Caches vLLM keeps per layer beside K/V, per architecture (aux_caches.json, each row cited).

DeepSeek-V3.2's and GLM-5's lightning indexer caches its own FP8 keys (plus a scale per 128 values) in every
layer that runs it. vLLM puts that cache in the same block pool as the MLA latent (one uniform-type group: a
block holds every layer's page), so a token costs the latent plus the indexer row, and every tensor-parallel GPU
holds both whole.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtool.engines.ranges import contains
from kvtool.model.engine_tables import Table, cited, load


@lru_cache(maxsize=1)
def table() -> Table:
    data = load("kvtool/budget/aux_caches.json")
    for row in data["caches"]:
        if row["layers"] not in RULES or row["layers"] not in data["rules"]:
            raise ValueError(f"aux_caches.json: {row['id']}: layer rule {row['layers']!r}")
    return data


@dataclass(frozen=True)
class AuxCache:
    """One auxiliary cache of a model: the layers that keep it and its bytes per token in each."""

    id: str
    what: str
    layers: tuple[int, ...]
    bytes_per_token: int  # per layer, on every GPU when replicated
    replicated: bool
    citation: str  # in words (kvtool.model.engine_tables.cited)


def _int(v, default: int) -> int:
    """A positive config size up to 2^20 (junk is lint's to report), else the default."""
    return v if isinstance(v, int) and not isinstance(v, bool) and 0 < v <= 1 << 20 else default


def _index_topk_freq(config: dict, n: int, release: str, rule: dict) -> tuple[int, ...]:
    if not contains(rule["releases"], release):
        return tuple(range(n))
    pattern = config.get("index_topk_pattern")
    if isinstance(pattern, (list, str)) and pattern:
        return tuple(i for i in range(n) if not (i < len(pattern) and pattern[i] == "S"))
    freq, offset = _int(config.get("index_topk_freq"), 1), config.get("index_skip_topk_offset", 2)
    offset = offset if isinstance(offset, int) and not isinstance(offset, bool) else 2
    return tuple(i for i in range(n) if max(i - offset + 1, 0) % freq == 0)


RULES = {"index_topk_freq": _index_topk_freq}


def caches(spec, release: str) -> list[AuxCache]:
    """The auxiliary caches vLLM `release` keeps for this model (none for most)."""
    out = []
    types = {spec.model_type, spec.config.get("model_type")}
    config = spec.config  # the text model's
    for row in table()["caches"]:
        if not types & set(row["model_types"]) or row["requires"] not in config:
            continue
        if not contains(row["releases"], release):
            continue
        dim = _int(config.get(row["dim"]), row["dim_default"])
        per_token = dim * row["dtype_bytes"] + dim // row["scale_block"] * row["scale_bytes"]
        layers = RULES[row["layers"]](config, len(spec.layer_types), release, table()["rules"][row["layers"]])
        out.append(AuxCache(row["id"], row["what"], layers, per_token, row["replicated"], cited(row["citation"])))
    return out
