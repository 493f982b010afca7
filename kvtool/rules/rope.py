"""RoPE settings (KV2xx), for every rope_type in kvtool/model/rope/types.py.

Key checks come from the type table (the same one `kvtool rope` writes from); the served-context
rules follow how vLLM derives max_model_len (vllm/config/model.py): yarn uses
original_max_position_embeddings x factor, llama3 / longrope keep max_position_embeddings, every
other type multiplies max_position_embeddings by factor.
"""

from __future__ import annotations


from kvtool.model.rope import types as rt
from kvtool.model.rope.params import (describe_rope, geometry_for, has_legacy_rope, is_nested, layout_differences,
                                      raw_dict, rope_dict, v5_view)
from kvtool.rules.registry import checker, define
from kvtool.values import is_number as _num

define("KV201", "rope-type-unknown", "error", "RoPE type is not one transformers or vLLM know",
       """
       What it does: checks that rope_scaling / rope_parameters names a RoPE type that transformers
       or vLLM implement (default, linear, dynamic, yarn, longrope / su, llama3, proportional, ntk,
       deepseek_yarn, mrope, axial, mllama4, bailing_mrope, openpangu).
       Why it matters: vLLM refuses it at load: vllm 0.33,
       vllm/model_executor/layers/rotary_embedding/__init__.py, get_rope raises
       ValueError("Unknown RoPE scaling type ..."). transformers 5 only warns while loading the
       config (RotaryEmbeddingConfigMixin.validate_rope: "Missing validation function") and fails
       later, when the model looks the type up in ROPE_INIT_FUNCTIONS. The model never serves.
       Example: {"rope_scaling": {"rope_type": "gptj"}} (gpt-j-6b as shipped by one converter).
       Fix: remove the dict for plain RoPE, or set rope_type to the scaling the model was trained with.
       """, hint="use a known rope_type, or drop rope_scaling for plain RoPE", topic="rope")

define("KV202", "rope-key-missing", "error", "A key the RoPE type requires is missing",
       """
       What it does: checks the keys each RoPE type requires (yarn: factor and
       original_max_position_embeddings; llama3: factor, low_freq_factor, high_freq_factor,
       original_max_position_embeddings; longrope: short_factor, long_factor,
       original_max_position_embeddings; linear / ntk: factor; dynamic: factor or alpha).
       Why it matters: transformers raises KeyError("Missing required keys in rope_parameters")
       (RotaryEmbeddingConfigMixin._check_received_keys) and vLLM indexes the key directly (vllm 0.33,
       vllm/model_executor/layers/rotary_embedding/__init__.py, get_rope: rope_parameters["factor"]):
       the model fails to load. Some config classes fill a missing original_max_position_embeddings
       in (Gemma-3); vLLM does not, so it stays an error.
       Example: {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
       Fix: add the missing key (`kvtool rope SRC DST --type yarn --factor 4` writes a complete dict).
       """, hint="add the missing key, or rewrite the dict with `kvtool rope`", topic="rope")

define("KV203", "rope-key-unknown", "warning", "The RoPE dict has a key its type does not use",
       """
       What it does: flags keys that neither transformers nor vLLM read for this RoPE type.
       Why it matters: the key is silently ignored; it is usually a typo (`factr`) or a parameter
       of another type (`low_freq_factor` on yarn), so the model runs with a setting nobody intended.
       Example: {"rope_scaling": {"rope_type": "linear", "factor": 2.0, "beta_fast": 32}}
       Fix: remove the key or correct its spelling.
       """, hint="remove or correct the key", topic="rope")

define("KV204", "rope-factor-below-one", "warning", "RoPE factor is below 1",
       """
       What it does: checks that a numeric `factor` is at least 1 (a non-numeric factor is KV215).
       Why it matters: a factor below 1 compresses positions instead of extending the context, and
       vLLM multiplies max_model_len by it for linear / dynamic / ntk, so the served context shrinks
       too. Both engines still load it: transformers 5 only logs "factor field must be a float or
       int >= 1" (modeling_rope_utils.py, _validate_linear_rope_parameters and siblings) and vLLM
       0.33 builds the rotary embedding without a check (get_rope), hence a warning.
       Example: {"rope_scaling": {"rope_type": "linear", "factor": 0.5}}
       Fix: use factor = target context / original context (>= 1), or plain RoPE.
       """, hint="set factor to target context / original context (>= 1)", topic="rope")

define("KV205", "rope-type-conflict", "error", "`type` and `rope_type` name different RoPE types",
       """
       What it does: checks that a dict carrying both the legacy `type` and the current `rope_type`
       names one type (su/longrope and mrope/default count as the same).
       Why it matters: vLLM refuses the config (vllm 0.33, vllm/transformers_utils/config.py,
       patch_legacy_rope_type: "Found conflicts between rope_type and type");
       transformers uses rope_type while older remote code reads type, so two stacks run two
       different position encodings.
       Example: {"rope_scaling": {"type": "dynamic", "rope_type": "yarn", "factor": 4.0, ...}}
       Fix: keep one key, or make both say the same type.
       """, hint="make `type` and `rope_type` agree, or drop `type`", topic="rope")

define("KV206", "rope-theta-invalid", "error", "rope_theta is not a positive number",
       """
       What it does: checks that the RoPE base (rope_theta, rope_local_base_freq,
       rope_parameters[...].rope_theta) is a finite number greater than 0.
       Why it matters: frequencies are theta^(-2i/d); zero, negative or non-numeric theta gives
       NaN or infinite angles, and the model produces garbage rather than an error.
       Example: {"rope_theta": 0}
       Fix: restore the base the model was trained with (10000, 500000, 1000000 ...).
       """, hint="set rope_theta to the base the model was trained with", topic="rope")

define("KV207", "longrope-factor-length", "error",
       "LongRoPE short_factor / long_factor do not have rotary_dim / 2 positive entries",
       """
       What it does: checks that both LongRoPE rescale lists hold one positive number per rotary
       frequency pair (rotary_dim / 2 entries).
       Why it matters: the lists divide the inverse frequencies element-wise. vLLM refuses a wrong
       length at load: vllm 0.33, vllm/model_executor/layers/rotary_embedding/
       phi3_long_rope_scaled_rope.py, Phi3LongRoPEScaledRotaryEmbedding._compute_inv_freq multiplies
       the list by the rotary_dim / 2 exponents (a shape error; one entry broadcasts and silently
       rescales every frequency alike). transformers refuses it for phi3 (Phi3Config.validate_rope)
       and only warns for other model types.
       Example: Phi-3 with head_dim 96 needs 48 entries; a list of 64 from another model fails.
       Fix: use the lists published with the model for this head size (`--short-factor-file`,
       `--long-factor-file`).
       """, hint="provide rotary_dim / 2 positive factors in each list", topic="rope")

define("KV208", "llama3-freq-factor-order", "error", "llama3 high_freq_factor is below low_freq_factor",
       """
       What it does: checks high_freq_factor >= low_freq_factor for rope_type llama3.
       Why it matters: the two factors bound a band of wavelengths (original / high_freq_factor to
       original / low_freq_factor) that is interpolated smoothly between "keep" and "divide by
       factor". Reversed values empty the band and flip the smoothing term's sign: almost always two
       swapped numbers. Equal values are a deliberate hard cut-off (Llama 4 ships 1.0 / 1.0).
       Example: {"rope_type": "llama3", "low_freq_factor": 4.0, "high_freq_factor": 1.0, ...}
       Fix: Llama 3.1 uses low_freq_factor 1.0 and high_freq_factor 4.0.
       """, hint="swap the values: high_freq_factor >= low_freq_factor (Llama 3.1: 1.0 and 4.0)", topic="rope")

define("KV209", "llama3-original-not-below-max", "warning",
       "llama3 original_max_position_embeddings is not below max_position_embeddings",
       """
       What it does: for rope_type llama3, checks original_max_position_embeddings <
       max_position_embeddings.
       Why it matters: vLLM serves llama3 models up to max_position_embeddings as written; if it
       still equals the pre-training length, the scaling is applied but the extended context is
       never offered (or the two lengths were swapped).
       Example: {"max_position_embeddings": 8192, "rope_scaling": {"rope_type": "llama3",
       "original_max_position_embeddings": 8192, "factor": 8.0, ...}}
       Fix: set max_position_embeddings to original x factor (131072 for Llama 3.1).
       """, hint="set max_position_embeddings to original_max_position_embeddings x factor", topic="rope")

define("KV210", "yarn-context-mismatch", "warning",
       "yarn max_position_embeddings differs from original_max_position_embeddings x factor",
       """
       What it does: for yarn, compares max_position_embeddings with
       original_max_position_embeddings x factor (an unchanged max_position_embeddings equal to the
       original length is accepted, as transformers does).
       Why it matters: both engines serve max_position_embeddings as written (vllm 0.33,
       vllm/config/model.py, _get_and_verify_max_len leaves yarn unmultiplied), but the frequencies
       were stretched for original x factor tokens: past that, positions are extrapolated again, and
       below it the factor is larger than the context needs.
       Example: {"max_position_embeddings": 65536, "rope_scaling": {"rope_type": "yarn",
       "factor": 4.0, "original_max_position_embeddings": 32768}}
       Fix: make max_position_embeddings = original x factor (`kvtool rope` writes it so).
       """, hint="set max_position_embeddings = original_max_position_embeddings x factor", topic="rope")

define("KV211", "rope-context-scaled-twice", "warning",
       "linear / dynamic scaling on a max_position_embeddings that is already extended",
       """
       What it does: for types whose served length vLLM computes as max_position_embeddings x factor
       (linear, dynamic, ntk), flags configs that also record the pre-scaling length and whose
       max_position_embeddings already exceeds it.
       Why it matters: vLLM multiplies again, offering factor x more context than the model was
       extended to (and dynamic NTK only starts scaling past max_position_embeddings in transformers).
       Example: {"max_position_embeddings": 16384, "rope_scaling": {"rope_type": "linear",
       "factor": 4.0}, "original_max_position_embeddings": 4096}
       Fix: keep max_position_embeddings at the pre-scaling length for linear / dynamic.
       """, hint="keep max_position_embeddings at the pre-scaling length for linear / dynamic", topic="rope")

define("KV212", "rope-served-context", "info", "vLLM serves a different context than max_position_embeddings",
       """
       What it does: reports the max_model_len vLLM derives when it differs from
       max_position_embeddings (vllm 0.33, vllm/config/model.py, _get_and_verify_max_len: linear /
       dynamic / ntk multiply it by factor; yarn, llama3 and longrope keep it).
       Why it matters: KV-cache budgets and client limits are usually set from
       max_position_embeddings; the server may accept longer requests than planned.
       Example: {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}}
       serves 16384 tokens.
       Fix: nothing if intended; otherwise pass --max-model-len to vLLM or adjust the factor.
       """, hint="pass --max-model-len explicitly if you need a different limit", topic="rope")

define("KV213", "rope-v5-only", "warning", "RoPE settings exist only in the transformers v5 layout",
       """
       What it does: flags configs whose rope_parameters (transformers >= 5) set a non-default
       RoPE while the legacy fields (rope_theta, rope_scaling) are absent, when lint checks a
       transformers release < 5 (`--engine transformers==4.57.6`, `[tool.kvtool] engines`, or a 4.x
       installed): the engine fact "tf-rope-parameters-only" (schemas/engines/facts.json, cited
       configuration_llama.py LlamaConfig.__init__, 4.57.6; tested against 4.38 .. 5.0 by the engine lane).
       Why it matters: transformers 4.x and tools built on it ignore rope_parameters without a
       warning and run the default base with no scaling: long-context quality collapses quietly.
       Example: {"rope_parameters": {"rope_type": "default", "rope_theta": 1000000}} with no rope_theta.
       Fix: also write rope_theta (and rope_scaling) at the top level: `kvtool rope --layout both`.
       """, hint="also write the legacy rope_theta / rope_scaling (kvtool rope --layout both)", topic="rope")

define("KV214", "rope-layouts-disagree", "error", "Legacy rope_scaling / rope_theta and v5 rope_parameters disagree",
       """
       What it does: when a config carries both layouts, checks that rope_theta + rope_scaling and
       rope_parameters describe the same RoPE.
       Why it matters: transformers 4.x reads the legacy keys, transformers 5 prefers rope_scaling
       over rope_parameters but keeps rope_parameters' own theta, other tools read one or the other:
       the same checkpoint runs with different position encodings depending on the stack.
       Architectures whose config class keeps RoPE per layer type (Olmo3, Gemma-3) also need a nested
       rope_parameters: a flat one beside rope_scaling fails in Olmo3Config (KeyError 'full_attention').
       Example: {"rope_theta": 10000, "rope_parameters": {"rope_type": "default", "rope_theta": 500000}}
       Fix: make both layouts say the same (`kvtool rope` writes them together).
       """, hint="make the legacy and v5 RoPE fields identical", topic="rope")

define("KV215", "rope-param-invalid", "error", "A RoPE parameter has an invalid value",
       """
       What it does: checks the values of type-specific parameters: original_max_position_embeddings
       a positive integer, beta_fast >= beta_slow (yarn), truncate a boolean, attention_factor /
       mscale / mscale_all_dim non-negative numbers, low/high_freq_factor positive, alpha >= 1,
       partial_rotary_factor in (0, 1].
       Why it matters: these feed logarithms and divisions in the frequency formulas: bad values
       give NaN frequencies or a backwards interpolation ramp rather than a load error.
       Example: {"rope_type": "yarn", "beta_fast": 1, "beta_slow": 32, ...}
       Fix: restore the value published with the model (yarn defaults: beta_fast 32, beta_slow 1).
       """, hint="restore the parameter to the value published with the model", topic="rope")

define("KV216", "rope-type-one-engine", "warning", "The RoPE type is implemented by only one of transformers / vLLM",
       """
       What it does: flags RoPE types that only one engine implements (vLLM only: ntk, deepseek_yarn,
       deepseek_llama_scaling, mllama4, bailing_mrope, openpangu, the legacy name "su" outside Phi-3, dynamic with
       alpha and no factor; transformers only: axial).
       Why it matters: the checkpoint loads in one stack and fails in the other (transformers looks
       the type up in ROPE_INIT_FUNCTIONS; vLLM raises "Unknown RoPE scaling type"), so evaluation
       in transformers and serving in vLLM cannot both happen. A warning, not an error: the engine
       that implements it serves the checkpoint.
       Example: {"rope_scaling": {"rope_type": "deepseek_yarn", "factor": 40, ...}}: DeepSeek's own
       configs say "yarn" and let vLLM pick its DeepSeek variant.
       Fix: use the portable type (yarn instead of deepseek_yarn) unless the model only ever runs on
       one engine.
       """, hint="use a type both transformers and vLLM implement (e.g. yarn)", topic="rope")

define("KV217", "rope-type-not-for-architecture", "error",
       "The model's config class accepts fewer RoPE types than this one",
       """
       What it does: checks the RoPE type against the types the architecture's config class
       accepts (schemas/architectures/<model_type>.json, attention.rope_types).
       Why it matters: transformers 5 refuses the config: Phi3Config (Phi-3, Phi-3.5, Phi-4)
       rewrites "su" and "yarn" to "longrope" (convert_rope_params_to_dict), which then fails for
       lack of short_factor / long_factor, and validate_rope raises for any other type but default
       and longrope. vLLM loads the config through the same transformers class, so it fails too.
       Example: {"model_type": "phi3", "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
       "original_max_position_embeddings": 4096}}
       Fix: use a type the class accepts (phi3: longrope with the published short / long lists).
       """, hint="use a rope type this architecture accepts (phi3: longrope)", topic="rope")

define("KV218", "partial-rotary-scaled-unsupported", "error",
       "partial_rotary_factor with a scaled RoPE on an architecture that rotates the whole head",
       """
       What it does: flags partial_rotary_factor < 1 (top level or inside the rope dict) with a
       scaled RoPE type on architectures whose transformers attention rotates the full head (the
       table maps neither partial_rotary_factor nor rotary_dim: llama, mistral, qwen2, ...).
       Why it matters: transformers' ROPE_INIT_FUNCTIONS apply the factor (head_dim x factor / 2
       frequencies) but LlamaAttention's apply_rotary_pos_emb multiplies the whole head by them: the
       first forward fails with a shape error. vLLM 0.33 applies the factor (get_rope:
       rotary_dim = head_size x partial_rotary_factor) and serves it, so the two engines cannot both
       run the checkpoint.
       Example: {"model_type": "llama", "partial_rotary_factor": 0.5, "rope_scaling":
       {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096}}
       Fix: drop partial_rotary_factor, or use a model type whose attention rotates part of the head.
       """, hint="drop partial_rotary_factor, or use an architecture with partial rotary attention", topic="rope")

define("KV219", "partial-rotary-ignored", "warning",
       "partial_rotary_factor on an architecture whose transformers attention ignores it",
       """
       What it does: flags partial_rotary_factor < 1 with plain RoPE on architectures whose
       transformers attention rotates the full head (see KV218).
       Why it matters: transformers' default RoPE ignores the factor and rotates all head_dim
       dimensions, while vLLM 0.33 rotates head_dim x partial_rotary_factor of them (get_rope):
       the same checkpoint gives different logits in the two engines.
       Example: {"model_type": "llama", "head_dim": 128, "partial_rotary_factor": 0.5}
       Fix: drop partial_rotary_factor unless the model was trained with vLLM's behaviour, and then
       use an architecture that declares partial rotary attention.
       """, hint="drop partial_rotary_factor, or use an architecture with partial rotary attention", topic="rope")

# Yarn-family types: the frequencies are stretched for original_max_position_embeddings x factor.
YARN_FAMILY = ("yarn", "deepseek_yarn", "deepseek_llama_scaling")

_PATH_SEP = "."


@checker("rope")
def check_rope(ctx) -> None:
    spec = ctx.spec
    if spec.position != "rope":
        return
    for layer_type, rp in spec.rope.items():
        _check_one(ctx, spec, layer_type, rp)
    _check_layouts(ctx, spec)


def _check_one(ctx, spec, layer_type, rp) -> None:
    raw = raw_dict(spec, rp, layer_type)
    base = rp.path

    def at(key: str) -> str:
        return f"{base}{_PATH_SEP}{key}"

    # theta: inside the dict when it is there, else the top-level key it came from
    theta_key = at("rope_theta") if "rope_theta" in raw else (
        rp.path if rp.path.endswith(("rope_local_base_freq",)) else (spec.key("rope_theta") or "rope_theta"))
    theta = rp.theta
    if theta is not None and (not _num(theta) or theta <= 0):
        ctx.report("KV206", f"{theta_key} is {theta!r}; the RoPE base must be a positive number", path=theta_key)
    if not raw:
        _check_architecture(ctx, spec, rt.KINDS["default"], raw, base, at)
        return
    t, legacy_t = raw.get("rope_type"), raw.get("type")
    if t is not None and legacy_t is not None and t != legacy_t and (legacy_t, t) not in rt.COMPATIBLE_PAIRS:
        ctx.report("KV205", f"{base} says type {legacy_t!r} but rope_type {t!r}", path=at("rope_type"))
    params = {**raw, **rope_dict(rp, spec)}
    kind = rt.kind_of(rp.rope_type)
    g = geometry_for(spec, rp)
    geom = g or rt.Geometry(dim=0, theta=1.0, max_position_embeddings=spec.max_position)
    for p in rt.validate(params, geom):
        if p.code == "KV207" and g is None:
            continue
        ctx.report(p.code, f"{base}: {p.message}", path=at(p.key))
    if kind is None:
        return
    _check_architecture(ctx, spec, kind, raw, base, at)
    if len(kind.engines) == 1:
        (engine,) = kind.engines
        other = "vLLM" if engine == "transformers" else "transformers"
        ctx.report("KV216", f"{base}: rope type {kind.name!r} is implemented by {engine} only; {other} cannot load it",
                   path=at("rope_type"))
    prf = raw.get("partial_rotary_factor")
    if prf is not None and (not _num(prf) or not 0 < prf <= 1):
        ctx.report("KV215", f"{base}.partial_rotary_factor is {prf!r}; it must be in (0, 1]",
                   path=at("partial_rotary_factor"))
    for key in kind.unknown(raw):
        ctx.report("KV203", f"{base}.{key} is not read for rope type {kind.name!r} "
                   f"(it accepts: {', '.join(sorted(kind.allowed_keys() - {'type'}))})", path=at(key))
    if not kind.missing(params):  # a missing key is KV202: vLLM refuses the dict, nothing is served
        _check_context(ctx, spec, kind, params, base, at)


def _check_architecture(ctx, spec, kind, raw, base, at) -> None:
    """What the model's own transformers classes do with this type (KV217, KV218, KV219)."""
    accepted = spec.arch.attention.get("rope_types")
    rewrites = spec.arch.attention.get("rope_rewrites", {})
    written = raw.get("rope_type", raw.get("type"))
    target = rt.KINDS.get(rewrites.get(written, ""), None)
    if target is not None and target is not kind and target.missing(raw):
        ctx.report("KV217", f"{base}: {spec.model_type}'s config class rewrites rope type {written!r} to "
                   f"{target.name!r}, which requires {', '.join(target.missing(raw))}", path=at("rope_type"))
    elif target is None and accepted and kind.name not in accepted:
        ctx.report("KV217", f"{base}: {spec.model_type} accepts rope types {', '.join(accepted)} only; transformers' "
                   f"config class refuses {kind.name!r}", path=at("rope_type"))
    if written in rt.VLLM_ONLY_ALIASES and written not in rewrites:
        ctx.report("KV216", f"{base}: rope type {written!r} is vLLM's legacy name for {kind.name!r}; transformers' "
                   f"{spec.model_type} does not know it (write {kind.name!r})", path=at("rope_type"))
    if kind.whole_head or "partial_rotary_factor" in spec.arch.fields or "rotary_dim" in spec.arch.fields:
        return  # the attention rotates head_dim x partial_rotary_factor dims
    prf, where = raw.get("partial_rotary_factor"), at("partial_rotary_factor")
    if prf is None:
        prf, where = spec.config.get("partial_rotary_factor"), spec.prefixed("partial_rotary_factor")
    if not _num(prf) or not 0 < prf < 1:
        return
    hd = spec.head_dim
    dims = f"{int(hd * prf)} of {hd}" if hd else f"{prf:g} of the head"
    if kind.scaling:
        ctx.report("KV218", f"{where} = {prf:g} with rope type {kind.name!r}: transformers computes frequencies for "
                   f"{dims} dims but {spec.model_type} rotates the whole head (shape error at the first forward); "
                   f"vLLM rotates {dims}", path=where)
    else:
        ctx.report("KV219", f"{where} = {prf:g}: transformers' {spec.model_type} ignores it and rotates all "
                   f"{hd or 'head'} dims; vLLM rotates {dims}", path=where)


def _check_context(ctx, spec, kind, params, base, at) -> None:
    mpe = spec.max_position
    mpe_key = spec.key("max_position") or "max_position_embeddings"
    factor, orig = params.get("factor"), params.get("original_max_position_embeddings")
    if not isinstance(mpe, int) or mpe <= 0 or (factor is not None and (not _num(factor) or factor < 1)):
        return
    orig_ok = isinstance(orig, int) and not isinstance(orig, bool) and orig > 0
    if kind.name == "llama3" and orig_ok and orig >= mpe:
        ctx.report("KV209", f"{base}.original_max_position_embeddings = {orig} is not below {mpe_key} = {mpe}; "
                   f"vLLM will serve only {mpe} tokens", path=at("original_max_position_embeddings"))
    if kind.name in YARN_FAMILY and orig_ok and _num(factor) and mpe not in (orig, int(orig * factor)):
        ctx.report("KV210", f"{mpe_key} = {mpe} but {base}.original_max_position_embeddings x factor = "
                   f"{orig} x {factor:g} = {orig * factor:g}; both engines serve {mpe} tokens on frequencies "
                   f"stretched for {orig * factor:g}", path=mpe_key)
        return
    served = rt.served_context(params, mpe, spec.model_type)
    if served is None or served == mpe:
        return  # vLLM serves max_position_embeddings as written
    top_orig = spec.config.get("original_max_position_embeddings")
    pre = orig if orig_ok else top_orig if isinstance(top_orig, int) and not isinstance(top_orig, bool) else None
    if kind.context == "multiply" and pre is not None and mpe > pre:
        ctx.report("KV211", f"{mpe_key} = {mpe} is already above the pre-scaling length {pre}; vLLM multiplies "
                   f"by factor {factor:g} again and serves {served} tokens", path=mpe_key)
        return
    ctx.report("KV212", f"vLLM serves {served} tokens, not {mpe_key} = {mpe}, for rope type {kind.name!r} "
               f"(factor {factor:g})", path=mpe_key)


def _check_layouts(ctx, spec) -> None:
    """KV214: both layouts written and disagreeing. RoPE written only in rope_parameters is an engine fact
    (KV213, kvtool/rules/engines.py: which transformers releases read it differently is in the facts table)."""
    if v5_view(spec) is None:
        return
    rp_key = spec.key("rope_parameters") or "rope_parameters"
    if spec.arch.attention.get("rope_per_layer_type") and not is_nested(spec.get("rope_parameters")) and \
            isinstance(spec.get("rope_scaling"), dict) and spec.get("rope_scaling"):
        ctx.report("KV214", f"{rp_key} is flat but {spec.model_type} keeps RoPE per layer type: beside rope_scaling "
                   "transformers' config class fails (KeyError 'full_attention'); nest it under full_attention / "
                   "sliding_attention", path=rp_key)
        return
    if not has_legacy_rope(spec):
        return
    for path, new, old in layout_differences(spec):
        ctx.report("KV214", f"{path} says {describe_rope(new)} but the legacy fields say {describe_rope(old)}",
                   path=path)
