"""Attention projection and embedding shapes the config implies, against the safetensors headers.

One check for lint (KV601 / KV603, kvtool.rules.weights) and for every command that reads the weights
(kvtool.model.preflight refuses the first mismatch): weights that contradict the config would otherwise
fail inside the conversion's arithmetic or transformers' loading (a size-mismatch RuntimeError after
its load report), or be read with the wrong head layout.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtool.values import is_int as _is_int

# Storage dtypes of packed quantized weights (GPTQ/AWQ int32 words, bitsandbytes / NVFP4 bytes):
# their shapes are not the logical matrix shape.
PACKED_DTYPES = ("U8", "I32", "U32", "F4", "I16")
# Layer counts above this are not real models (the layer-type resolver uses the same bound).
MAX_LAYERS = 100_000


@dataclass(frozen=True)
class Mismatch:
    name: str  # the first tensor whose shape disagrees
    shape: tuple
    rows: int
    cols: int
    why: str
    more: int  # further layers with the same disagreement

    def message(self) -> str:
        return f"{self.name} {self.detail()}"

    def detail(self) -> str:
        more = f" (and {self.more} more layer{'s' if self.more > 1 else ''})" if self.more else ""
        return f"has shape {list(self.shape)} but the config implies [{self.rows}, {self.cols}] ({self.why}){more}"


def expected_shapes(spec) -> dict[str, tuple[int, int, str]]:
    """role -> (out, in, explanation) for the attention projections the table names."""
    arch = spec.arch
    hidden, h = spec.hidden_size, spec.num_heads
    if not (hidden and h):
        return {}
    if not spec.is_mla and spec.get("kv_lora_rank") is not None:
        return {}  # MLA fields under a non-MLA table: the projection names are unknown
    out: dict[str, tuple[int, int, str]] = {}
    if spec.is_mla:
        g = spec.get
        rope, nope, v, kvr, qr = (g("qk_rope_head_dim"), g("qk_nope_head_dim"), g("v_head_dim"),
                                  g("kv_lora_rank"), g("q_lora_rank"))
        if not all(_is_int(x) and x > 0 for x in (rope, nope, v, kvr)):
            return {}
        qk = nope + rope
        mla = arch.weights.get("mla", {})
        if _is_int(qr) and qr > 0:
            out[mla.get("q_a", "")] = (qr, hidden, f"q_lora_rank {qr} x hidden {hidden}")
            out[mla.get("q_b", "")] = (h * qk, qr, f"{h} heads x (nope {nope} + rope {rope}) x q_lora_rank {qr}")
        else:
            out[mla.get("q", "")] = (h * qk, hidden, f"{h} heads x (nope {nope} + rope {rope}) x hidden {hidden}")
        out[mla.get("kv_a", "")] = (kvr + rope, hidden, f"(kv_lora_rank {kvr} + rope {rope}) x hidden {hidden}")
        out[mla.get("kv_b", "")] = (h * (nope + v), kvr, f"{h} heads x (nope {nope} + v {v}) x kv_lora_rank {kvr}")
        out[arch.weights.get("o", "")] = (hidden, h * v, f"hidden {hidden} x {h} heads x v {v}")
        out.pop("", None)
        return out
    kv, hd = spec.num_kv_heads, spec.head_dim
    if not (kv and hd):
        return {}
    w = arch.weights
    if w.get("qkv"):
        out[w["qkv"]] = ((h + 2 * kv) * hd, hidden,
                         f"({h} query + 2 x {kv} KV heads) x head_dim {hd} x hidden {hidden}")
    for role, heads, label in (("q", h, "query"), ("k", kv, "KV"), ("v", kv, "KV")):
        if w.get(role):
            out[w[role]] = (heads * hd, hidden, f"{heads} {label} heads x head_dim {hd} x hidden {hidden}")
    if w.get("o"):
        out[w["o"]] = (hidden, h * hd, f"hidden {hidden} x {h} heads x head_dim {hd}")
    return out


def projection_mismatches(spec, tensors) -> list[Mismatch]:
    """One Mismatch per attention projection whose stored shape differs from what the config implies."""
    n = spec.num_layers
    if not tensors or not n or n > MAX_LAYERS or spec.arch.generic:
        return []  # the generic table only guesses names and head layout (e.g. per-layer heads in nemotron-nas)
    transposed = bool(spec.arch.weights.get("transposed"))  # Conv1D layouts (GPT-2) store [in, out]
    out = []
    for local, (rows, cols, why) in expected_shapes(spec).items():
        if transposed:
            rows, cols = cols, rows
        bad: list[tuple[str, tuple]] = []
        for layer in range(n):
            name = f"{spec.arch.attn_prefix(layer)}.{local}.weight"
            t = tensors.get(name)
            if t is None or len(t.shape) != 2 or t.dtype in PACKED_DTYPES:
                continue
            if t.shape != (rows, cols):
                bad.append((name, t.shape))
        if bad:
            out.append(Mismatch(bad[0][0], tuple(bad[0][1]), rows, cols, why, len(bad) - 1))
    return out


def embedding_mismatch(spec, tensors) -> tuple[str, str] | None:
    """(config key, message) when the embedding's rows differ from vocab_size."""
    w = spec.arch.weights
    embed = tensors.get(w.get("embed", "")) if tensors and w.get("embed") else None
    vocab = spec.get("vocab_size")
    if embed is not None and _is_int(vocab) and embed.shape and embed.dtype not in PACKED_DTYPES:
        if embed.shape[0] != vocab:
            key = spec.key("vocab_size") or "vocab_size"
            return key, f"{key} = {vocab} but {embed.name} has {embed.shape[0]} rows (shape {list(embed.shape)})"
    return None


def require_weights_match_config(ckpt, spec) -> None:
    """Refuse (InputError, exit 2) weights that contradict the config: the first projection or embedding."""
    from kvtool.errors import InputError

    tensors = ckpt.tensors
    for m in projection_mismatches(spec, tensors):
        file = tensors[m.name].file
        raise InputError(f"{m.detail()}; config.json and the weights disagree",
                         file=str(ckpt.root / file) if ckpt.root is not None else file, field=m.name)
    bad = embedding_mismatch(spec, tensors)
    if bad is not None:
        key, message = bad
        raise InputError(f"{message}; config.json and the weights disagree", file=str(ckpt.config_path), field=key)
