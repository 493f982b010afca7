"""KV906: numeric config values outside the bounds every command relies on (kvtool/model/numbers.py)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define

NUMBER_CODE = "KV906"

define(NUMBER_CODE, "number-invalid", "error",
       "A numeric config value is mistyped, not finite, or outside the range any model could use",
       """
       What it does: checks every numeric value kvtool's rules and commands compute with (layers,
       heads, KV heads, head_dim, hidden and intermediate sizes, vocabulary, context and window
       lengths, RoPE theta / factor / yarn and llama3 bounds, MLA ranks, MoE counts, token ids)
       against one table of types and bounds (docs/input-limits.md): an integer where a count is
       needed (true, "two" and 2.5 are not), finite (NaN, Infinity and 1e308 are not), and inside
       a range far wider than any public model (layers 1..100,000, heads 1..65,536, ...).
       A more specific rule on the same key (KV101 for KV heads, KV206 for rope_theta, ...) replaces
       this finding.
       Why it matters: loaders either crash on these values or compute nonsense from them (zero
       bytes of KV cache, 10^9-layer loops); kv-budget, convert, rope and quantize-kv refuse such a
       config (exit 2) rather than answer with impossible numbers.
       Example: "num_attention_heads": NaN, "max_position_embeddings": -Infinity, "num_hidden_layers": 1000000000
       Fix: write the value the model was trained with.
       """, hint="write the value the model was trained with", topic="numbers")


@checker("numbers")
def check_numbers(ctx) -> None:
    for bad in ctx.spec.invalid.values():
        ctx.report(NUMBER_CODE, bad.message, path=bad.key)
