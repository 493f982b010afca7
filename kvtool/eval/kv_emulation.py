"""The KV-cache emulation hook: a --kv-cache-dtype's row of kvtool/model/kv_emulations.json applied to K and V.

`build(name, scales, num_layers)` returns fn(layer, key, value) for kvtool.runtime.kv_hooks.kv_hook: each
layer's K and V go through the row's codec (kvtool.eval.codecs) with the layer's checkpoint scale when the row
says vLLM loads them (`scales: checkpoint`), else none; vLLM's boundary layers (the dtype's kv_dtypes.json
`boundary_layers`: the first and last N attention layers) stay in the model dtype. Every token's K/V is read
back from the cache before attention reads it, the current token's own included: what decoding reads.
"""

from __future__ import annotations

import torch

from kvtool.eval import codecs
from kvtool.model import kv_dtypes, kv_emulations, kvcache


def row(name: str) -> kv_emulations.Emulation:
    """The emulation row of a --kv-cache-dtype, its codec checked against the registry (KeyError if none)."""
    r = kv_emulations.get(name)
    if r is None:
        raise KeyError(f"kvtool eval does not emulate kv_cache_dtype {name!r}; it emulates "
                       f"{', '.join(kv_emulations.names())}")
    if r.codec not in codecs.CODECS:
        raise KeyError(f"kv_emulations.json: emulations.{name}.codec: {r.codec!r} is not in kvtool.eval.codecs")
    return r


def kept_layers(name: str, layer_types) -> frozenset[int]:
    """The layers vLLM keeps in the model dtype for this dtype (kvtool.model.kvcache.boundary_skip, what kv-budget
    sizes); layer_types: the model's (ModelSpec.layer_types), or a number of attention layers."""
    d = kv_dtypes.get(name)
    if d is None:
        return frozenset()
    return kvcache.boundary_skip(d, ["full_attention"] * layer_types if isinstance(layer_types, int) else layer_types)


class KvEmulation:
    """fn(layer, key, value) -> (key, value) as vLLM's cache of the row's dtype returns them."""

    def __init__(self, name: str, scales=None, num_layers=0, model: dict | None = None):
        self.emulation = row(name)
        self.codec = codecs.get(self.emulation.codec)
        self.dtype_row = kv_dtypes.get(self.emulation.alias_of or name)
        self.kept_layers = kept_layers(name, num_layers)
        # a param the row leaves null is the model's (MODEL_PARAMS), filled from `model` (null when unknown)
        self.params = {k: (model or {}).get(k) if v is None else v for k, v in self.emulation.params.items()}
        self.scales = scales if self.emulation.scales == "checkpoint" else None

    def __call__(self, layer: int, key: torch.Tensor, value: torch.Tensor):
        if layer in self.kept_layers:
            return key, value
        ks = self.scales.k.get(layer) if self.scales is not None else None
        vs = self.scales.v.get(layer) if self.scales is not None else None
        return (self.codec(key, role="k", params=self.params, row=self.dtype_row, scale=ks),
                self.codec(value, role="v", params=self.params, row=self.dtype_row, scale=vs))


# the params a row of kv_emulations.json may leave null for the model to fill, and what fills them
MODEL_PARAMS = {"rope_dim": "the model's rotary dims (ModelSpec.rotary_dim; Octave codes them at 4 bits)"}


def model_params(spec) -> dict:
    """MODEL_PARAMS of a kvtool.model.spec.ModelSpec."""
    return {"rope_dim": spec.rotary_dim}


def build(name: str, scales=None, num_layers=0, model: dict | None = None) -> KvEmulation:
    """The hook of `name`. scales: a kvtool.eval.fp8.KVScales (its k / v tensors per layer, shape [] or
    [kv_heads]) or None (1.0); num_layers: the model's attention layers, or its ModelSpec.layer_types (for the
    boundary layers); model: MODEL_PARAMS' values for this model (`model_params(spec)`)."""
    return KvEmulation(name, scales, num_layers, model)
