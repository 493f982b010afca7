"""Parameter count from a config, for budgets on checkpoints without safetensors (an estimate).

Counts embeddings, the LM head (unless tied), attention projections (GQA or MLA, from the spec the
architecture table resolves) and gated MLPs (gate, up, down: 3 x hidden x intermediate; GPT-2-style
two-matrix MLPs are overstated by a third), with MoE experts, shared experts and routers where the
table maps them. Norms and biases are left out (well under 0.1% of a model); the mixers of Mamba /
linear-attention layers are not modelled and are named in the notes, so the estimate is low for
such hybrids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtool.model.kvcache import dtype_bytes
from kvtool.model.layer_types import KV_CACHE_TYPES

NO_MIXER = ("mlp", "moe", "none")  # layer types that are a feed-forward block only (nemotron_h)
# Bits per weight of quantized linear layers, by quantization_config.quant_method, when the config
# gives no explicit `bits` (mxfp4: 4-bit values plus one 8-bit scale per 32).
QUANT_BITS = {"fp8": 8, "fbgemm_fp8": 8, "mxfp4": 4.25, "bitnet": 2}


@dataclass
class Estimate:
    params: int
    bytes: int
    dtype: str
    notes: list[str] = field(default_factory=list)


def _i(v) -> int:
    return v if isinstance(v, int) and not isinstance(v, bool) else 0


def attention_params(spec) -> int:
    h, nh, kvh, hd = spec.hidden_size or 0, spec.num_heads or 0, spec.num_kv_heads or 0, spec.head_dim or 0
    if spec.is_mla:
        q_lora = _i(spec.number("q_lora_rank"))
        kv_lora = _i(spec.number("kv_lora_rank"))
        rope = _i(spec.number("qk_rope_head_dim"))
        nope = _i(spec.number("qk_nope_head_dim"))
        v = _i(spec.number("v_head_dim")) or nope
        q = (h * q_lora + q_lora * nh * (nope + rope)) if q_lora else h * nh * (nope + rope)
        return q + h * (kv_lora + rope) + kv_lora * nh * (nope + v) + nh * v * h
    return h * nh * hd + 2 * h * kvh * hd + nh * hd * h


def mlp_params(spec, layer: int) -> int:
    h = spec.hidden_size or 0
    inter = _i(spec.number("intermediate_size")) or 4 * h  # GPT-2 / GPT-J leave n_inner null: 4 x hidden
    experts = _i(spec.number("num_experts"))
    dense_first = _i(spec.number("first_k_dense"))
    if not experts or layer < dense_first:
        return 3 * h * inter
    moe_inter = _i(spec.number("moe_intermediate_size")) or inter
    shared = _i(spec.number("num_shared_experts"))
    return (experts + shared) * 3 * h * moe_inter + h * experts


def estimate(spec) -> Estimate | None:
    """None when the config lacks the sizes needed (hidden size, layers, vocabulary)."""
    h, n, vocab = spec.hidden_size, spec.num_layers, _i(spec.number("vocab_size"))
    if not h or not n or not vocab:
        return None
    embed = vocab * h * (1 if spec.get("tie_word_embeddings") else 2)
    params = 0
    attn = attention_params(spec)
    types = spec.layer_types or ["full_attention"] * n
    # Block-per-layer hybrids (nemotron_h) list their feed-forward blocks as layers of their own.
    ffn_own_layers = any(t in ("mlp", "moe") for t in types)
    skipped = 0
    for i, lt in enumerate(types):
        if lt in KV_CACHE_TYPES:
            params += attn
        elif lt not in NO_MIXER:
            skipped += 1
        if not ffn_own_layers or lt in ("mlp", "moe"):
            params += mlp_params(spec, i)
    dtype = spec.dtype or "bfloat16"
    eb = min(dtype_bytes(dtype, 2), 2)  # vLLM (--dtype auto) serves float32 checkpoints in 16 bits
    method, bits = quant_bits(spec.full_config.get("quantization_config"))
    layer_bytes = params * (bits / 8 if bits else eb)
    total = embed + params
    how = dtype if spec.dtype else "16-bit assumed: the config names no dtype"
    if eb < dtype_bytes(dtype, 2):
        how += " served in 16 bits"
    if bits:
        how += f", decoder layers {method} at {bits:g} bits/weight"
    notes = [f"weights estimated from config.json ({total / 1e9:.2f} B parameters, {how}); no safetensors were read"]
    if method and not bits:
        notes.append(f"quantization {method!r} has no known bit width; counted at {eb:g} bytes per weight "
                     "(the estimate is high)")
    if skipped:
        notes.append(f"{skipped} Mamba / linear-attention mixers not counted: the estimate is low")
    if not _i(spec.number("intermediate_size")):
        notes.append("the config gives no intermediate size; 4 x hidden assumed")
    return Estimate(total, int(embed * eb + layer_bytes), dtype, notes)


def quant_bits(qc) -> tuple[str | None, float | None]:
    """(method, bits per weight) of a quantization_config, or (None, None) when unquantized."""
    if not isinstance(qc, dict):
        return None, None
    method = qc.get("quant_method") if isinstance(qc.get("quant_method"), str) else "unknown"
    bits = qc.get("bits")
    if isinstance(bits, (int, float)) and not isinstance(bits, bool) and bits > 0:
        return method, float(bits)
    groups = qc.get("config_groups")
    for group in (groups.values() if isinstance(groups, dict) else ()):  # compressed-tensors
        nb = (group.get("weights") or {}).get("num_bits") if isinstance(group, dict) else None
        if isinstance(nb, int) and nb > 0:
            return method, float(nb)
    return method, QUANT_BITS.get(method)
