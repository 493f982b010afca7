"""vLLM's per-platform defaults (platforms.json), as kv-budget's --platform uses them: block size, the KV pool
and the scheduler step. `gpu` is kv-budget's long-standing sizing (no row: gpus.json and budget.py)."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from kvtool.model.engine_tables import Citation, load

GIB = 2**30


@dataclass(frozen=True)
class Platform:
    name: str
    release: str
    block_size: int
    mla_block_size: int
    pool_env: str
    serve_batched_tokens: int  # per worker (x tensor-parallel size)
    llm_batched_tokens: int
    mla_batched_tokens_floor: int  # MLA: max(max_model_len, this), chunked prefill off
    cache_dtypes: tuple[str, ...]  # the values its CacheConfig accepts at all
    citations: tuple[Citation, ...]

    def default_block_size(self, is_mla: bool) -> int:
        return self.mla_block_size if is_mla else self.block_size

    def kv_dtype_refusal(self, kv_cache_dtype: str, auto_name: str) -> str | None:
        """Why this platform's vLLM does not serve --kv-cache-dtype (None: it does). float16 / bfloat16 equal to
        what auto stores (the served model dtype) are auto; the lane measured every other name off the backend's
        list scoring far from auto, loaded without a refusal. The backend's list is kv_emulations.json's cpu row
        (what the CPU build reads), one home for it."""
        from kvtool.model.kv_emulations import cpu_reads

        served = cpu_reads()["dtypes"]
        if kv_cache_dtype in served or kv_cache_dtype == auto_name:
            return None
        if kv_cache_dtype not in self.cache_dtypes:
            return (f"vLLM {self.release} refuses --kv-cache-dtype {kv_cache_dtype} at start-up: not one of its "
                    "cache dtypes (vllm/config/cache.py CacheDType)")
        return (f"vLLM {self.release} on CPU serves --kv-cache-dtype {', '.join(served)} only "
                f"(cpu_attn.py CPUAttentionBackend.supported_kv_cache_dtypes); it starts with {kv_cache_dtype} "
                "without refusing it and computes something else (measured: docs/vllm-lane.md)")

    def batched_tokens(self, *, is_mla: bool, max_model_len: int, world_size: int = 1, llm: bool = False) -> int:
        """vLLM's max_num_batched_tokens on this platform: `vllm serve`'s (llm: vllm.LLM's) per worker, or for
        MLA max(max_model_len, the floor) with chunked prefill off."""
        if is_mla:
            return max(max_model_len, self.mla_batched_tokens_floor)
        return (self.llm_batched_tokens if llm else self.serve_batched_tokens) * world_size


@lru_cache(maxsize=1)
def table() -> dict[str, Platform]:
    data = load("kvtool/budget/platforms.json")
    out = {}
    for name, row in data["platforms"].items():
        out[name] = Platform(name, row["release"], int(row["block_size"]), int(row["mla_block_size"]),
                             row["pool_env"], int(row["max_num_batched_tokens"]["serve"]),
                             int(row["max_num_batched_tokens"]["llm"]), int(row["mla_batched_tokens_floor"]),
                             tuple(row["cache_dtypes"]),
                             tuple(c for k in row if k.endswith("_citation")
                                   for c in (row[k] if isinstance(row[k], tuple) else (row[k],))))
    return out


def platform(name: str) -> Platform | None:
    """The row of a --platform value; None for gpu (kv-budget's GPU sizing)."""
    return table().get(name)
