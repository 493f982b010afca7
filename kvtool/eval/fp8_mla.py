"""FP8 latent-cache emulation for MLA checkpoints (DeepSeek layout), where and how vLLM 0.33 writes the cache.

What vLLM caches (vllm/model_executor/layers/mla.py `MultiHeadLatentAttentionWrapper.forward`): per token and
layer, `kv_c_normed = kv_a_layernorm(kv_c)` (the RMSNorm's weight included) and the shared rope key `k_pe`
*after* `rotary_emb`, one head of kv_lora_rank + qk_rope_head_dim values. `MLAAttention.update_kv_cache`
(vllm/model_executor/layers/attention/mla_attention.py) writes both through `do_kv_cache_update`
(vllm/v1/attention/backend.py) -> `ops.concat_and_cache_mla(kv_c_normed, k_pe, ..., scale=layer._k_scale)`: ONE
scale, the layer's k_scale, for the latent and the rope key (skip_scale when it is 1.0: the same values). The
cast is the cache kernels' saturating e4m3 conversion (kvtool.eval.fp8.fp8_roundtrip: clamp to +-448).

Reading it back: TRITON_MLA (the portable dense MLA backend, on any GPU; vLLM serves MLA rows of 320, 512 or 576
values only, whatever the backend: schemas/engines/mla_backends.json) dequantizes in the kernel as
`(k.to(float32) * k_scale).to(q.dtype)` for the latent, the rope key and the values (the latent again,
`v_scale=layer._k_scale`:
vllm/v1/attention/backends/mla/triton_mla.py `TritonMLAImpl.forward_mqa`,
vllm/v1/attention/ops/triton_decode_attention.py) and keeps the query in the model dtype
(`TritonMLAImpl.__init__` sets supports_quant_query_input = False for an FP8 cache). FlashMLA, FlashInfer-MLA and
CUTLASS-MLA keep MLACommonImpl's supports_quant_query_input = True: `forward_impl` quantizes the absorbed decode
query (q_nope W_UK with q_pe, `_DecodeConcatQuantFP8`, layer._q_scale); kvtool does not emulate that
(--fp8-attention refuses an MLA checkpoint).

Where it applies: decode reads every past token from the cache. A prompt's prefill without cached context
(`MLACommonBaseImpl.forward_mha`) attends to the fresh, unquantized kv_c_normed / k_pe of its own tokens; only
context from earlier chunks or the prefix cache is read back from the FP8 cache (`_compute_prefill_context`).
Eval rounds every key, which is what generation sees, not what a single prompt's log-probabilities see.

Scales (`read_mla_scales`): vLLM's DeepSeek loader (vllm/model_executor/models/deepseek_v2.py `load_weights`)
maps checkpoint names with weight_utils.py `maybe_remap_kv_scale_name`; the layer's parameter is
`<layer>.self_attn.mla_attn.mla_attn.k_scale`, which it takes as is, and modelopt's `self_attn.k_proj.k_scale`
remaps onto it. `self_attn.k_scale`, `self_attn.attn.k_scale` and `kv_scale` remap to `.attn.k_scale`, which an
MLA layer has not: vLLM warns, drops them and keeps 1.0. v_scale is loaded but no MLA kernel reads it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtool.errors import InputError, UsageError
from kvtool.eval.fp8 import KVScales, fp8_roundtrip, layer_index
from kvtool.eval.fp8_backends import Citation

# precedence among the names vLLM loads as an MLA layer's k_scale (which ones it loads: kv_scale_names.vllm_target)
K_SCALE_NAMES = ("mla_attn.mla_attn.k_scale", "k_proj.k_scale")
_MLA = "vllm/model_executor/layers/attention/mla_attention.py"
CITED = (
    Citation("vllm/model_executor/layers/mla.py", "MultiHeadLatentAttentionWrapper.forward"),
    Citation(_MLA, "MLAAttention.update_kv_cache"),
    Citation("vllm/v1/attention/backend.py", "MLAAttentionImpl.do_kv_cache_update"),
    Citation("vllm/v1/attention/backends/mla/triton_mla.py", "TritonMLAImpl.forward_mqa"),
    Citation("vllm/model_executor/model_loader/weight_utils.py", "maybe_remap_kv_scale_name"),
)


def refuse_fp8_attention(name: str) -> UsageError:
    return UsageError(f"{name} is not emulated for MLA checkpoints: only cache-only (vLLM's TRITON_MLA keeps the "
                      "query in the model dtype; FlashMLA / FlashInfer-MLA / CUTLASS-MLA also round the absorbed "
                      "decode query, which kvtool does not emulate)", option="fp8_attention")


@dataclass
class MLAScales:
    """One latent-cache scale per layer (layer -> float); a layer without one uses 1.0, as vLLM does."""

    k: dict[int, float] = field(default_factory=dict)
    source: str = "one"  # "checkpoint" | "one" | "given"

    @classmethod
    def from_given(cls, given) -> "MLAScales":
        """Scales given to the API ({layer: (k, v[, q])} or KVScales): the k scale, which must be one number."""
        table = given.k if isinstance(given, KVScales) else {int(layer): v[0] for layer, v in given.items()}
        out = cls(source="given")
        for layer, s in table.items():
            t = torch.as_tensor(s, dtype=torch.float32).reshape(-1)
            if t.numel() != 1:
                raise UsageError(f"layer {layer}: an MLA layer has one latent scale, not {t.numel()}",
                                 option="kv_scales")
            out.k[int(layer)] = float(t)
        return out

    def scale(self, layer: int) -> float:
        return self.k.get(layer, 1.0)

    def __len__(self) -> int:
        return len(self.k)

    def describe(self) -> dict:
        vals = list(self.k.values())
        return {"source": self.source, "layers": len(self.k), "min_scale": min(vals) if vals else 1.0,
                "max_scale": max(vals) if vals else 1.0, "cache": "mla_latent",
                "cached": "kv_c_normed (after kv_a_layernorm, weight included) and the rotated k_pe, "
                          "one k_scale per layer"}


class Fp8Latent:
    """The hook for kvtool.runtime.kv_hooks.kv_hook on an MLA model: `latent` rounds the cached latent and rope
    key through the row's fp8 format (e4m3 unless given) with the layer's scale (what TRITON_MLA reads back)."""

    def __init__(self, scales: MLAScales, fmt: str = "float8_e4m3fn"):
        self.scales = scales
        self.fmt = fmt  # kvtool.eval.codecs.fp8.FORMATS: the row's format (fp8_e4m3 / fp8_e5m2)

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        raise RuntimeError("an MLA model caches no per-head K/V: kv_hook runs Fp8Latent.latent")

    def latent(self, layer: int, kv_c_normed: torch.Tensor, k_pe: torch.Tensor):
        s = self.scales.scale(layer)
        return fp8_roundtrip(kv_c_normed, s, self.fmt), fp8_roundtrip(k_pe, s, self.fmt)

    def describe(self) -> dict:
        return {"name": "cache-only", "vllm": "TRITON_MLA (decode_attention_fwd)",
                "where": "MLA: the latent cache, dequantized with k_scale to the query's dtype",
                "queries": "model dtype", "probabilities": "model dtype",
                "cited": [str(c) for c in CITED]}


def read_mla_scales(folder: str | Path) -> MLAScales:
    """The latent-cache scales vLLM's DeepSeek loader would take from a model folder (K_SCALE_NAMES)."""
    from safetensors import SafetensorError, safe_open

    from kvtool.eval.fp8 import _checked_scale
    from kvtool.io.weight_files import raise_first_error, scan_weights

    root = Path(folder)
    scan = scan_weights(root)
    raise_first_error(scan, root)
    from kvtool.eval.fp8 import _scale_params
    from kvtool.model.kv_scale_names import vllm_target

    out = MLAScales(source="checkpoint")
    rank: dict[int, int] = {}
    params = _scale_params(root, [n for h in scan.headers for n in h.tensors])  # the one answer to "which tensor does vLLM load as the layer's k_scale"
    for h in scan.headers:
        found = [(n, next((i for i, s in enumerate(K_SCALE_NAMES) if n.endswith("." + s)), len(K_SCALE_NAMES)),
                  t[0]) for n in h.tensors if (t := vllm_target(n, params)) is not None and t[1] == "k"]
        if not found:
            continue
        path = root / h.file
        try:
            with safe_open(str(path), framework="pt") as f:
                for name, i, prefix in found:
                    layer = layer_index(prefix)
                    if layer is None:
                        raise InputError("scale tensor name has no layer number", file=str(path), field=name)
                    t = _checked_scale(f.get_tensor(name), str(path), name)
                    if t.numel() != 1:
                        raise InputError(f"an MLA layer has one latent scale; this one has {t.numel()} values",
                                         file=str(path), field=name)
                    if rank.get(layer, len(K_SCALE_NAMES) + 1) > i:
                        out.k[layer], rank[layer] = float(t), i
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            raise InputError(f"cannot read KV scales: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}",
                             file=str(path)) from None
    return out
