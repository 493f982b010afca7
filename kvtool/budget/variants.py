"""`--what-if` variants: the same model with other KV heads and / or another KV-cache dtype.

Grammar: comma-separated variants; each is one or more `+`-joined changes:
  mha | mqa | gqa:N      KV heads = query heads | 1 | N (what `kvtool convert` produces)
  fp8 | nvfp4 | int8_per_token_head | ...   a KV-cache dtype vLLM accepts (kvtool/model/kv_dtypes.json)
e.g. `gqa:8,mqa,fp8,gqa:4+fp8`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.errors import UsageError
from kvtool.model.kvcache import KV_CACHE_DTYPES


@dataclass(frozen=True)
class Variant:
    name: str
    kv_heads: int | None = None  # None: unchanged
    kv_dtype: str | None = None  # None: unchanged


def parse(text: str | None, *, num_heads: int | None, is_mla: bool) -> list[Variant]:
    out: list[Variant] = []
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        kv_heads: int | None = None
        kv_dtype: str | None = None
        for change in item.split("+"):
            change = change.strip()
            if change in KV_CACHE_DTYPES and change != "auto":
                kv_dtype = change
                continue
            heads = _heads(change, num_heads, item)
            if heads is None:
                raise UsageError(f"unknown variant {change!r} in {item!r}; use mha, mqa, gqa:N or a KV dtype "
                                 f"({', '.join(d for d in KV_CACHE_DTYPES if d != 'auto')}), joined with +",
                                 option="what_if")
            if is_mla:
                raise UsageError(f"{item!r}: this model uses MLA (one latent per token, no KV heads to regroup)",
                                 option="what_if")
            kv_heads = heads
        out.append(Variant(item, kv_heads, kv_dtype))
    return out


def _heads(change: str, num_heads: int | None, item: str) -> int | None:
    if change == "mqa":
        return 1
    if change == "mha":
        if not num_heads:
            raise UsageError(f"{item!r}: the config has no query-head count", option="what_if")
        return num_heads
    if change.startswith("gqa:"):
        try:
            n = int(change[4:])
        except ValueError:
            raise UsageError(f"{item!r}: gqa needs a KV-head count, e.g. gqa:8", option="what_if") from None
        if n < 1 or (num_heads and (n > num_heads or num_heads % n)):
            raise UsageError(f"{item!r}: {n} KV heads must divide the {num_heads} query heads", option="what_if")
        return n
    return None
