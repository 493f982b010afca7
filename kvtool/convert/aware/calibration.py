"""Sequential calibration, layer by layer: each layer is merged from the converted stream's input.

kvtool.layerwise holds one decoder layer's weights at a time. For layer i: the original layer runs
on the original stream (when the merge wants it) and a forward pre-hook on its attention module
records the original attention input x_ref; then the layer runs on the converted stream, where the
pre-hook merges the layer from its attention input x (produced by the already-converted layers
before it) and installs the merged projections before the attention runs, so the layer's output
is the converted stream entering layer i + 1. Memory: one layer's weights and, per stream, one
layer's activations over the calibration batch.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from kvtool.convert.aware.attention import LayerInputs, Proj
from kvtool.errors import InputError, UsageError
from kvtool.kv_hooks import attention_modules
from kvtool.layerwise import release_free_memory, run_layer

if TYPE_CHECKING:
    from kvtool.layerwise import LayerwiseModel

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


def _attention_input(module, args, kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    x = kwargs.get("hidden_states", args[0] if args else None)
    pe = kwargs.get("position_embeddings")
    if pe is None and len(args) > 1:
        pe = args[1]
    if pe is None:
        raise UsageError(f"method 'aware' needs RoPE position embeddings passed to {type(module).__name__}"
                         " (use --method mean)", field="--method")
    return x, pe


@contextlib.contextmanager
def _pre_hook(module: nn.Module, fn) -> Iterator[None]:
    handle = module.register_forward_pre_hook(fn, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def run_layerwise(lm: "LayerwiseModel", ids: torch.Tensor, layer_fn: LayerFn, num_heads: int, *,
                  reference: bool = True) -> None:
    """Calibrate every attention layer of lm on ids [batch, seq]: layer_fn(layer, inputs, projections)
    -> merged projections, called in layer order. reference=False skips the original stream
    (then LayerInputs.x_ref and h_ref are None; one layer forward less per layer)."""
    attn = {m.layer_idx: m for m in attention_modules(lm.model)}
    if not attn:
        raise InputError(f"{type(lm.model).__name__}: no attention modules found", field="architectures")
    softcap = getattr(lm.model.config, "attn_logit_softcapping", None)
    with torch.no_grad():
        h, calls = lm.capture(ids)
        h_ref = h if reference else None
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer:
                module = attn.get(i)
                seen: dict = {}

                def record(mod, args, kwargs):
                    seen["x_ref"] = _attention_input(mod, args, kwargs)[0]

                def merge(mod, args, kwargs):
                    x, (cos, sin) = _attention_input(mod, args, kwargs)
                    inp = LayerInputs(x.detach(), cos.detach(), sin.detach(), float(mod.scaling),
                                      getattr(mod, "sliding_window", None), softcap,
                                      x_ref=seen.get("x_ref"), h=h, h_ref=h_ref)
                    new = layer_fn(i, inp, _proj_of(mod))
                    release_free_memory()  # the merge's temporaries (see kvtool.layerwise)
                    _install(mod, new, num_heads)
                    seen["merged"] = True

                if h_ref is not None:
                    with _pre_hook(module, record) if module is not None else contextlib.nullcontext():
                        h_ref_next = run_layer(layer, h_ref, calls[i])
                    release_free_memory()
                with _pre_hook(module, merge) if module is not None else contextlib.nullcontext():
                    h_next = run_layer(layer, h, calls[i])
                if module is not None and not seen.get("merged"):
                    raise InputError(f"layer {i}: the attention module was not called by its decoder layer",
                                     field="architectures")
            calls[i] = None  # this layer's mask / position embeddings are no longer needed
            h = h_next
            if h_ref is not None:
                h_ref = h_ref_next


def read_text(path: str | Path | None) -> tuple[str, str]:
    """(text, label) from --calib-text, or kvtool's built-in English calibration text."""
    if path is None:
        from kvtool.testing.text import calibration_text

        return calibration_text(), "builtin:pydoc_data.topics (calibration part)"
    from kvtool.eval.texts import read_text_file

    return read_text_file(str(path), "--calib-text"), str(Path(path))
