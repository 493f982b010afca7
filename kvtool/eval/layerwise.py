"""Evaluation with one decoder layer's weights in memory at a time (kvtool.runtime.layerwise).

A forward path is one model run with or without FP8 KV emulation (a candidate that is the baseline's
checkpoint without emulation shares the baseline's path). Windows are taken in segments: each path
keeps the hidden states of the segment's windows, layer i's weights are read once per segment and
run on every path of that model over every window of the segment; then the model's own output
computation (final norm, LM head, softcapping: LayerwiseModel.logits_from_hidden) runs chunk by
chunk over the scored positions, the baseline's and each candidate's logits of one chunk side by
side (KL needs both), into the running sums (kvtool.eval.metrics). Nothing of the stream is kept.

Memory: one decoder layer or the LM head, the hidden states of one segment for every path, one
chunk of logits per path. Windows, batches and token order are those of the whole-model path, so
the figures equal it to float rounding (tests/eval/test_eval_layerwise.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

SEGMENT_BYTES = 512 * 2**20  # hidden states of all paths held at once; more windows -> more segments
CHUNK_ELEMENTS = 4 * 2**20  # logits of one chunk (positions x vocabulary) per path: 16 MiB in float32


class LayerwiseLoaded:
    """A model folder opened for layer-by-layer replay, with its tokenizer (the _Loaded of the whole path)."""

    def __init__(self, name: str, lm, tokenizer, folder: Path, config: dict):
        self.name, self.lm, self.tokenizer, self.folder, self.config = name, lm, tokenizer, folder, config
        self.model = lm.model  # kv_hook and the FP8 emulation read the module tree (no weights needed)

    def close(self) -> None:
        self.lm.close()


@dataclass
class ForwardPath:
    model: LayerwiseLoaded
    kv_fn: Callable | None  # FP8 round trip of K/V (kvtool.eval.fp8), or None
    hidden: list = field(default_factory=list)  # per batch of the current segment


@dataclass
class Scored:
    """One accumulator fed by a candidate path against an optional baseline path."""

    path: int
    base: int | None
    acc: Any


def segments(groups: list, hidden_size: int, paths: int, elem_bytes: int, budget: int | None = None) -> list[list]:
    """Consecutive batches whose hidden states, for every path, stay within `budget` (default
    SEGMENT_BYTES; at least one batch per segment)."""
    budget = SEGMENT_BYTES if budget is None else budget
    out: list[list] = []
    used = 0
    for g in groups:
        cost = len(g) * g[0].length * hidden_size * elem_bytes * paths
        if out and used + cost <= budget:
            out[-1].append(g)
            used += cost
        else:
            out.append([g])
            used = cost
    return out


def run(paths: list[ForwardPath], scored: list[Scored], segs: list[list], stream: torch.Tensor, bar,
        chunk_elements: int | None = None) -> None:
    """Every window of every segment through every path, scored into the accumulators (logits in chunks
    of chunk_elements, default CHUNK_ELEMENTS, per path)."""
    chunk_elements = CHUNK_ELEMENTS if chunk_elements is None else chunk_elements
    from kvtool.runtime.kv_hooks import kv_hook
    from kvtool.runtime.layerwise import release_free_memory, run_layer

    models = list({id(p.model): p.model for p in paths}.values())
    for seg in segs:
        batches = [torch.stack([stream[w.begin:w.end] for w in g]) for g in seg]
        for m in models:
            mine = [p for p in paths if p.model is m]
            captured = [m.lm.capture(b) for b in batches]
            for p in mine:
                p.hidden = [first for first, _ in captured]
            for i in range(m.lm.num_layers):
                with m.lm.materialised(i) as layer, torch.inference_mode():
                    for p in mine:
                        with (kv_hook(m.model, p.kv_fn) if p.kv_fn else contextlib.nullcontext()):
                            p.hidden = [run_layer(layer, h, calls[i]) for h, (_, calls) in zip(p.hidden, captured)]
                bar.set_note(f"{m.name}: layer {i + 1}/{m.lm.num_layers}")
            del captured
        with contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(m.lm.head())
            for b, (g, batch) in enumerate(zip(seg, batches)):
                _score_batch(paths, scored, b, g, batch, chunk_elements)
                bar.update(g[0].n_scored * len(g))
        for p in paths:
            p.hidden = []
        release_free_memory()


def _score_batch(paths, scored, b: int, group, batch: torch.Tensor, chunk_elements: int) -> None:
    keep, length = group[0].n_scored, group[0].length
    targets = batch[:, -keep:]
    first = length - keep - 1  # the hidden state at position t predicts token t + 1
    vocab = max(int(p.model.model.get_output_embeddings().weight.shape[0]) for p in paths)
    step = max(1, chunk_elements // (vocab * len(group)))
    with torch.inference_mode():
        for s in range(0, keep, step):
            cache: dict[int, torch.Tensor] = {}

            def logits(i: int) -> torch.Tensor:
                if i not in cache:
                    p = paths[i]
                    cache[i] = p.model.lm.logits_from_hidden(p.hidden[b][:, first + s:first + min(s + step, keep)])
                return cache[i]

            for sc in scored:
                sc.acc.add(logits(sc.path), targets[:, s:s + step], logits(sc.base) if sc.base is not None else None)
