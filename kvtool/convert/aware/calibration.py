"""Sequential calibration, layer by layer: each layer is merged from the converted stream's input.

kvtool.runtime.layerwise holds one decoder layer's weights at a time. Layer i runs on the hidden states the
already-converted layers before it produced; a forward pre-hook on its attention module merges the
layer from its attention input x and installs the merged projections before the attention runs,
so the layer's output is the converted stream entering layer i + 1. Memory: one layer's weights
and one layer's activations over the calibration batch.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch
from torch import nn

from kvtool.convert.aware.attention import LayerInputs, Proj
from kvtool.convert.aware.modules import (attention_scale, install_proj, module_layout, read_proj, reorder_qk,
                                          rope_order)
from kvtool.errors import InputError, UsageError
from kvtool.runtime.kv_hooks import attention_modules
from kvtool.runtime.layerwise import release_free_memory, run_layer

if TYPE_CHECKING:
    from kvtool.runtime.layerwise import LayerwiseModel

LayerFn = Callable[[int, LayerInputs, Proj], Proj]


def calibration_ids(tokenizer, text, tokens: int, seq_len: int, source: str, used: list | None = None) -> torch.Tensor:
    """First `tokens` tokens of text (a str, a kvtool.tokenstream.TextFile or a list of them, joined) as
    [tokens // seq_len, seq_len] (whole sequences only); only the text they need is read and tokenized.
    used: gets the kvtool.tokenstream.Tokens (the used text's sha256)."""
    from kvtool.tokenstream import first_tokens

    got = first_tokens(tokenizer, text if isinstance(text, list) else [text], tokens)
    if used is not None:
        used.append(got)
    ids = got.ids.tolist()
    seq_len = min(seq_len, tokens)
    if len(ids) < seq_len or seq_len < 2:
        raise UsageError(f"calibration text has {len(ids)} tokens; at least {max(seq_len, 2)} are needed",
                         option="calib_text", file=source)
    n = min(tokens, len(ids)) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).reshape(n, seq_len)


def _attention_input(module, args, kwargs) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
    x = kwargs.get("hidden_states", args[0] if args else None)
    pe = kwargs.get("position_embeddings")
    if pe is None and len(args) > 1:
        pe = args[1]
    if pe is None:
        raise UsageError(f"method 'aware' needs RoPE position embeddings passed to {type(module).__name__}"
                         " (use --method mean)", option="method")
    if not (isinstance(pe, (tuple, list)) and len(pe) == 2 and not any(t.is_complex() for t in pe)):
        # llama4 passes one complex tensor (freqs_cis): unpacking it would split the batch, not cos / sin
        raise UsageError(f"method 'aware' needs RoPE as (cos, sin); {type(module).__name__} receives "
                         f"{type(pe).__name__} (use --method mean)", option="method")
    return x, pe


@contextlib.contextmanager
def _pre_hook(module: nn.Module, fn) -> Iterator[None]:
    handle = module.register_forward_pre_hook(fn, with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def run_layerwise(lm: "LayerwiseModel", ids: torch.Tensor, layer_fn: LayerFn, num_heads: int, *,
                  on_merged: Callable[[int, Proj], None] | None = None,
                  keep_original: bool = False, target_original: bool = False) -> torch.Tensor | None:
    """Calibrate every attention layer of lm on ids [batch, seq]: layer_fn(layer, inputs, projections)
    -> merged projections, called in layer order.

    layer_fn sees the rotate_half RoPE order the merge assumes; for a model with another RoPE pair
    order (the table's attention.rope_layout, e.g. cohere's interleaved pairs) the q/k rows and cos/sin
    it gets are reordered, so its result is not in the checkpoint's order: on_merged(layer, projections)
    receives every layer's result in the checkpoint's order, and is required for such models.

    keep_original: the original model also runs, each layer on its own stream before the layer is
    merged (one more layer pass each); returns the hidden states leaving its last layer (else None).
    target_original: the same pass, and each layer's inputs carry x_target, the original stream's input to it."""
    attn = {m.layer_idx: m for m in attention_modules(lm.model)}
    if not attn:
        raise InputError(f"{type(lm.model).__name__}: no attention modules found", field="architectures")
    softcap = getattr(lm.model.config, "attn_logit_softcapping", None)
    with torch.no_grad():
        h, calls = lm.capture(ids)
        h_orig = h if keep_original or target_original else None  # the original model's own stream
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer:
                module = attn.get(i)
                seen: dict = {}
                if h_orig is not None:
                    def grab(mod, args, kwargs):  # the original layer's attention input
                        seen["x_orig"] = _attention_input(mod, args, kwargs)[0].detach()

                    hooked = target_original and module is not None
                    with _pre_hook(module, grab) if hooked else contextlib.nullcontext():
                        h_orig = run_layer(layer, h_orig, calls[i])  # before the pre-hook below merges it

                def merge(mod, args, kwargs):
                    x, (cos, sin) = _attention_input(mod, args, kwargs)
                    lay = module_layout(mod)
                    src = read_proj(mod, lay)
                    order = rope_order(lay, cos.shape[-1])
                    if order is not None:
                        if on_merged is None:
                            raise UsageError(f"method 'aware': {lay.model_type} has {lay.rope_layout} RoPE; the "
                                             "calibration needs on_merged to return merged layers in its order",
                                             option="method")
                        rot = order[: cos.shape[-1]].to(cos.device)
                        cos, sin, src = cos[..., rot], sin[..., rot], reorder_qk(src, order, lay.head_dim)
                    inp = LayerInputs(x.detach(), cos.detach(), sin.detach(), attention_scale(mod),
                                      getattr(mod, "sliding_window", None), softcap,
                                      seen.pop("x_orig", None))
                    new = layer_fn(i, inp, src)
                    release_free_memory()  # the merge's temporaries (see kvtool.runtime.layerwise)
                    if order is not None:
                        new = reorder_qk(new, torch.argsort(order), lay.head_dim)
                    if on_merged is not None:
                        on_merged(i, new)
                    install_proj(mod, new, num_heads, lay)
                    seen["merged"] = True

                with _pre_hook(module, merge) if module is not None else contextlib.nullcontext():
                    h_next = run_layer(layer, h, calls[i])
                if module is not None and not seen.get("merged"):
                    raise InputError(f"layer {i}: the attention module was not called by its decoder layer",
                                     field="architectures")
            calls[i] = None  # this layer's mask / position embeddings are no longer needed
            h = h_next
    return h_orig if keep_original else None


@dataclass(frozen=True)
class Source:
    """One part of the calibration set: a text (a str, or files read as far as they are used: a
    kvtool.tokenstream.TextFile or a list of them, joined), or (text None) what the model writes itself."""

    text: object
    label: str


def calibration_sources(path, dataset: str | None) -> list[Source]:
    """--calib-text (a path; a recipe's several files: a list of paths, one text joined by blank lines), else
    the parts of the --calib-dataset (AwareMerge has resolved its default)."""
    if isinstance(path, (list, tuple)):
        from kvtool.datasets import text_file

        return [Source([text_file(str(f), "calib_text") for f in path], ", ".join(map(str, path)))]
    if path is not None:
        text, label = read_text(path)
        return [Source(text, label)]
    from kvtool.datasets import MODEL_WRITTEN, calibration_parts, source_text

    return [Source(None, "written by the model itself (kvtool.convert.aware.selftext)") if part == MODEL_WRITTEN
            else Source(*source_text(part)) for part in calibration_parts(dataset)]


def calibration_shares(k: int, tokens: int, seq_len: int) -> list[int]:
    """Sequences each of k sources gives: equal shares of tokens // seq_len, the first ones get the remainder."""
    rows = max(1, tokens // max(min(seq_len, tokens), 1))
    return [rows // k + (1 if i < rows % k else 0) for i in range(k)]


def calibration_batch(tokenizer, sources: list[Source], tokens: int, seq_len: int,
                      write: Callable[[int, int], torch.Tensor], used: list | None = None) -> torch.Tensor:
    """[n, seq_len] ids, the sources in equal shares of whole sequences (the first ones get the remainder),
    interleaved (`interleave`). A text source gives its first tokens (calibration_ids; `used` gets their
    kvtool.tokenstream.Tokens); write(rows, seq_len) the model-written ones."""
    seq_len = min(seq_len, tokens)
    parts = []
    for src, n in zip(sources, calibration_shares(len(sources), tokens, seq_len)):
        if n == 0:
            continue
        if src.text is None:
            parts.append(write(n, seq_len))
        else:
            parts.append(calibration_ids(tokenizer, src.text, n * seq_len, seq_len, src.label, used))
    return interleave(parts)


def interleave(parts: list[torch.Tensor]) -> torch.Tensor:
    """The rows of parts [n_i, T] in turn, one of each part while it has rows left (a, b, c, a, b, ...).

    Refinement and distillation step through the sequences in order: in blocks of one source, a run of steps
    fits one genre. Measured on SmolLM2 MQA with 64 refinement steps on 16384 tokens (docs/convert-quality.md):
    licences 2.73x / fortunes 1.84x interleaved, 3.63x / 2.25x in blocks. Covariances and least-squares fits do
    not depend on the order, so the closed-form merge does not change."""
    rows = [p[i] for i in range(max((len(p) for p in parts), default=0)) for p in parts if i < len(p)]
    return torch.stack(rows)


def read_text(path, dataset: str | None = None) -> tuple:
    """(text, label) from --calib-text (a kvtool.tokenstream.TextFile, read later as far as it is used), else the
    --calib-dataset joined (default: the built-in pydoc calibration part)."""
    if path is None:
        from kvtool.datasets import calibration_texts

        texts, label = calibration_texts(dataset)
        return "\n\n".join(texts), label
    from kvtool.datasets import text_file

    return text_file(str(path), "calib_text"), str(Path(path))


def text_sha256(used: list) -> str:
    """sha256 of the calibration text used: of one source's text, or of the sources' sha256s in order."""
    import hashlib

    if len(used) == 1:
        return used[0].sha256
    return hashlib.sha256(" ".join(t.sha256 for t in used).encode()).hexdigest()
