"""Engine versions (KV010, KV011, and KV213's release range): the facts of schemas/engines/*.json that hold for
this config at the releases lint checks (`--engine`, `[tool.kvtool] engines`, else the installed ones)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define

define("KV010", "engine-version-refuses", "error", "An engine release you deploy refuses the config",
       """
       What it does: checks the config against the engine facts table (schemas/engines/facts.json and the
       generated schemas/engines/transformers_releases.json) for the transformers and vLLM releases lint checks:
       `--engine transformers==4.44.2`, a range (`--engine 'transformers>=4.45,<5'` checks every known release in
       it), `[tool.kvtool] engines`, a recipe's `engines`, else the releases installed here (package metadata) or
       the newest kvtool knows. The message names the release range and cites the engine's source.
       Why it matters: a config one release loads and another refuses is the most-reported serving failure; the
       newest release's verdict says nothing about the one production pins.
       Example: {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, ...}} with --engine transformers==4.42.4:
       "transformers < 4.43.0 refuses rope_type 'llama3' without 'type'" (LlamaConfig._rope_scaling_validation).
       Fix: write the config so every release you deploy reads it (both RoPE layouts: `kvtool rope --layout
       both`), or upgrade the engine; `kvtool lint --compat` shows every release at once.
       """, hint="upgrade the engine or write the config in a form that release reads (kvtool lint --compat)",
       topic="engines")

define("KV011", "engine-version-reads-differently", "warning",
       "An engine release you deploy reads the config differently than written",
       """
       What it does: like KV010, for facts where the release loads the config but silently runs something else:
       a key it does not know yet (`dtype` before transformers 4.56, `layer_types`, llama's `head_dim` before
       4.45), or its own arithmetic (vLLM < 0.30 serves yarn models original_max_position_embeddings x factor
       tokens).
       Why it matters: nothing fails; the model runs with another dtype, attention layout, RoPE or context.
       Example: {"dtype": "bfloat16"} with --engine transformers==4.44.2: torch_dtype stays None and
       from_pretrained loads float32 weights.
       Fix: also write the key the older release reads (torch_dtype, rope_theta / rope_scaling), or upgrade.
       """, hint="also write the spelling the older release reads, or upgrade the engine", topic="engines")


@checker("engines")
def check_engine_facts(ctx) -> None:
    from kvtool.engines.facts import effects
    from kvtool.engines.releases import checked_default

    for checked in ctx.options.engines or checked_default():
        for e in effects(ctx.spec, checked.engine, checked.versions):
            ctx.report(e.code, e.message(), path=e.path)
