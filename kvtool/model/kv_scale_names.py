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
