"""Tensor names of FP8 KV-cache scales, relative to an attention module, and whether vLLM loads them.

vLLM 0.33's loader (vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name)
maps every spelling with vllm_loads=True onto `<attention>.attn.k_scale` / `.attn.v_scale`. The
compressed-tensors output-activation spelling `k_proj.output_scale` is recognised (lint reports
it) but vLLM 0.33 does not load it: LlamaModel.hf_to_vllm_mapper (vllm/model_executor/models/
llama.py) renames `.k_proj` to `.qkv_proj`, `qkv_proj.output_scale` is no parameter, and the layer
keeps a scale of 1.0. Lint (KV801) and eval count only what vLLM loads; quantize-kv writes the
first (canonical) spelling. tests/oracle/test_vllm_facts.py checks both facts against vLLM's source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable

from kvtool.model.engine_tables import newest_read, observed


@dataclass(frozen=True)
class ScaleSpelling:
    suffix: str  # after "<attention prefix>."
    role: str  # "k", "v", or "kv" (one legacy tensor for both)
    style: str  # who writes it
    post_rope: bool | None  # True: taken where K enters the cache; False: at the projection output; None: unknown
    vllm_loads: bool = True  # False: vLLM 0.33 drops the tensor and uses 1.0


SPELLINGS: tuple[ScaleSpelling, ...] = (
    ScaleSpelling("k_scale", "k", "compressed-tensors", True),
    ScaleSpelling("v_scale", "v", "compressed-tensors", True),
    ScaleSpelling("attn.k_scale", "k", "vllm", True),
    ScaleSpelling("attn.v_scale", "v", "vllm", True),
    ScaleSpelling("k_proj.k_scale", "k", "modelopt", True),
    ScaleSpelling("v_proj.v_scale", "v", "modelopt", True),
    ScaleSpelling("kv_scale", "kv", "legacy", None),
    # compressed-tensors output activations of the projections: observed before RoPE is applied
    ScaleSpelling("k_proj.output_scale", "k", "output-activation", False, vllm_loads=False),
    ScaleSpelling("v_proj.output_scale", "v", "output-activation", False, vllm_loads=False),
)

CANONICAL = {"k": "k_scale", "v": "v_scale"}  # what kvtool writes

# safetensors __metadata__ key kvtool quantize-kv records; value "post_rope" or "pre_rope".
SCALE_POINT_METADATA_KEY = "kvtool.kv_scale_point"

_SUFFIX_RE = re.compile(
    r"^(?P<prefix>.+?)\.(?P<suffix>" + "|".join(re.escape(s.suffix) for s in
                                                sorted(SPELLINGS, key=lambda s: -len(s.suffix))) + r")$"
)
_BY_SUFFIX = {s.suffix: s for s in SPELLINGS}
_ENDINGS = tuple({s.suffix.rsplit(".", 1)[-1] for s in SPELLINGS})


def match(name: str) -> tuple[str, ScaleSpelling] | None:
    """(attention prefix, spelling) when `name` is a KV-scale tensor, else None."""
    if not name.endswith(_ENDINGS):  # cheap filter: checkpoints hold up to ~100k tensors
        return None
    m = _SUFFIX_RE.match(name)
    if not m:
        return None
    return m.group("prefix"), _BY_SUFFIX[m.group("suffix")]


def is_kv_scale(name: str) -> bool:
    return match(name) is not None


def scales_for(attn_prefix: str, names: Iterable[str], *, loaded_only: bool = False
               ) -> dict[str, list[tuple[str, ScaleSpelling]]]:
    """The scale tensors of one attention module: role ("k" / "v") -> [(tensor name, spelling)].

    The legacy single `kv_scale` counts for both roles (vLLM duplicates it). loaded_only: only the
    spellings vLLM loads.
    """
    out: dict[str, list[tuple[str, ScaleSpelling]]] = {"k": [], "v": []}
    for sp in SPELLINGS:
        if loaded_only and not sp.vllm_loads:
            continue
        name = f"{attn_prefix}.{sp.suffix}"
        if name in names:
            for role in ("k", "v") if sp.role == "kv" else (sp.role,):
                out[role].append((name, sp))
    return out


def canonical_name(attn_prefix: str, role: str) -> str:
    """The name quantize-kv writes for a layer's K or V scale."""
    return f"{attn_prefix}.{CANONICAL[role]}"


# q scales (FP8 attention, kvtool.eval.fp8_backends): maybe_remap_kv_scale_name maps `<attention>.q_scale` onto
# `<attention>.attn.q_scale` (its default `.([qkv])_scale` pattern), which it also takes as written.
Q_SPELLINGS = ("q_scale", "attn.q_scale")
_Q_RE = re.compile(r"^(?P<prefix>.+?)\.(?P<suffix>attn\.q_scale|q_scale)$")


def match_q(name: str) -> tuple[str, str] | None:
    """(attention prefix, spelling) when `name` is a q-scale tensor, else None."""
    if not name.endswith("q_scale"):
        return None
    m = _Q_RE.match(name)
    if not m or m.group("prefix").rsplit(".", 1)[-1].endswith("_proj"):
        return None  # `q_proj.q_scale`: vLLM looks for q_proj.attn.q_scale, no parameter, and drops it
    return m.group("prefix"), m.group("suffix")


def q_canonical_name(attn_prefix: str) -> str:
    """The name quantize-kv writes for a layer's q scale (beside its k_scale / v_scale)."""
    return f"{attn_prefix}.{Q_SPELLINGS[0]}"


# --- what vLLM loads: one function (eval, lint and quantize-kv ask it) ------------------------------------------
# vLLM 0.33.0 vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name, ported rule by rule (the
# DeepSeek loader, vllm/model_executor/models/deepseek_v2.py DeepseekV2ForCausalLM.load_weights, and the llama one
# call it on every checkpoint name; a None answer is `continue`: the tensor is dropped and the layer keeps 1.0).
# The same function in vLLM 0.32.0 (tests/oracle/test_vllm_facts.py compares both excerpts with this table).
REMAP_RELEASE = newest_read("vllm")  # checked against tests/data/vllm/<REMAP_RELEASE>/ and the lane's release
REMAP_CITATION = (f"vllm/model_executor/model_loader/weight_utils.py, maybe_remap_kv_scale_name, {REMAP_RELEASE} "
                  f"(and {observed('vllm')}); vllm/model_executor/layers/quantization/kv_cache.py, "
                  f"BaseKVCacheMethod.create_weights / process_weights_after_loading, {REMAP_RELEASE}")
# the names the function remaps at all (any other name is taken only when it is a parameter)
REMAP_ENDINGS = (".k_scale", ".v_scale", ".q_scale", ".q.scale", ".k_cache.scale", ".v_cache.scale")
# (pattern, replacement) in order of precedence; {attn} is "mla_attn.mla_attn" in a model with MLA parameters
REMAP_PATTERNS = (
    (r"\.self_attn\.([kv])_proj\.([kv])_scale$", r".self_attn.{attn}.\2_scale"),  # ModelOpt
    (r"\.self_attn\.qkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),
    (r"\.self_attn\.qkqkv_proj\.([kv])_scale$", r".self_attn.attn.\1_scale"),  # Qwen3 MoE
    (r"\.mixer\.[kv]_proj\.([kv])_scale$", r".mixer.attn.\1_scale"),  # NemotronH
    (r"\.self_attn\.q\.scale$", r".self_attn.attn.q_scale"),  # HYV3
    (r"\.self_attn\.([kv])_cache\.scale$", r".self_attn.attn.\1_scale"),  # HYV3
    (r"\.([qkv])_scale$", r".attn.\1_scale"),  # default
)
# the scale parameters each attention layer registers (BaseKVCacheMethod.create_weights: q_scale, k_scale, v_scale,
# prob_scale), under the module vLLM's attention layer sits at: `<attention>.attn` (Attention), or
# `<attention>.mla_attn.mla_attn` (DeepseekV2MLAAttention -> MultiHeadLatentAttentionWrapper -> MLAAttention)
PARAM_ROLES = ("k", "v", "q", "prob")
LAYER_MODULE = {"mha": "attn", "mla": "mla_attn.mla_attn"}


def scale_params(prefixes: Iterable[str], attention: str) -> dict[str, tuple[str, str]]:
    """vLLM's scale parameters of a model: parameter name -> (attention prefix, role)."""
    mod = LAYER_MODULE[attention]
    return {f"{p}.{mod}.{r}_scale": (p, r) for p in prefixes for r in PARAM_ROLES}


def vllm_target(name: str, params: dict[str, tuple[str, str]]) -> tuple[str, str] | None:
    """Where vLLM loads checkpoint tensor `name` among a model's scale parameters (`scale_params`): (attention
    prefix, role "k" / "v" / "q" / "prob"), or None when it drops it (not a scale parameter, or one the remap
    sends to a parameter the model has not). The legacy `kv_scale` loads as k and vLLM duplicates it to v."""
    if name in params:
        return params[name]
    if name.endswith(".kv_scale"):
        return params.get(name[:-len(".kv_scale")] + ".attn.k_scale")
    if not name.endswith(REMAP_ENDINGS):
        return None
    attn = LAYER_MODULE["mla"] if any("mla_attn" in k for k in params) else LAYER_MODULE["mha"]
    for pattern, repl in REMAP_PATTERNS:
        if re.search(pattern, name):
            return params.get(re.sub(pattern, repl.replace("{attn}", attn), name))
    return None


def model_params(spec) -> dict[str, tuple[str, str]]:
    """The scale parameters vLLM gives `spec`'s KV-caching attention layers (their prefixes from the table)."""
    from kvtool.model.layer_types import KV_CACHE_TYPES

    prefixes = [spec.arch.attn_prefix(i) for i, lt in enumerate(spec.layer_types) if lt in KV_CACHE_TYPES]
    return scale_params(prefixes, "mla" if spec.is_mla else "mha")


def loaded(names: Iterable[str], params: dict[str, tuple[str, str]]) -> dict[tuple[str, str], list[str]]:
    """(attention prefix, role) -> the checkpoint tensors vLLM loads into that parameter, in checkpoint name order
    (a legacy kv_scale fills v too); vLLM loads each in turn, so the last one loaded wins."""
    out: dict[tuple[str, str], list[str]] = {}
    for n in sorted(names):
        t = vllm_target(n, params)
        if t is None:
            continue
        out.setdefault(t, []).append(n)
        if n.endswith(".kv_scale"):
            out.setdefault((t[0], "v"), []).append(n)
    return out


def looks_like_scale(name: str) -> bool:
    """A name a reader would take for a K / V / Q scale (any spelling kvtool or vLLM knows), loaded or not."""
    return name.endswith((*REMAP_ENDINGS, ".kv_scale", ".prob_scale", "_proj.output_scale"))


def shape_problem(role: str, numel: int, *, attention: str, per_head: bool, heads: int, kv_heads: int) -> str | None:
    """Why vLLM's loader refuses a scale of `numel` values for `role`, None when it takes it.
    BaseKVCacheMethod.process_weights_after_loading (0.33.0): k / v one value each (a scalar or [1]: the loader
    fills a one-element parameter from any one-element tensor), q and prob one value ("Only support per-tensor
    scaling factor"). compressed-tensors' attn_head strategy (per_head) takes one value per KV head for k / v
    and one per query head for q (CompressedTensorsKVCacheMethod); an MLA layer caches one latent: one value."""
    if numel == 1:
        return None
    if attention == "mla":
        return f"an MLA layer takes one {role} scale, not {numel} values"
    if per_head and role in ("k", "v") and numel == kv_heads:
        return None
    if per_head and role == "q" and numel in (heads, kv_heads):
        return None
    want = {"k": f"1 or {kv_heads} (attn_head)", "v": f"1 or {kv_heads} (attn_head)",
            "q": f"1 or {heads} (attn_head)", "prob": "1"}[role] if per_head else "1"
    return f"vLLM takes {want} value(s) for a {role} scale, not {numel}"
