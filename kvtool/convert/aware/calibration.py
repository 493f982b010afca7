"""Sequential calibration: one forward pass over the calibration batch, converting as it goes.

A forward pre-hook on every attention module receives that layer's input, which was produced by
the already-converted layers before it; the hook merges the layer from it and installs the merged
projections in the module before the module runs, so the next layer sees converted inputs. Only
one layer's activations (plus the residual stream) are alive at a time; the source model itself is
loaded once with transformers (safetensors are memory-mapped).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch
from torch import nn

from kvtool.convert.aware.attention import LayerInputs, Proj
from kvtool.errors import InputError, UsageError
from kvtool.kv_hooks import attention_modules

LayerFn = Callable[[int, LayerInputs, Proj], Proj]


def calibration_ids(tokenizer, text: str, tokens: int, seq_len: int, source: str) -> torch.Tensor:
    """First `tokens` tokens of text as [tokens // seq_len, seq_len] (whole sequences only)."""
    # a prefix is enough (tokenizing a whole book to use 2k tokens is slow); the whole text if it falls short
    ids = tokenizer(text[: tokens * 16], add_special_tokens=False)["input_ids"]
    if len(ids) < tokens and len(text) > tokens * 16:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    seq_len = min(seq_len, tokens)
    if len(ids) < seq_len or seq_len < 2:
        raise UsageError(f"calibration text has {len(ids)} tokens; at least {max(seq_len, 2)} are needed",
                         field="--calib-text", file=source)
    n = min(tokens, len(ids)) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def _proj_of(module: nn.Module) -> Proj:
    def lin(name):
        m = getattr(module, name, None)
        if not isinstance(m, nn.Linear):
            raise UsageError(f"method 'aware' needs separate q/k/v/o projections; {type(module).__name__} has no "
                             f"{name} (use --method mean)", field="--method")
        return m

    q, k, v, o = (lin(n) for n in ("q_proj", "k_proj", "v_proj", "o_proj"))
    return Proj(q.weight.detach(), k.weight.detach(), v.weight.detach(), o.weight.detach(),
                *(None if m.bias is None else m.bias.detach() for m in (q, k, v, o)))


def _install(module: nn.Module, p: Proj, num_heads: int) -> None:
    """Put merged projections into the live module (k/v get fewer rows)."""
    for name, w, b in (("q_proj", p.q, p.q_bias), ("k_proj", p.k, p.k_bias), ("v_proj", p.v, p.v_bias),
                       ("o_proj", p.o, p.o_bias)):
        old = getattr(module, name)
        lin = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, device=old.weight.device, dtype=old.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(w)
            if b is not None:
                lin.bias.copy_(b)
        setattr(module, name, lin)
    kv = p.k.shape[0] // module.head_dim
    module.num_key_value_groups = num_heads // kv


def run_sequential(model, ids: torch.Tensor, layer_fn: LayerFn, num_heads: int) -> None:
    """Forward ids through model; layer_fn(layer, inputs, projections) -> merged projections, per layer."""
    mods = attention_modules(model)
    if not mods:
        raise InputError(f"{type(model).__name__}: no attention modules found", field="architectures")
    softcap = getattr(model.config, "attn_logit_softcapping", None)

    def hook(module, args, kwargs):
        x = kwargs.get("hidden_states", args[0] if args else None)
        pe = kwargs.get("position_embeddings")
        if pe is None and len(args) > 1:
            pe = args[1]
        if pe is None:
            raise UsageError(f"method 'aware' needs RoPE position embeddings passed to {type(module).__name__}"
                             " (use --method mean)", field="--method")
        cos, sin = pe
        inp = LayerInputs(x.detach(), cos.detach(), sin.detach(), float(module.scaling),
                          getattr(module, "sliding_window", None), softcap)
        new = layer_fn(module.layer_idx, inp, _proj_of(module))
        _install(module, new, num_heads)
        return None

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mods]
    try:
        with torch.no_grad():
            # the decoder only: the LM head's logits over the whole batch are not needed
            model.base_model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, label) from --calib-text, or kvtool's built-in English calibration text."""
    if path is None:
        from kvtool.testing.text import calibration_text

        return calibration_text(), "builtin:pydoc_data.topics (calibration part)"
    from kvtool.eval.texts import read_text_file

    return read_text_file(str(path), "--calib-text"), str(Path(path))
