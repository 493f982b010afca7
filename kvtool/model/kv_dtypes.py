"""The KV-cache dtypes vLLM accepts (`--kv-cache-dtype`), as data: how each stores a token (kv_dtypes.json).

A row says how one token of one layer is stored: `dense` (element_bits per K and V element, per-tensor
scales that cost nothing per token), `per_token_head` (elements plus a float32 scale for K and one for V
per head), `nvfp4` (4-bit values plus one fp8 scale per 16), `turboquant` / `octave` / `ultraquant`
(K and V packed into one slot per head, scales and norms inside it, the slot rounded as vLLM rounds it),
`token_blob` (DeepSeek's sparse-MLA rows: a fixed byte count per token) and `model` (auto). `SLOT_BYTES`
holds one function per layout, restating the vLLM function the row cites (tests/model/test_kv_dtypes.py
runs vLLM's own code from tests/data/vllm/<the table's release>/ against each). No torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

from kvtool.model.engine_tables import Citation, load

# The attention kinds a row names; which one a model has: `attention_kind`.
KIND_WORDS = {"standard": "MHA / GQA / MQA attention", "mla": "MLA",
              "mla_sparse": "sparse MLA (a DeepSeek-V3.2 indexer, config index_topk)"}


@dataclass(frozen=True)
class KvDtype:
    name: str
    storage: str | None  # the torch dtype of the cache tensor (vLLM's STR_DTYPE_TO_TORCH_DTYPE); None: auto
    layout: str  # a key of SLOT_BYTES, or "model" (auto)
    scales: str  # what the scales cost, in words
    attention: tuple[str, ...]  # kinds with an in-tree vLLM backend for it (KIND_WORDS)
    citation: Citation
    element_bits: int | None = None
    scale_bytes: int = 0  # per_token_head: bytes of each of the two scales (K, V) per head
    token_bytes: int | None = None  # token_blob: bytes per token per layer
    key_bits: int | None = None
    value_bits: int | None = None
    compact: bool = False
    group_size: int | None = None
    block: int | None = None
    boundary_layers: int = 0  # first / last N attention layers vLLM keeps at the model dtype (dense models)
    must_match_model: bool = False  # float16 / bfloat16: vLLM refuses one that is not the model's dtype
    platform: str | None = None  # the one platform that serves it (ROCm only; an out-of-tree plugin)

    @property
    def cite(self) -> str:
        return self.citation.cited("vLLM")

    def slot_bytes(self, head_dim: int, rope_dim: int | None = None) -> int:
        """Bytes one token costs per KV head, K and V together, on standard attention."""
        return SLOT_BYTES[self.layout](self, head_dim, rope_dim)

    def mla_bytes(self, latent: int) -> int:
        """Bytes one token costs in one MLA layer (one latent of kv_lora_rank + qk_rope_head_dim values)."""
        if self.layout == "token_blob":
            return self.token_bytes
        if self.layout != "dense":
            raise ValueError(f"{self.name} has no MLA layout")
        return latent * self.element_bits // 8

    def slot_problem(self, head_dim: int, rope_dim: int | None) -> str | None:
        """Why vLLM's packing refuses this head size, or None."""
        check = SHAPE_CHECKS.get(self.layout)
        return check(self, head_dim, rope_dim) if check else None


def _dense(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # AttentionSpec.state_content_size_bytes: (head_size + head_size_v) * dtype size
    return 2 * head_dim * d.element_bits // 8


def _per_token_head(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # TritonAttentionBackend.customize_spec: int4 halves the head; (K + V) * 1 byte + 2 float32 scales
    return 2 * (head_dim * d.element_bits // 8) + 2 * d.scale_bytes


def _nvfp4(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # nvfp4_kv_cache_full_dim: head_size // 2 + head_size // 16, in two slots per KV head (K and V)
    return 2 * (head_dim // 2 + head_dim // d.block)


def _turboquant(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # TurboQuantConfig.key_packed_size / value_packed_size / slot_size_aligned
    key = head_dim if d.key_bits == 8 else math.ceil(head_dim * d.key_bits / 8) + 2
    value = math.ceil(head_dim * d.value_bits / 8) + 4
    s = key + value
    return s + s % 2


HADAMARD_BLOCK, ROPE_BITS, NOPE_BITS = 64, 4, 3  # vllm/v1/attention/ops/rocm_octave.py


def _octave(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # OctaveFormat.slot_bytes: rotary dims at 4 bits, the rest 3, V at value_bits, float16 scales
    wide = 0 if d.compact else (rope_dim if rope_dim is not None else head_dim)
    off_v = wide * ROPE_BITS // 8 + (head_dim - wide) * NOPE_BITS // 8
    off_scales = off_v + head_dim * d.value_bits // 8
    scales = (1 if d.compact else head_dim // HADAMARD_BLOCK) + 1
    align = 4 if d.compact else 8
    return -(-(off_scales + 2 * scales) // align) * align


def _ultraquant(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    # ultraquant/format.py slot_size: K and V codes 2 per byte, one E8M0 scale byte per group each
    return 2 * (head_dim // 2 + head_dim // d.group_size)


def _token_blob(d: KvDtype, head_dim: int, rope_dim: int | None) -> int:
    raise ValueError(f"{d.name} stores MLA rows only")


SLOT_BYTES: dict[str, Callable[[KvDtype, int, int | None], int]] = {
    "dense": _dense, "per_token_head": _per_token_head, "nvfp4": _nvfp4, "turboquant": _turboquant,
    "octave": _octave, "ultraquant": _ultraquant, "token_blob": _token_blob,
}


def _octave_shape(d: KvDtype, head_dim: int, rope_dim: int | None) -> str | None:
    r = rope_dim if rope_dim is not None else head_dim
    if head_dim % HADAMARD_BLOCK or r % HADAMARD_BLOCK:
        return (f"vLLM's OctaveFormat needs head_size and the rotary dim in multiples of {HADAMARD_BLOCK} "
                f"(head_dim {head_dim}, rotary dim {r})")
    if d.compact and head_dim & (head_dim - 1):
        return f"vLLM's compact Octave K needs a power-of-two head_size (head_dim {head_dim})"
    return None


def _grouped_shape(d: KvDtype, head_dim: int, rope_dim: int | None) -> str | None:
    if head_dim % d.group_size:
        return f"vLLM's UltraQuant needs head_dim a multiple of {d.group_size} (head_dim {head_dim})"
    return None


# the head sizes of vLLM 0.33's one NVFP4 backend (vllm/v1/attention/backends/flashinfer.py
# FlashInferBackend.get_supported_head_sizes; tests/model/test_kv_dtypes.py reads it)
NVFP4_HEAD_SIZES = (64, 128, 256, 512)


def _nvfp4_shape(d: KvDtype, head_dim: int, rope_dim: int | None) -> str | None:
    # vllm/utils/torch_utils.py nvfp4_kv_cache_full_dim / nvfp4_split_data_scale: head_size // 2 bytes of e2m1 and
    # head_size // 16 e4m3 scales per head; FlashInfer, the backend that serves it, takes the sizes above
    if head_dim % d.block or head_dim not in NVFP4_HEAD_SIZES:
        return (f"vLLM serves NVFP4 with FlashInfer only, for head_dim {', '.join(map(str, NVFP4_HEAD_SIZES))} "
                f"(head_dim {head_dim})")
    return None


SHAPE_CHECKS = {"octave": _octave_shape, "ultraquant": _grouped_shape, "nvfp4": _nvfp4_shape}


@lru_cache(maxsize=1)
def _load() -> tuple[str, dict[str, KvDtype]]:
    data = load("kvtool/model/kv_dtypes.json")  # citations parsed (kvtool.model.engine_tables)
    rows: dict[str, KvDtype] = {}
    for r in data["dtypes"]:
        r = dict(r)
        r["attention"] = tuple(r["attention"])
        rows[r["name"]] = KvDtype(**r)
    if data.release is None:
        raise ValueError("kvtool/model/kv_dtypes.json: release: the vLLM release the table was read from")
    return data.release, rows


def release() -> str:
    """The vLLM release the table was read from."""
    return _load()[0]


def table() -> dict[str, KvDtype]:
    """name -> row, in vLLM's CacheDType order."""
    return _load()[1]


def names() -> tuple[str, ...]:
    """Every `--kv-cache-dtype` value vLLM accepts (auto first)."""
    return tuple(table())


def emulated() -> tuple[str, ...]:
    """The dtypes `kvtool eval` emulates: the rows of kv_emulations.json, in this table's order."""
    from kvtool.model import kv_emulations

    rows = kv_emulations.table()
    return tuple(n for n in table() if n in rows)


def get(name: str) -> KvDtype | None:
    return table().get(name)


def attention_kind(spec) -> str:
    """standard | mla | mla_sparse: which of vLLM's backend families serve this model's attention.
    Sparse MLA is DeepSeek-V3.2's (vllm/model_executor/models/deepseek_v2.py: is_v32 = hasattr(config,
    "index_topk"), which selects the sparse MLA backends)."""
    if not spec.is_mla:
        return "standard"
    return "mla_sparse" if "index_topk" in spec.config else "mla"


def _emulation_words(emu) -> str:
    # a string names itself (fp8's format); a number or flag says what it is; null (the model's, e.g. Octave's
    # rotary dims) is left out
    params = ", ".join(v if isinstance(v, str) else f"{k}={v}" for k, v in emu.params.items() if v is not None)
    return f"emulated ({emu.codec}{': ' + params if params else ''}; {emu.match})"


# How each layout's bytes read as a formula, for the docs table (d = head_dim; the code above is what counts).
FORMULAS = {
    "model": "2 d x 2 (the model's 16-bit dtype)",
    "dense": "2 d x {bits}/8",
    "per_token_head": "2 (d x {bits}/8) + 2 x {scale_bytes}",
    "nvfp4": "2 (d/2 + d/{block})",
    "turboquant": "K {key} + V (ceil({value_bits} d/8) + 4), rounded up to even",
    "octave": "see OctaveFormat.slot_bytes ({value_bits}-bit V{compact})",
    "ultraquant": "2 (d/2 + d/{group_size})",
    "token_blob": "{token_bytes} per token per MLA layer",
}


def markdown() -> str:
    """The docs table of every row (docs/kv-budget.md, regenerated by `python -m kvtool.options --write`)."""
    rows = [f"| `--kv-cache-dtype` | stored as | bytes per token per KV head (K + V), head_dim d | d = 128 | scales "
            f"| attention with a vLLM {release()} backend | `kvtool eval` | vLLM {release()} source |",
            "|---|---|---|---|---|---|---|---|"]
    from kvtool.model import kv_emulations

    for r in table().values():
        emu = kv_emulations.get(r.name)
        key = ("d (fp8)" if r.key_bits == 8 else f"(ceil({r.key_bits} d/8) + 2)") if r.layout == "turboquant" else ""
        formula = FORMULAS[r.layout].format(bits=r.element_bits, scale_bytes=r.scale_bytes, block=r.block,
                                            key=key, value_bits=r.value_bits, group_size=r.group_size,
                                            token_bytes=r.token_bytes, compact=", compact K" if r.compact else "")
        at128 = "512" if r.layout == "model" else "" if r.layout == "token_blob" else str(r.slot_bytes(128, 128))
        extra = [f"in a model without Mamba / linear-attention layers the first and last {r.boundary_layers} layers "
                 "stay in the model dtype"
                 ] if r.boundary_layers else []
        extra += ["must be the model's dtype"] if r.must_match_model else []
        extra += [r.platform] if r.platform else []
        kinds = ", ".join(KIND_WORDS[k] for k in r.attention)
        c = r.citation
        rows.append(f"| `{r.name}` | {r.storage or 'model dtype'} | {formula} | {at128} | "
                    f"{'; '.join([r.scales, *extra])} | {kinds} | {_emulation_words(emu) if emu else ''} | "
                    f"`{c.file}` {c.function} |")
    return "\n".join(rows) + "\n"
