"""Attention heads and head_dim (KV1xx)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define

define("KV101", "kv-heads-invalid", "error",
       "KV-head count is not a positive integer no larger than the query-head count",
       """
       What it does: checks that the number of key/value heads is a positive integer and at most
       the number of query heads.
       Why it matters: transformers and every serving engine index KV heads as
       query_head // (num_heads / num_kv_heads); zero, negative or too many KV heads fail at load
       or, worse, load with a garbled attention layout.
       Example: {"num_attention_heads": 32, "num_key_value_heads": 64}
       Fix: set num_key_value_heads to a divisor of num_attention_heads (1 for MQA, equal for MHA).
       """, hint="set the KV-head count to a divisor of the query-head count", topic="heads")

define("KV102", "kv-heads-not-dividing", "error",
       "Query-head count is not a multiple of the KV-head count",
       """
       What it does: checks that num_attention_heads is divisible by num_key_value_heads.
       Why it matters: grouped-query attention shares each KV head among an equal number of query
       heads; an uneven split cannot be expressed and model classes fail in repeat_kv.
       Example: {"num_attention_heads": 32, "num_key_value_heads": 6}
       Fix: choose a KV-head count that divides the query heads (`kvtool convert --to gqa --groups G`
       lists the valid G).
       """, hint="choose a KV-head count that divides the query-head count", topic="heads")


@checker("heads")
def check_kv_heads(ctx) -> None:
    spec = ctx.spec
    if spec.is_mla:
        return
    h, kv = spec.get("num_heads"), spec.get("num_kv_heads")
    kv_key = spec.key("num_kv_heads") or "num_key_value_heads"
    if kv is None or h is None:
        return
    if isinstance(kv, bool) or not isinstance(kv, int) or kv <= 0:
        ctx.report("KV101", f"{kv_key} is {kv!r}; it must be a positive integer", path=kv_key)
        return
    if not isinstance(h, int) or isinstance(h, bool) or h <= 0:
        return
    if kv > h:
        ctx.report("KV101", f"{kv_key} = {kv} exceeds {spec.key('num_heads')} = {h}", path=kv_key)
    elif h % kv:
        valid = [d for d in range(1, h + 1) if h % d == 0]
        ctx.report("KV102", f"{spec.key('num_heads')} = {h} is not divisible by {kv_key} = {kv} (valid: {valid})",
                   path=kv_key)
