"""The KV-cache codecs `kvtool eval` emulates vLLM's KV-cache dtypes with: name -> "module:function".

A row of kvtool/model/kv_emulations.json names its codec here; the function is imported on first use (torch
lives only inside the codec modules). Every codec has one signature:

    roundtrip(x, *, role, params, row, scale) -> tensor

x: K or V of one layer as transformers hands it to attention, [batch, kv_heads, seq, head_dim], model dtype,
post-RoPE (MLA codecs: role "latent" or "rope", [batch, 1, seq, dims]); role: "k" | "v" | "latent" | "rope";
params: the row's `params`; row: the kv_dtypes.json row (kvtool.model.kv_dtypes.KvDtype); scale: the layer's
checkpoint scale for that role (shape [] or [kv_heads]) when the row's `scales` is "checkpoint", else None.
It returns what vLLM's attention reads back from its cache: x's shape and dtype, dequantized, each batch row
independently of the others.
"""

from __future__ import annotations

import importlib
from typing import Callable

CODECS: dict[str, str] = {
    "fp8": "kvtool.eval.codecs.fp8:roundtrip",
    "nvfp4": "kvtool.eval.codecs.nvfp4:roundtrip",
    "fp8_ds_mla": "kvtool.eval.codecs.ds_mla:roundtrip",
    "nvfp4_ds_mla": "kvtool.eval.codecs.ds_mla:roundtrip_nvfp4",
    "per_token_head": "kvtool.eval.codecs.per_token_head:roundtrip",
    "int4_per_token_head": "kvtool.eval.codecs.per_token_head:roundtrip_int4",
    "turboquant": "kvtool.eval.codecs.turboquant:roundtrip",
    "ultraquant": "kvtool.eval.codecs.ultraquant:roundtrip",
    "octave": "kvtool.eval.codecs.octave:roundtrip",
}

_loaded: dict[str, Callable] = {}


def names() -> tuple[str, ...]:
    return tuple(CODECS)


def get(name: str) -> Callable:
    """The codec's roundtrip function (imported when first asked for). An unknown name is a KeyError naming
    the codecs there are."""
    if name not in _loaded:
        if name not in CODECS:
            raise KeyError(f"no KV codec {name!r}; known: {', '.join(CODECS)}")
        module, function = CODECS[name].split(":")
        _loaded[name] = getattr(importlib.import_module(module), function)
    return _loaded[name]
