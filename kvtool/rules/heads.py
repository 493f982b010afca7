"""Attention heads and head_dim (KV1xx)."""

from __future__ import annotations

from kvtool.model.numbers import head_split_problem
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
       heads; an uneven split cannot be expressed and model classes fail in repeat_kv. MLA models
       (DeepSeek-V2/V3, Kimi-K2, GLM-5) need num_key_value_heads = num_attention_heads: their
       transformers attention decompresses one K/V head per query head and still repeats them by
       num_attention_heads // num_key_value_heads, so any other count breaks (or runs by accident
       when the quotient is 1).
       Example: {"num_attention_heads": 32, "num_key_value_heads": 6}
       Fix: choose a KV-head count that divides the query heads (`kvtool convert --to gqa --groups G`
       lists the valid G).
       """, hint="choose a KV-head count that divides the query-head count", topic="heads")


@checker("heads")
def check_kv_heads(ctx) -> None:
    spec = ctx.spec
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
    elif head_split_problem(spec) is None:  # the verdict every command refuses by (kvtool.model.numbers)
        return
    elif spec.is_mla:
        # MLA decompresses one K/V head per query head; transformers then repeats them by H // KV
        ctx.report("KV102", f"{kv_key} = {kv} differs from {spec.key('num_heads')} = {h} on an MLA model: transformers "
                            f"decompresses {h} K/V heads and repeats them {h // kv} times (only {kv_key} = {h} runs)",
                   path=kv_key)
    else:
        ctx.report("KV102", f"{spec.key('num_heads')} = {h} is not divisible by {kv_key} = {kv} "
                            f"(valid: {_divisors(h)})", path=kv_key)


define("KV103", "tp-query-heads", "error",
       "Query-head count is not divisible by --tensor-parallel-size",
       """
       What it does: with `--tensor-parallel-size N`, checks that num_attention_heads is divisible by N.
       Why it matters: vLLM shards query heads evenly across the N ranks and refuses to start
       ("Total number of attention heads (H) must be divisible by tensor parallel size (N)").
       Example: {"num_attention_heads": 9} with --tensor-parallel-size 2 (SmolLM2-135M).
       Fix: pick a TP size that divides the query-head count (the message lists them), or use
       pipeline parallelism.
       """, hint="use a tensor-parallel size that divides the query-head count", topic="heads")

define("KV104", "tp-kv-heads", "error",
       "KV-head count and --tensor-parallel-size divide neither way",
       """
       What it does: with `--tensor-parallel-size N`, checks vLLM's rule for KV heads: when
       N <= KV heads, KV heads must be divisible by N (each rank holds KV/N heads); when N > KV
       heads, N must be divisible by KV heads (each KV head is replicated N/KV times).
       Why it matters: vLLM's QKVParallelLinear asserts exactly this split and fails at load.
       Example: {"num_key_value_heads": 6} with --tensor-parallel-size 4.
       Fix: choose a TP size that divides the KV heads or is a multiple of them, or convert the
       model to a KV-head count that fits (`kvtool convert --to gqa`).
       """, hint="use a TP size that divides the KV-head count or is a multiple of it", topic="heads")

define("KV105", "head-dim-explicit", "info",
       "Explicit head_dim differs from hidden_size / num_attention_heads",
       """
       What it does: notes that the config sets head_dim to a value other than
       hidden_size / num_attention_heads.
       Why it matters: this is legitimate (Gemma, Qwen3, Llama-3.2), but tools that derive head_dim
       from hidden_size get the KV-cache size and projection shapes wrong for such models.
       Example: {"hidden_size": 2048, "num_attention_heads": 8, "head_dim": 256}
       Fix: nothing to fix; make sure downstream tools read head_dim from the config.
       """, hint="", topic="heads")

define("KV106", "head-dim-underivable", "error",
       "head_dim is absent and hidden_size is not divisible by num_attention_heads",
       """
       What it does: when the config has no head_dim, checks that hidden_size divides evenly by the
       number of query heads.
       Why it matters: model classes compute head_dim = hidden_size // num_heads; an inexact
       division silently truncates and the projection shapes no longer match the weights.
       Some config classes refuse an inexact division even with head_dim set (transformers 5:
       LlamaConfig, Gemma2Config, Gemma3TextConfig, ExaoneConfig .validate_architecture;
       the table's attention.hidden_divisible_by_heads): then it is reported whatever head_dim says.
       Example: {"hidden_size": 4000, "num_attention_heads": 48}
       Fix: set head_dim explicitly, or correct hidden_size / num_attention_heads.
       """, hint="set head_dim explicitly or correct hidden_size / num_attention_heads", topic="heads")

define("KV107", "rotary-dim-odd", "error",
       "The rotary dimension is odd",
       """
       What it does: checks that the number of dimensions RoPE rotates (head_dim, or
       head_dim x partial_rotary_factor, or rotary_dim) is a positive even integer.
       Why it matters: RoPE rotates pairs of dimensions; an odd count cannot be split into pairs
       and kernels either fail or leave one dimension unrotated.
       Example: {"head_dim": 64, "partial_rotary_factor": 0.3}  (rotary dim 19)
       Fix: choose partial_rotary_factor / rotary_dim so the rotated dimension count is even.
       """, hint="make the rotary dimension even", topic="heads")


def _pos_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


# Lists of valid sizes in messages stop here: real head counts and TP sizes are far below it.
LIST_LIMIT = 1024


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, min(n, LIST_LIMIT) + 1) if n % d == 0]


def _tp_fits(tp: int, h: int | None, kv: int | None) -> bool:
    """vLLM's rule: query heads split evenly; KV heads split evenly or replicated evenly."""
    if h and h % tp:
        return False
    if kv:
        return kv % tp == 0 if tp <= kv else tp % kv == 0
    return True


@checker("heads")
def check_tensor_parallel(ctx) -> None:
    tp = ctx.options.tensor_parallel_size
    if not tp or tp <= 1:
        return
    spec = ctx.spec
    h = spec.get("num_heads")
    h = h if _pos_int(h) else None
    mla = spec.is_mla or spec.get("kv_lora_rank") is not None  # MLA caches a latent: no KV heads to shard
    kv = None if mla else spec.get("num_kv_heads")
    kv = kv if _pos_int(kv) else None
    if h is None and kv is None:
        return
    fits = [n for n in range(1, min(h or kv, LIST_LIMIT) + 1) if _tp_fits(n, h, kv)]
    h_key = spec.key("num_heads") or "num_attention_heads"
    if h and h % tp:
        ctx.report("KV103", f"{h_key} = {h} is not divisible by --tensor-parallel-size {tp} "
                            f"(sizes that work: {fits})", path=h_key)
        if kv == h:
            return  # MHA: the KV-head split fails for the same reason
    if kv is None:
        return
    kv_key = spec.key("num_kv_heads") or "num_key_value_heads"
    if not _tp_fits(tp, None, kv):
        rule = f"{kv} must be divisible by {tp}" if tp <= kv else f"{tp} must be a multiple of {kv}"
        ctx.report("KV104", f"{kv_key} = {kv} cannot be split over --tensor-parallel-size {tp}: {rule} "
                            f"(sizes that work: {fits})", path=kv_key)


@checker("heads")
def check_head_dim(ctx) -> None:
    spec = ctx.spec
    if spec.is_mla or spec.get("kv_lora_rank") is not None:
        return  # MLA head sizes are checked by the KV4xx rules
    hidden, h = spec.get("hidden_size"), spec.get("num_heads")
    if not (_pos_int(hidden) and _pos_int(h)):
        return
    h_key = spec.key("num_heads") or "num_attention_heads"
    hid_key = spec.key("hidden_size") or "hidden_size"
    hd = spec.get("head_dim")
    if hidden % h and spec.arch.attention.get("hidden_divisible_by_heads"):
        ctx.report("KV106", f"{hid_key} = {hidden} is not divisible by {h_key} = {h}; transformers' "
                            f"{spec.model_type} config class refuses it (validate_architecture), head_dim or not "
                            f"({hidden} / {h} = {hidden / h:.3f})",
                   path=hid_key)
        return
    if hd is not None:
        hd_key = spec.key("head_dim") or "head_dim"
        if _pos_int(hd) and hd * h != hidden:
            derived = f"{hidden / h:g}"
            ctx.report("KV105", f"{hd_key} = {hd} differs from {hid_key} / {h_key} = {hidden} / {h} = {derived}; "
                                f"projections are {h} x {hd} = {h * hd} wide", path=hd_key)
        return
    if hidden % h:
        ctx.report("KV106", f"{hid_key} = {hidden} is not divisible by {h_key} = {h} and head_dim is not set "
                            f"({hidden} / {h} = {hidden / h:.3f})", path=hid_key)


@checker("heads")
def check_rotary_dim(ctx) -> None:
    spec = ctx.spec
    if spec.position != "rope" or spec.is_mla or spec.get("kv_lora_rank") is not None:
        return
    hd = spec.head_dim
    if not hd:
        return
    rd_explicit = spec.get("rotary_dim")
    prf = spec.get("partial_rotary_factor")
    if rd_explicit is not None:
        key = spec.key("rotary_dim") or "rotary_dim"
        if not _pos_int(rd_explicit) or rd_explicit % 2 or rd_explicit > hd:
            ctx.report("KV107", f"{key} = {rd_explicit!r} must be a positive even integer no larger than "
                                f"head_dim {hd}", path=key)
        return
    if prf is None:
        if hd % 2:
            ctx.report("KV107", f"head_dim = {hd} is odd, so RoPE cannot rotate it in pairs",
                       path=spec.key("head_dim") or spec.key("hidden_size"))
        return
    key = spec.key("partial_rotary_factor") or "partial_rotary_factor"
    if isinstance(prf, bool) or not isinstance(prf, (int, float)) or not 0 < prf <= 1:
        ctx.report("KV107", f"{key} = {prf!r} must be a number in (0, 1]", path=key)
        return
    rd = int(hd * prf)
    if rd <= 0 or rd % 2:
        ctx.report("KV107", f"rotary dimension head_dim x {key} = {hd} x {prf:g} = {rd} is not a positive even "
                            "integer", path=key)
