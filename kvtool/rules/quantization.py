"""FP8 KV-cache quantization: scheme in config.json vs k_scale / v_scale tensors (KV8xx)."""

from __future__ import annotations

from kvtool.model import kv_scale_names as ksn
from kvtool.model.layer_types import KV_CACHE_TYPES
from kvtool.rules.registry import checker, define

# quantization_config keys that declare a quantized KV cache: compressed-tensors / llm-compressor
# (kv_cache_scheme) and NVIDIA ModelOpt (kv_cache_quant_algo).
SCHEME_KEYS = ("kv_cache_scheme", "kv_cache_quant_algo")
# Projection tensors that show an attention module is stored (plain, compressed-tensors packed, GPTQ).
WEIGHT_SUFFIXES = ("weight", "weight_packed", "qweight")

define("KV801", "kv-scales-missing", "error",
       "quantization_config declares a KV-cache scheme but attention layers lack k_scale / v_scale",
       """
       What it does: when quantization_config.kv_cache_scheme (or ModelOpt's kv_cache_quant_algo)
       is set, checks that every attention layer stores a K and a V scale under a name vLLM
       loads: self_attn.k_scale / v_scale, self_attn.attn.k_scale, ModelOpt's
       self_attn.k_proj.k_scale / v_proj.v_scale, or the legacy self_attn.kv_scale
       (vllm 0.33, vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name).
       compressed-tensors' k_proj.output_scale / v_proj.output_scale do not count: vLLM 0.33's
       llama loader (vllm/model_executor/models/llama.py, LlamaModel.hf_to_vllm_mapper) renames
       them to qkv_proj.output_scale, which is no parameter, so they are dropped.
       Why it matters: vLLM falls back to a scale of 1.0 for missing scales, with only a log
       warning: FP8 K/V values then clip or underflow and quality drops silently.
       Example: "kv_cache_scheme": {"num_bits": 8, "type": "float"} and no *_scale tensors.
       Fix: calibrate the scales (`kvtool quantize-kv`) or remove kv_cache_scheme.
       """, hint="calibrate the scales (kvtool quantize-kv) or remove the KV-cache scheme", topic="quantization")

define("KV806", "kv-scale-dropped", "warning",
       "a tensor named like a K / V / Q scale that vLLM does not load",
       """
       What it does: asks kvtool's one answer to "which tensor does vLLM load as which scale"
       (kvtool.model.kv_scale_names.vllm_target: vLLM's maybe_remap_kv_scale_name, 0.32.0 and
       0.33.0, over the scale parameters each attention layer registers) about every tensor named like
       a scale, and flags those it drops: a scale under a module that is no attention layer
       (model.layers.N.mlp.k_scale), self_attn.k_scale on an MLA model (vLLM maps it to attn.k_scale,
       which an MLA layer has not), a kv_scale on MLA, projection output_scale tensors.
       Why it matters: vLLM warns once, drops the tensor and uses 1.0; eval (which asks the same
       function) scores the model as vLLM serves it, without that scale.
       Example: "model.layers.0.self_attn.k_scale" in a DeepSeek-V3 checkpoint.
       Fix: store the scale under a name vLLM loads (MLA: self_attn.mla_attn.mla_attn.k_scale or
       self_attn.k_proj.k_scale; MHA / GQA: self_attn.k_scale), or drop it.
       """, hint="rename the scale to a spelling vLLM loads for this attention kind", topic="quantization")

define("KV807", "kv-scale-shape", "error",
       "a K / V / Q scale vLLM loads has a shape its loader refuses",
       """
       What it does: checks the number of values of every scale vLLM loads
       (kvtool.model.kv_scale_names.shape_problem): k / v one value (a scalar or [1]), or one per KV
       head under compressed-tensors' attn_head strategy; q and prob one value (one per query head
       with attn_head); an MLA layer one latent scale.
       Why it matters: vLLM's BaseKVCacheMethod.process_weights_after_loading raises "Only support
       per-tensor scaling factor" (0.33.0), or the parameter copy fails: the model does not load.
       Example: "model.layers.0.self_attn.q_scale" of shape [3] in a per-tensor checkpoint.
       Fix: recalibrate with `kvtool quantize-kv` (--strategy tensor or attn_head).
       """, hint="store one value per scale (or one per head with the attn_head strategy)", topic="quantization")

define("KV802", "kv-scales-without-scheme", "warning",
       "k_scale / v_scale tensors are stored but quantization_config declares no KV-cache scheme",
       """
       What it does: flags KV-cache scale tensors in a checkpoint whose quantization_config has
       neither kv_cache_scheme nor kv_cache_quant_algo.
       Why it matters: loaders decide from quantization_config whether to read the scales; without a
       declared scheme they are ignored (vLLM logs "not loaded") and FP8 KV runs with scale 1.0.
       Example: model.layers.0.self_attn.k_scale present, no quantization_config.
       Fix: add quantization_config.kv_cache_scheme (kvtool quantize-kv writes it), or drop the tensors.
       """, hint="declare quantization_config.kv_cache_scheme, or drop the scale tensors", topic="quantization")

define("KV803", "kv-scales-pre-rope", "warning",
       "K scales look calibrated before RoPE rather than where K enters the cache",
       """
       What it does: flags K scales that, by their name or the checkpoint's metadata, were observed
       before the rotary embedding: k_proj.output_scale (the projection's output activation), or a
       safetensors __metadata__ entry kvtool.kv_scale_point = "pre_rope".
       Why it matters: the cache stores K after RoPE; rotation mixes dimension pairs and changes the
       per-channel range, so an amax taken before it can be too small and FP8 K clips.
       Example: model.layers.0.self_attn.k_proj.output_scale with no self_attn.k_scale.
       Fix: recalibrate with observers on the attention's K input (kvtool quantize-kv hooks the
       post-RoPE keys).
       """, hint="recalibrate K scales after RoPE (kvtool quantize-kv)", topic="quantization")

define("KV804", "kv-cache-scheme-unsupported", "error",
       "quantization_config.kv_cache_scheme asks for a KV-cache quantization vLLM cannot run",
       """
       What it does: checks a compressed-tensors kv_cache_scheme against what vLLM's
       CompressedTensorsKVCacheMethod accepts: num_bits 8 with type "float" (FP8), strategy
       "tensor" (one scale per layer) or "attn_head" (one per KV head), and symmetric true.
       Why it matters: vLLM raises NotImplementedError at start-up for anything else, after the
       weights have been downloaded.
       Example: "kv_cache_scheme": {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": false}
       Fix: recalibrate with an FP8 per-tensor (or per-head) symmetric scheme (`kvtool quantize-kv`).
       """, hint="use num_bits 8, type float, strategy tensor or attn_head, symmetric true", topic="quantization")

# What vLLM's CompressedTensorsKVCacheMethod.validate_kv_cache_scheme accepts.
SUPPORTED_SCHEME = {"num_bits": (8,), "type": ("float",), "strategy": ("tensor", "attn_head"), "symmetric": (True,)}


def _scheme(cfg: dict) -> tuple[str, object] | None:
    q = cfg.get("quantization_config")
    if not isinstance(q, dict):
        return None
    for k in SCHEME_KEYS:
        if q.get(k) not in (None, {}, ""):
            return f"quantization_config.{k}", q[k]
    return None


def _attention_prefixes(ctx) -> list[str]:
    """Attention modules of KV-caching layers that the weights hold under the table's names."""
    spec, tensors = ctx.spec, ctx.checkpoint.tensors
    w = spec.arch.weights
    locals_ = [w[r] for r in ("q", "k", "v", "o", "qkv") if w.get(r)] + list(w.get("mla", {}).values())
    out = []
    for i, lt in enumerate(spec.layer_types):
        if lt not in KV_CACHE_TYPES:
            continue
        prefix = spec.arch.attn_prefix(i)
        if any(f"{prefix}.{loc}.{suffix}" in tensors for loc in locals_ for suffix in WEIGHT_SUFFIXES):
            out.append(prefix)
    return out


@checker("quantization")
def check_kv_scales(ctx) -> None:
    tensors = ctx.checkpoint.tensors
    if not tensors:
        return
    names = set(tensors)
    scheme = _scheme(ctx.spec.full_config)
    scale_names = [n for n in names if ksn.is_kv_scale(n)]
    if scheme is None:
        if scale_names:
            first = sorted(scale_names)[0]
            ctx.report("KV802", f"{len(scale_names)} KV-cache scale tensor(s) (e.g. {first}) but quantization_config "
                                "declares no kv_cache_scheme; loaders will ignore them", path=first,
                       file=ctx.file_of(tensors[first].file))
        return
    key, scheme_value = scheme
    prefixes = _attention_prefixes(ctx)
    if not prefixes:
        return
    spec = ctx.spec
    attention = "mla" if spec.is_mla else "mha"
    params = ksn.scale_params(prefixes, attention)  # what vLLM registers; vllm_target: what it loads into them
    loaded = ksn.loaded(names, params)
    dropped = sorted(n for n in names if ksn.looks_like_scale(n) and ksn.vllm_target(n, params) is None)
    missing: list[str] = []
    for p in prefixes:
        for role in ("k",) if attention == "mla" else ("k", "v"):  # MLA caches one latent: its k_scale
            if (p, role) not in loaded:
                missing.append(f"{p}.{ksn.CANONICAL[role]}")
    if missing:
        layers = len({m.rsplit(".", 1)[0] for m in missing})
        why = (f"; {dropped[0]} is stored but vLLM does not load it" + (
            " (its llama loader renames it to qkv_proj.output_scale, no parameter)"
            if dropped[0].endswith("output_scale") else "")) if dropped else ""
        ctx.report("KV801", f"{key} is set but {layers} of {len(prefixes)} attention layers lack K/V scales vLLM "
                            f"loads (first missing: {missing[0]}){why}; vLLM would use 1.0", path=key)
    if dropped:
        ctx.report("KV806", f"{len(dropped)} scale tensor(s) vLLM drops (first: {dropped[0]}; "
                            f"{ksn.REMAP_CITATION.split(',')[1].strip()}): it uses 1.0 instead", path=dropped[0],
                   file=ctx.file_of(tensors[dropped[0]].file))
    per_head = isinstance(scheme_value, dict) and scheme_value.get("strategy") == "attn_head"
    heads, kv_heads = spec.num_heads or 0, spec.num_kv_heads or 0
    for (_prefix, role), ns in sorted(loaded.items()):
        for n in ns:
            numel = 1
            for d in tensors[n].shape:
                numel *= d
            problem = ksn.shape_problem(role, numel, attention=attention, per_head=per_head, heads=heads,
                                        kv_heads=kv_heads)
            if problem:
                ctx.report("KV807", f"{n} has shape {list(tensors[n].shape)}: {problem}", path=n,
                           file=ctx.file_of(tensors[n].file))
                return


@checker("quantization")
def check_scheme_supported(ctx) -> None:
    q = ctx.spec.full_config.get("quantization_config")
    scheme = q.get("kv_cache_scheme") if isinstance(q, dict) else None
    if not isinstance(scheme, dict):
        return
    bad = [f"{k} = {scheme.get(k)!r}" for k, ok in SUPPORTED_SCHEME.items() if scheme.get(k) not in ok]
    if bad:
        ctx.report("KV804", f"quantization_config.kv_cache_scheme has {', '.join(bad)}; vLLM supports FP8 "
                            "(num_bits 8, type float), strategy tensor or attn_head, symmetric true",
                   path="quantization_config.kv_cache_scheme")


@checker("quantization")
def check_scale_point(ctx) -> None:
    ckpt = ctx.checkpoint
    if not ckpt.headers:
        return
    for h in ckpt.headers:
        if h.metadata.get(ksn.SCALE_POINT_METADATA_KEY) == "pre_rope":
            ctx.report("KV803", f"{h.file} metadata says {ksn.SCALE_POINT_METADATA_KEY} = pre_rope",
                       path=ksn.SCALE_POINT_METADATA_KEY, file=ctx.file_of(h.file))
            return
    names = set(ckpt.tensors)
    pre = []
    for n in sorted(names):
        m = ksn.match(n)
        if m is None or m[1].role != "k" or m[1].post_rope is not False:
            continue
        post = [name for name, sp in ksn.scales_for(m[0], names)["k"] if sp.post_rope]
        if not post:
            pre.append(n)
    if pre:
        ctx.report("KV803", f"{len(pre)} K scale(s) are projection-output scales taken before RoPE (e.g. {pre[0]}) "
                            "and no post-RoPE k_scale is stored", path=pre[0],
                   file=ctx.file_of(ckpt.tensors[pre[0]].file))


define("KV805", "kv-cache-dtype-unserved", "error",
       "The checkpoint's ModelOpt KV-cache algorithm is one vLLM ignores or cannot serve for this model",
       """
       What it does: when lint checks the vLLM release kvtool/model/kv_dtypes.json was read from (its `release`), reads
       a ModelOpt quantization_config's kv_cache_quant_algo (or kv_cache_scheme) the way vLLM's
       get_kv_cache_quant_algo_string does ("FP8" -> fp8_e4m3, "NVFP4" -> nvfp4) and checks the
       KV-cache dtype it becomes against kvtool/model/kv_dtypes.json: an attention backend for the model's
       attention kind (nvfp4 has none for MLA), and a head size the packing takes.
       Why it matters: an algorithm vLLM does not know is a warning in its log and a 16-bit cache (twice or four
       times the memory planned for); a dtype with no backend for the attention stops vLLM at start-up.
       Example: {"quantization_config": {"quant_method": "modelopt", "kv_cache_quant_algo": "INT8"}}
       Fix: re-export with kv_cache_quant_algo FP8 or NVFP4 (NVFP4 only for MHA / GQA / MQA models), or drop it
       and pass --kv-cache-dtype to vLLM.
       """, hint="use kv_cache_quant_algo FP8 (or NVFP4 on a non-MLA model)", topic="quantization")


@checker("quantization")
def check_kv_cache_dtype_served(ctx) -> None:
    from kvtool.engines.releases import checked_default
    from kvtool.model import kv_dtypes, kvcache

    vllm = [c for c in ctx.options.engines or checked_default() if c.engine == "vllm"]
    if not any(kv_dtypes.release() in c.versions for c in vllm):
        return  # the table holds what its release does; other releases were not read
    resolved = kvcache.modelopt_kv_dtype(ctx.spec)
    if resolved is None:
        return
    name, why = resolved
    q = ctx.spec.full_config.get("quantization_config", {})
    key = next((f"quantization_config.{k}" for k in ("kv_cache_quant_algo", "kv_cache_scheme") if q.get(k)),
               "quantization_config.quantization.kv_cache_quant_algo")
    if name == "auto":
        ctx.report("KV805", why.removeprefix("auto: "), path=key)
        return
    problem = kvcache.dtype_refusal(ctx.spec, kv_dtypes.get(name))
    if problem:
        ctx.report("KV805", f"{key} makes vLLM store {name}, and {problem}", path=key)
