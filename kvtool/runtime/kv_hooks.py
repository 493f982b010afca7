"""One hook on transformers' attention interface: K and V exactly where they enter the KV cache.

transformers hands every attention implementation the key/value states after RoPE (and after any
per-head k_norm), before GQA repetition, shaped [batch, kv_heads, seq, head_dim]. kvtool registers
a wrapping implementation `kvtool_<base>` that calls a per-layer function on them and then runs
the base implementation (sdpa or eager) unchanged. FP8 KV emulation (eval) and scale calibration
(quantize-kv) both use this one hook. A function with a `query` attribute (fn.query(layer, query, key)
-> query) also sees the query (post-RoPE, [batch, heads, seq, head_dim]); one with an `attention`
attribute runs that instead of the base implementation (kvtool.eval.fp8.Fp8Attention).

MLA (DeepSeek layout) caches no K/V: a function with a `latent` attribute (fn.latent(layer, kv_c_normed, k_pe)
-> (kv_c_normed, k_pe), kvtool.eval.fp8_mla.Fp8Latent) sees what vLLM caches instead, the latent after
kv_a_layernorm (weight included) and the rotated shared rope key, both [batch, 1, seq, dims]: the arguments of
transformers' `expand_kv`, which decompresses them into per-head K/V (`latent_hook`).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Callable, Iterator

import torch

KVFn = Callable[[int, torch.Tensor, torch.Tensor], "tuple[torch.Tensor, torch.Tensor]"]
_PREFIX = "kvtool_"
_registered: set[str] = set()


def _base_function(module, base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":
        # each modeling file has its own eager path (softcapping, sinks): use the module's
        return sys.modules[type(module).__module__].eager_attention_forward
    return ALL_ATTENTION_FUNCTIONS[base]


def _make_impl(base: str):
    def attention(module, query, key, value, attention_mask, **kwargs):
        fn = getattr(module, "_kvtool_kv_fn", None)
        impl = None
        if fn is not None:
            key, value = fn(module.layer_idx, key, value)
            q_fn = getattr(fn, "query", None)  # FP8 attention: the query as the backend rounds it
            if q_fn is not None:
                query = q_fn(module.layer_idx, query, key)
            impl = getattr(fn, "attention", None)  # FP8 attention: the backend's own arithmetic
        impl = impl or _base_function(module, base)
        return impl(module, query, key, value, attention_mask, **kwargs)

    return attention


def _register(base: str) -> str:
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    name = _PREFIX + base
    if name not in _registered:
        AttentionInterface.register(name, _make_impl(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
        _registered.add(name)
    return name


def attention_modules(model) -> list:
    """The modules that call the attention interface (they carry layer_idx)."""
    return [m for m in model.modules()
            if type(m).__name__.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int)]


def mla_modules(model) -> list:
    """The MLA attention modules: transformers' DeepseekV2/V3Attention (expand_kv decompresses the cached
    latent and rope key into per-head K/V)."""
    return [m for m in attention_modules(model) if callable(getattr(m, "expand_kv", None))
            and hasattr(m, "kv_a_layernorm")]


@contextlib.contextmanager
def latent_hook(model, fn) -> Iterator[None]:
    """Within the block, fn(layer_idx, kv_c_normed, k_pe) -> (kv_c_normed, k_pe) runs on each MLA layer's
    cached tensors, where transformers' forward hands them to expand_kv (after its cache update)."""
    mods = mla_modules(model)
    if not mods:
        raise RuntimeError(f"{type(model).__name__}: no MLA attention modules (expand_kv) found")
    if any("expand_kv" in vars(m) for m in mods):
        raise RuntimeError("latent_hook is already active on this model")

    def wrap(base, layer: int):
        def expand_kv(kv_nope, k_rot):
            return base(*fn(layer, kv_nope, k_rot))
        return expand_kv

    for m in mods:
        m.expand_kv = wrap(m.expand_kv, m.layer_idx)  # an instance attribute over the class's method
    try:
        yield
    finally:
        for m in mods:
            vars(m).pop("expand_kv", None)


@contextlib.contextmanager
def kv_hook(model, fn: KVFn) -> Iterator[None]:
    """Within the block, fn(layer_idx, key, value) -> (key, value) runs in every attention layer; a fn with a
    `latent` attribute runs that on MLA's cached latent instead (latent_hook)."""
    latent = getattr(fn, "latent", None)
    if latent is not None:
        with latent_hook(model, latent):
            yield
        return
    config = model.config
    base = config._attn_implementation or "sdpa"
    if base.startswith(_PREFIX):
        raise RuntimeError("kv_hook is already active on this model")
    if base not in ("sdpa", "eager"):
        base = "sdpa"  # flash/flex kernels: emulate on sdpa, which takes the same inputs
    mods = attention_modules(model)
    if not mods:
        raise RuntimeError(f"{type(model).__name__}: no attention modules with layer_idx found")
    previous = config._attn_implementation
    config._attn_implementation = _register(base)
    for m in mods:
        m._kvtool_kv_fn = fn
    try:
        yield
    finally:
        config._attn_implementation = previous
        for m in mods:
            m._kvtool_kv_fn = None
