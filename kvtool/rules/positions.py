"""Position encodings and context length (KV505, KV506)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define
from kvtool.model.spec import get_path

# Keys that put RoPE settings into a config, whatever the architecture.
ROPE_KEYS = ("rope_scaling", "rope_parameters", "rope_theta", "rotary_dim", "rotary_emb_base", "rope_base")
# Where configs switch ALiBi on (bloom's table says position "alibi"; mpt and falcon use a flag).
ALIBI_FLAGS = ("alibi", "attn_config.alibi")
# Context-length keys vLLM considers (config.py _get_and_verify_max_len); it takes the smallest.
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")

define("KV505", "alibi-with-rope", "warning",
       "An ALiBi model carries RoPE settings",
       """
       What it does: flags RoPE keys (rope_scaling, rope_parameters, rope_theta, rotary_dim) in a
       config whose model uses ALiBi position biases (bloom, mpt with attn_config.alibi, falcon with
       alibi true).
       Why it matters: the model never applies RoPE, so the settings do nothing in transformers;
       but tools that read them (context-extension scripts, engines' max-length logic, kvtool rope)
       act as if the context had been extended by RoPE scaling.
       Example: {"model_type": "mpt", "attn_config": {"alibi": true}, "rope_scaling": {"type": "linear", "factor": 4}}
       Fix: remove the RoPE keys; ALiBi extrapolates without them.
       """, hint="remove the RoPE keys from an ALiBi model's config", topic="positions")

define("KV506", "context-length-keys-disagree", "warning",
       "Several context-length keys in config.json disagree",
       """
       What it does: compares the context-length keys vLLM looks at (max_position_embeddings,
       n_positions, max_seq_len, seq_length, model_max_length, max_sequence_length, ...) when more
       than one is present.
       Why it matters: vLLM takes the smallest as the model's maximum length while other tools take
       max_position_embeddings or model_max_length: the same checkpoint gets different context limits.
       Example: Command-R v01 ships {"max_position_embeddings": 8192, "model_max_length": 131072}.
       Fix: make the keys agree, or pass --max-model-len explicitly when serving.
       """, hint="make the context-length keys agree, or pass --max-model-len when serving", topic="positions")


def _alibi(ctx) -> str | None:
    """What turns ALiBi on (a config flag, or the architecture itself), or None."""
    spec = ctx.spec
    for k in ALIBI_FLAGS:
        if get_path(ctx.config, k, None) is True:
            return spec.prefixed(k)
    if spec.position == "alibi":
        return spec.key("alibi") or f"model_type {spec.model_type}"
    if spec.arch.attention["position"] == "alibi":
        return f"model_type {spec.model_type}"
    return None


def _rope_settings(ctx) -> list[str]:
    """RoPE keys that would change something. A re-saved config carries every attribute of its class
    (falcon writes rope_theta 10000 and, in v5, a default rope_parameters), which is not a defect."""
    cfg, arch = ctx.config, ctx.spec.arch
    default_theta = arch.defaults.get("rope_theta", 10000.0)
    out = []
    for k in ROPE_KEYS:
        v = cfg.get(k)
        if v in (None, {}, []):
            continue
        if k == "rope_theta" and v == default_theta:
            continue
        if k in ("rope_scaling", "rope_parameters") and isinstance(v, dict):
            kind = v.get("rope_type", v.get("type", "default"))
            if kind == "default" and v.get("rope_theta", default_theta) == default_theta:
                continue
        out.append(k)
    return out


@checker("positions")
def check_alibi_rope(ctx) -> None:
    flag = _alibi(ctx)
    if flag is None:
        return
    present = _rope_settings(ctx)
    if present:
        p = ctx.spec.prefixed(present[0])
        ctx.report("KV505", f"the model uses ALiBi ({flag}) but the config sets {', '.join(present)}; "
                            "RoPE is never applied", path=p)


@checker("positions")
def check_context_keys(ctx) -> None:
    cfg = ctx.config
    vals = {k: cfg[k] for k in CONTEXT_KEYS
            if isinstance(cfg.get(k), int) and not isinstance(cfg.get(k), bool) and cfg[k] > 0}
    if len(set(vals.values())) <= 1:
        return
    lo = min(vals, key=vals.get)
    hi = max(vals, key=vals.get)
    spec = ctx.spec
    listing = ", ".join(f"{spec.prefixed(k)} = {v}" for k, v in vals.items())
    ctx.report("KV506", f"context-length keys disagree ({listing}); vLLM uses the smallest, {vals[lo]}",
               path=spec.prefixed(hi))
