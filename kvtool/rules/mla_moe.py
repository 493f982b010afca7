"""Multi-head latent attention (KV40x) and mixture-of-experts (KV41x) fields."""

from __future__ import annotations

from kvtool.model.engine_tables import newest_read
from kvtool.rules.registry import checker, define
from kvtool.values import is_int as _is_int

define("KV401", "mla-dims-invalid", "error",
       "An MLA dimension (kv_lora_rank, q_lora_rank, qk_*_head_dim, v_head_dim) is missing or not positive",
       """
       What it does: on configs with multi-head latent attention (kv_lora_rank set: DeepSeek-V2/V3,
       Kimi-K2, GLM-5), checks that kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim and
       v_head_dim are positive integers and that q_lora_rank is a positive integer or null.
       Why it matters: these sizes define the latent the KV cache stores
       (kv_lora_rank + qk_rope_head_dim per token) and every projection shape; a missing or zero
       value makes the model class fall back to defaults that do not match the weights.
       Example: {"kv_lora_rank": 512, "qk_rope_head_dim": 0}
       Fix: copy the values from the model's reference config.
       """, hint="set the MLA dimensions to positive integers (q_lora_rank may be null)", topic="mla")

define("KV402", "mla-rope-dim-odd", "error",
       "qk_rope_head_dim is odd",
       """
       What it does: checks that qk_rope_head_dim, the part of each MLA query/key head that RoPE
       rotates, is even.
       Why it matters: RoPE rotates dimension pairs; an odd width cannot be rotated.
       Example: {"qk_rope_head_dim": 63}
       Fix: use an even qk_rope_head_dim (64 in every published MLA model).
       """, hint="use an even qk_rope_head_dim", topic="mla")

define("KV403", "mla-head-dim-conflict", "error",
       "head_dim or qk_head_dim contradicts the MLA head sizes",
       """
       What it does: on MLA configs, checks that an explicit head_dim equals qk_rope_head_dim (the
       width RoPE acts on) and that an explicit qk_head_dim equals qk_nope_head_dim + qk_rope_head_dim.
       Why it matters: transformers sets head_dim = qk_rope_head_dim for MLA models so that the
       shared rotary embedding computes frequencies for the rope slice. A config that stores a
       different head_dim is read differently by different versions: transformers >= 5.4 briefly
       treated head_dim as an alias and overwrote qk_rope_head_dim with it
       (huggingface/transformers#46739), which rotates the wrong width and breaks the model.
       Example: GLM-5.2 ships {"head_dim": 192, "qk_rope_head_dim": 64, "qk_nope_head_dim": 192}.
       Fix: set head_dim to qk_rope_head_dim (64), or remove it.
       """, hint="set head_dim equal to qk_rope_head_dim, or remove head_dim", topic="mla")

define("KV404", "mla-row-not-served", "error",
       "No MLA backend of a vLLM release you deploy serves kv_lora_rank + qk_rope_head_dim",
       """
       What it does: on dense MLA configs (DeepSeek-V2/V3 layout, no index_topk), checks that the cached row,
       kv_lora_rank + qk_rope_head_dim values per token and layer (vLLM's MLA head size), is one the vLLM releases
       lint checks serve (`--engine vllm==X` or a range, `[tool.kvtool] engines`, else the installed or newest
       release): 576 up to 0.17, 320 or 576 from 0.18, 320, 512 or 576 from 0.30
       (schemas/engines/mla_backends.json, read from each release's source).
       Why it matters: every dense MLA backend, TRITON_MLA included (which declares any size), builds metadata
       that MLACommonMetadata.__post_init__ checks against MLACommonBackend.get_supported_head_sizes: the model
       loads, vLLM allocates its cache, and the first forward pass fails with "Head dimension N is not supported
       by MLA" (vllm/model_executor/layers/attention/mla_attention.py, 0.33.0). Observed on vLLM 0.32.0 CPU with
       a 128-value row.
       Example: {"kv_lora_rank": 76, "qk_rope_head_dim": 52} (128 values)
       Fix: convert to a servable row (`kvtool convert --to mla --engine vllm==X` writes only those), e.g.
       kv_lora_rank 268 + qk_rope_head_dim 52 = 320.
       """, hint="use a row vLLM serves: kv_lora_rank + qk_rope_head_dim of 320, 512 or 576 (0.30+)", topic="mla")

define("KV405", "mla-sliding-window", "warning",
       "An MLA config asks for sliding-window layers, which vLLM's DeepSeek MLA layers never apply",
       """
       What it does: flags an MLA config (kv_lora_rank set) with a sliding_window or sliding_attention layer
       types.
       Why it matters: vLLM's DeepSeek MLA attention (vllm/model_executor/layers/mla.py,
       MultiHeadLatentAttentionWrapper.__init__, 0.33.0) builds MLAAttention without a sliding_window, so every
       layer attends to and caches the whole context: the window is ignored, the model is served as
       full attention, and the KV cache grows with the context. Were a window passed, TritonMLAImpl.__init__
       refuses it ("TritonMLAImpl does not support one of the following: alibi_slopes, sliding_window, ...").
       Example: {"kv_lora_rank": 512, "qk_rope_head_dim": 64, "sliding_window": 4096}
       Fix: drop the window (the model attends to the whole context), or keep the source's attention if its
       quality depends on the window.
       """, hint="drop sliding_window / sliding layer types from MLA configs: vLLM attends to the whole context",
       topic="mla")

define("KV411", "moe-top-k-invalid", "error",
       "Experts per token is not a positive integer no larger than the number of experts",
       """
       What it does: checks that the number of experts routed per token (num_experts_per_tok and
       its variants) is a positive integer and at most the number of routed experts.
       Why it matters: top-k over fewer candidates than k fails in the router (torch.topk raises)
       or, in fused kernels, reads garbage.
       Example: {"num_local_experts": 8, "num_experts_per_tok": 10}
       Fix: set experts per token to at most the number of experts.
       """, hint="set experts per token between 1 and the number of experts", topic="moe")

define("KV412", "moe-shared-experts-invalid", "error",
       "The shared-expert count is not a non-negative integer",
       """
       What it does: checks that n_shared_experts (or num_shared_experts) is an integer >= 0.
       Why it matters: the shared-expert MLP is sized as n_shared_experts x moe_intermediate_size;
       a negative or fractional count cannot be built and its weights will not load.
       Example: {"n_shared_experts": -1}
       Fix: set the count of always-active experts (0 for none).
       """, hint="set the shared-expert count to an integer >= 0", topic="moe")

define("KV413", "moe-layer-frequency-invalid", "error",
       "A MoE layer-placement field (moe_layer_freq, first_k_dense_replace, ...) is out of range",
       """
       What it does: checks the fields that decide which layers are MoE: moe_layer_freq and
       decoder_sparse_step are positive integers, first_k_dense_replace lies in
       [0, num_hidden_layers], and mlp_only_layers lists valid layer indices.
       Why it matters: an out-of-range value makes every layer dense (or none), so the expert
       weights in the checkpoint are either missing or unused and loading fails.
       Example: {"num_hidden_layers": 28, "first_k_dense_replace": 40}
       Fix: correct the field so the MoE layers match the checkpoint's expert weights.
       """, hint="keep MoE layer-placement fields inside the layer range", topic="moe")

define("KV414", "moe-routing-groups-invalid", "error",
       "Group-limited routing fields (n_group, topk_group) do not fit the experts",
       """
       What it does: for group-limited routing (DeepSeek-V3 style), checks that n_group divides the
       number of routed experts and that 1 <= topk_group <= n_group.
       Why it matters: the router reshapes expert scores into n_group groups and keeps the best
       topk_group; uneven groups or topk_group > n_group fail at the first forward pass.
       Example: {"n_routed_experts": 256, "n_group": 6, "topk_group": 4}
       Fix: use an n_group that divides the experts and a topk_group no larger than it.
       """, hint="make n_group divide the experts and topk_group <= n_group", topic="moe")

# Config keys used when an architecture table does not map the quantity (generic fallback).
_RAW_KEYS = {
    "moe_layer_freq": ("moe_layer_freq",),
    "first_k_dense": ("first_k_dense_replace",),
}


def _get(ctx, name: str):
    """(value, dotted key) of a quantity: from the architecture table, else a raw config key."""
    spec = ctx.spec
    v = spec.get(name)
    if v is not None:
        return v, spec.key(name)
    for k in _RAW_KEYS.get(name, ()):
        if ctx.config.get(k) is not None:
            return ctx.config[k], spec.prefixed(k)
    return None, None


def _has_mla(spec) -> bool:
    return spec.is_mla or spec.get("kv_lora_rank") is not None


@checker("mla")
def check_mla(ctx) -> None:
    spec, cfg = ctx.spec, ctx.config
    if not _has_mla(spec):
        return
    dims: dict[str, object] = {}
    for name in ("kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim"):
        v = spec.get(name)
        key = spec.key(name) or spec.prefixed(name)
        if not (_is_int(v) and v > 0):
            what = "missing" if v is None else repr(v)
            ctx.report("KV401", f"{key} is {what}; MLA needs a positive integer", path=key)
        else:
            dims[name] = v
    q = spec.get("q_lora_rank")
    if q is not None and not (_is_int(q) and q > 0):
        key = spec.key("q_lora_rank") or spec.prefixed("q_lora_rank")
        ctx.report("KV401", f"{key} is {q!r}; it must be a positive integer or null (no query compression)", path=key)
    rope = dims.get("qk_rope_head_dim")
    rope_key = spec.key("qk_rope_head_dim") or spec.prefixed("qk_rope_head_dim")
    if rope is not None and rope % 2:
        ctx.report("KV402", f"{rope_key} = {rope} is odd; RoPE rotates dimension pairs", path=rope_key)
    hd = cfg.get("head_dim")
    if rope is not None and hd is not None and hd != rope:
        key = spec.prefixed("head_dim")
        nope = dims.get("qk_nope_head_dim")
        extra = f" (it equals qk_nope_head_dim = {nope})" if nope == hd else ""
        ctx.report("KV403", f"{key} = {hd!r} contradicts {rope_key} = {rope}{extra}: transformers uses head_dim as the "
                            "RoPE width of MLA models, and versions affected by huggingface/transformers#46739 "
                            f"overwrite qk_rope_head_dim with it", path=key)
    qk = cfg.get("qk_head_dim")
    nope = dims.get("qk_nope_head_dim")
    if qk is not None and rope is not None and nope is not None and qk != nope + rope:
        key = spec.prefixed("qk_head_dim")
        ctx.report("KV403", f"{key} = {qk!r} but qk_nope_head_dim + qk_rope_head_dim = {nope} + {rope} = {nope + rope}",
                   path=key)


@checker("mla")
def check_mla_row_served(ctx) -> None:
    from kvtool.model.kv_dtypes import attention_kind

    spec = ctx.spec
    if attention_kind(spec) != "mla":  # the sparse MLA backends (index_topk) take other rows
        return
    rank, rope = spec.get("kv_lora_rank"), spec.get("qk_rope_head_dim")
    if not (_is_int(rank) and rank > 0 and _is_int(rope) and rope > 0):
        return  # KV401's
    from kvtool.engines import mla
    from kvtool.engines.releases import checked_default

    key = spec.key("kv_lora_rank") or spec.prefixed("kv_lora_rank")
    for checked in ctx.options.engines or checked_default():
        if checked.engine != "vllm":
            continue
        refused: dict = {}
        for v in checked.versions:
            rows = mla.rows(v)
            if rows is not None and rank + rope not in rows.head_sizes:
                refused.setdefault(rows, []).append(v)
        for rows, vs in refused.items():
            label = vs[0] if len(vs) == 1 else f"{vs[0]}..{vs[-1]} ({len(vs)} releases)"
            ctx.report("KV404", f"kv_lora_rank + qk_rope_head_dim = {rank} + {rope} = {rank + rope}: "
                                f"{mla.sizes_text(label, rows.head_sizes)}; every MLA backend's metadata refuses "
                                f"it at the first forward pass ('Head dimension {rank + rope} is not supported by "
                                f"MLA'; {rows.citation})", path=key)


@checker("mla")
def check_mla_sliding_window(ctx) -> None:
    spec, cfg = ctx.spec, ctx.config
    if not _has_mla(spec):
        return
    # read from the config as written: the MLA architecture tables map no window (their models have none)
    window = cfg.get("sliding_window") if _is_int(cfg.get("sliding_window")) else None
    types = cfg.get("layer_types") if isinstance(cfg.get("layer_types"), list) else []
    sliding = [t for t in types if t == "sliding_attention"]
    if not window and not sliding:
        return
    key = spec.prefixed("sliding_window" if window else "layer_types")
    what = f"{key} = {window}" if window else f"{key} with {len(sliding)} sliding_attention layers"
    ctx.report("KV405", f"{what} on an MLA model: vLLM's DeepSeek MLA layers never apply a window (vllm/model_executor/"
                        "layers/mla.py, MultiHeadLatentAttentionWrapper.__init__ builds MLAAttention without "
                        f"sliding_window, {newest_read('vllm')}): every layer attends to and caches the whole context", path=key)


@checker("moe")
def check_experts(ctx) -> None:
    e, e_key = _get(ctx, "num_experts")
    k, k_key = _get(ctx, "experts_per_token")
    if k is not None:
        if not (_is_int(k) and k > 0):
            ctx.report("KV411", f"{k_key} is {k!r}; it must be a positive integer", path=k_key)
        elif e is not None and _is_int(e) and e > 0 and k > e:
            ctx.report("KV411", f"{k_key} = {k} exceeds {e_key} = {e}", path=k_key)
    if e is not None and not (_is_int(e) and e >= 0):
        ctx.report("KV411", f"{e_key} is {e!r}; the number of experts must be a non-negative integer", path=e_key)
    s, s_key = _get(ctx, "num_shared_experts")
    if s is not None and not (_is_int(s) and s >= 0):
        ctx.report("KV412", f"{s_key} is {s!r}; it must be an integer >= 0", path=s_key)
    _check_groups(ctx, e if _is_int(e) and e > 0 else None, e_key)


def _check_groups(ctx, experts, e_key) -> None:
    cfg, spec = ctx.config, ctx.spec
    g, tg = cfg.get("n_group"), cfg.get("topk_group")
    g_key, tg_key = spec.prefixed("n_group"), spec.prefixed("topk_group")
    if g is None:
        return
    if not (_is_int(g) and g > 0):
        ctx.report("KV414", f"{g_key} is {g!r}; it must be a positive integer", path=g_key)
        return
    if experts and experts % g:
        ctx.report("KV414", f"{e_key} = {experts} is not divisible by {g_key} = {g}", path=g_key)
    if tg is not None and not (_is_int(tg) and 1 <= tg <= g):
        ctx.report("KV414", f"{tg_key} = {tg!r} must be between 1 and {g_key} = {g}", path=tg_key)


@checker("moe")
def check_moe_layers(ctx) -> None:
    spec, cfg = ctx.spec, ctx.config
    n = spec.num_layers
    freq, f_key = _get(ctx, "moe_layer_freq")
    if freq is not None and not (_is_int(freq) and freq > 0):
        ctx.report("KV413", f"{f_key} is {freq!r}; it must be a positive integer", path=f_key)
    first, fk_key = _get(ctx, "first_k_dense")
    if first is not None:
        if not (_is_int(first) and first >= 0):
            ctx.report("KV413", f"{fk_key} is {first!r}; it must be an integer >= 0", path=fk_key)
        elif n and first > n:
            ctx.report("KV413", f"{fk_key} = {first} exceeds num_hidden_layers = {n}: no layer is MoE", path=fk_key)
    step = cfg.get("decoder_sparse_step")
    if step is not None:
        key = spec.prefixed("decoder_sparse_step")
        if not (_is_int(step) and step > 0):
            ctx.report("KV413", f"{key} is {step!r}; it must be a positive integer", path=key)
        elif n and step > n:
            ctx.report("KV413", f"{key} = {step} exceeds num_hidden_layers = {n}: no layer is MoE", path=key)
    only = cfg.get("mlp_only_layers")
    if only is not None:
        key = spec.prefixed("mlp_only_layers")
        if not isinstance(only, list):
            ctx.report("KV413", f"{key} is {only!r}; it must be a list of layer indices", path=key)
            return
        bad = [x for x in only if not _is_int(x) or x < 0 or (n is not None and x >= n)]
        if bad:
            ctx.report("KV413", f"{key} has entries outside 0..{(n or 0) - 1}: {bad[:5]}", path=key)
