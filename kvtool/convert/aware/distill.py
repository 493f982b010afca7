"""Optional end-to-end distillation after the per-layer merge (`--distill-steps`).

Adam on the converted layers' attention tensors against the original model's next-token distributions,
KL(original || converted) at every calibration position. Per-layer reconstruction matches each
attention output on its own; this matches what the whole stack predicts. What an attention layer holds and
how it runs is the `block`'s: `ProjBlock` (the merged q/k/v/o in transformers' own module, the aware merge) or
kvtool.convert.mla.train.MlaBlock (the MLA solve's tensors as the module's forward).

- Teacher: the original model's top-k log-probabilities at every position, with the rest of the mass as
  one more bin, from the original stream the calibration pass runs alongside (`teacher_targets`). The KL
  over these k + 1 bins is exact for that partition and a lower bound of the full KL.
- Student, streamed one decoder layer at a time: a forward that keeps each layer's input, the loss
  through the LM head, then a backward that recomputes one layer at a time from its kept input and
  updates that layer's projections (activation checkpointing per layer).

Memory in the steps: one decoder layer's weights, the kept layer inputs of one sequence (layers x tokens x
hidden), and one layer's projections with their Adam state; every layer's state waits on disk between uses.
The KL before and after runs all calibration sequences through one layer at a time, as the calibration does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from kvtool.convert.aware.attention import Proj
from kvtool.convert.aware.modules import install_proj, module_layout, read_proj, trainable_params
from kvtool.convert.aware.spill import LayerFiles
from kvtool.runtime.kv_hooks import attention_modules
from kvtool.runtime.layerwise import run_layer

if TYPE_CHECKING:
    from kvtool.runtime.layerwise import LayerwiseModel

TOP_K = 128  # teacher bins: SmolLM2's top 128 tokens hold ~0.9 of the mass on the calibration text
CHUNK = 256  # positions per LM-head pass (logits of 256 positions x a 262k vocabulary: 270 MB in float32)
BETAS, EPS = (0.9, 0.999), 1e-8


@dataclass
class Teacher:
    """The original model's next-token distributions on the calibration batch [n, T]: its top-k
    log-probabilities (logp) at token ids idx, [n, T, k], and the log of the remaining mass, [n, T]."""

    idx: torch.Tensor
    logp: torch.Tensor
    rest: torch.Tensor

    def at(self, row: int, positions: slice, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(idx, logp, rest) of one sequence's positions, on the device."""
        return tuple(t[row, positions].to(device) for t in (self.idx, self.logp, self.rest))


def _chunks(rows: list[int], length: int):
    """(j, row, positions) for each chunk of CHUNK positions of each row (j: the row's index in rows)."""
    for j, r in enumerate(rows):
        for a in range(0, length, CHUNK):
            yield j, r, slice(a, a + CHUNK)


def _binned(logp: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-probabilities at idx, log of the mass outside idx) of full log-probabilities [..., vocab]."""
    top = logp.gather(-1, idx)
    rest = logp.scatter(-1, idx, float("-inf")).logsumexp(-1)
    return top, rest


def teacher_targets(lm: "LayerwiseModel", hidden: torch.Tensor, k: int = TOP_K) -> Teacher:
    """Teacher bins from the hidden states leaving the original model's last layer, [n, T, hidden]."""
    n, T = hidden.shape[:2]
    idx = torch.empty(n, T, k, dtype=torch.long)
    logp = torch.empty(n, T, k)
    rest = torch.empty(n, T)
    with torch.no_grad(), lm.head():
        for _, r, at in _chunks(list(range(n)), T):
            full = torch.log_softmax(lm.logits_from_hidden(hidden[r:r + 1, at]).float(), -1)[0]
            kk = min(k, full.shape[-1])
            i = full.topk(kk, dim=-1).indices
            top, out = _binned(full, i)
            idx[r, at, :kk], logp[r, at, :kk], rest[r, at] = i.cpu(), top.cpu(), out.cpu()
            if kk < k:  # a vocabulary smaller than k: the extra bins are empty
                idx[r, at, kk:], logp[r, at, kk:] = i[:, :1].cpu(), float("-inf")
    return Teacher(idx, logp, rest)


def _kl(logits: torch.Tensor, t_idx: torch.Tensor, t_logp: torch.Tensor, t_rest: torch.Tensor) -> torch.Tensor:
    """Summed KL(teacher || student) over positions, on the teacher's bins; logits [P, vocab]."""
    s = torch.log_softmax(logits.float(), -1)
    s_top, s_rest = _binned(s, t_idx)
    p_top = t_logp.exp()
    term = torch.where(p_top > 0, p_top * (t_logp - s_top), torch.zeros_like(p_top)).sum(-1)
    p_rest = t_rest.exp()
    return (term + torch.where(p_rest > 0, p_rest * (t_rest - s_rest), torch.zeros_like(p_rest))).sum()


class ProjBlock:
    """A merged layer as the aware merge keeps it (Proj, the checkpoint's order), installed into transformers' own
    attention module (kvtool.convert.aware.modules)."""

    def __init__(self, num_heads: int) -> None:
        self.num_heads = num_heads

    def tensors(self, value: Proj) -> dict[str, torch.Tensor]:
        return value.tensors()

    def pack(self, tensors: dict[str, torch.Tensor]) -> Proj:
        return Proj.of(tensors)

    def install(self, module, tensors: dict[str, torch.Tensor], train: bool):
        lay = module_layout(module)
        install_proj(module, Proj.of(tensors), self.num_heads, lay)
        if train:
            for p in trainable_params(module, lay):
                p.requires_grad_(True)
        return lay

    def grads(self, module, installed) -> dict[str, torch.Tensor]:
        return read_proj(module, installed, grads=True).tensors()


class Distiller:
    """See the module docstring. get(layer): the layer's converted tensors as the block keeps them (ProjBlock: the
    merged projections in the checkpoint's order); block: ProjBlock(num_heads) unless given."""

    def __init__(self, lm: "LayerwiseModel", ids: torch.Tensor, teacher: Teacher, get: Callable[[int], object], *,
                 lr: float, num_heads: int | None = None, block=None,
                 on_progress: Callable[[str], None] | None = None) -> None:
        self.lm, self.ids, self.teacher, self.lr = lm, ids, teacher, lr
        self.block = block if block is not None else ProjBlock(int(num_heads))
        self.attn = {m.layer_idx: m for m in attention_modules(lm.model)}
        self.note = on_progress or (lambda s: None)
        self.store = LayerFiles("kvtool-distill-", "the distillation state of layer {layer}")
        self.t = 0
        for p in lm.model.parameters():
            p.requires_grad_(False)  # whole-model mode loads trainable parameters; only q/k/v/o are trained here
        try:
            self._start(get)
        except BaseException:
            self.store.close()
            raise

    def _start(self, get: Callable[[int], object]) -> None:
        for i in sorted(self.attn):
            state = {}
            for f, t in self.block.tensors(get(i)).items():  # the tensor, its Adam moments, its RMS (the step size's unit)
                state.update({f: t, f"{f}.m": torch.zeros_like(t), f"{f}.v": torch.zeros_like(t),
                              f"{f}.lr": t.pow(2).mean().sqrt().clamp_min(1e-8).reshape(1)})
            self.store.save(i, state)

    def projections(self, layer: int):
        """The layer's tensors now, as the block keeps them."""
        return self.block.pack(_own(self.store.load(layer)))

    def close(self) -> None:
        self.store.close()

    # --- passes ----------------------------------------------------------------------------------
    def _install(self, i: int, layer_state: dict | None = None, train: bool = False):
        mod = self.attn.get(i)
        if mod is None:
            return None, None
        state = layer_state if layer_state is not None else self.store.load(i, self.lm.device)
        return mod, self.block.install(mod, _own(state), train)

    def _forward(self, rows: torch.Tensor, keep: bool) -> tuple[torch.Tensor, list, list]:
        """Student hidden states leaving the last layer for ids[rows]; with keep, each layer's input."""
        h, calls = self.lm.capture(self.ids[rows])
        inputs = []
        with torch.no_grad():
            for i in range(self.lm.num_layers):
                with self.lm.materialised(i) as layer:
                    self._install(i)
                    if keep:
                        inputs.append(h)
                    h = run_layer(layer, h, calls[i])
                self.note(f"forward, layer {i + 1}/{self.lm.num_layers}")
        return h, calls, inputs

    def _loss(self, h: torch.Tensor, rows: torch.Tensor, backward: bool) -> tuple[float, torch.Tensor | None]:
        """Mean KL per position of the hidden states h [len(rows), T, hidden] through the LM head, chunk by
        chunk; with backward also its gradient in h."""
        positions = h.shape[0] * h.shape[1]
        grad = torch.zeros_like(h) if backward else None
        total = 0.0
        with self.lm.head():
            for j, r, at in _chunks(rows.tolist(), h.shape[1]):
                piece = h[j:j + 1, at].detach().requires_grad_(backward)
                with torch.set_grad_enabled(backward):
                    logits = self.lm.logits_from_hidden(piece, grad=backward)[0]
                    part = _kl(logits, *self.teacher.at(r, at, logits.device)) / positions
                    if backward:
                        part.backward()
                        grad[j:j + 1, at] = piece.grad
                total += float(part.detach())
        return total, grad

    def kl(self, rows: torch.Tensor | None = None) -> float:
        """Mean KL(original || converted) per position over the calibration sequences (all of them by default)."""
        rows = torch.arange(self.ids.shape[0]) if rows is None else rows
        return self._loss(self._forward(rows, keep=False)[0], rows, backward=False)[0]

    def step(self, rows: torch.Tensor) -> float:
        """One Adam step on ids[rows]; returns the loss (mean KL per position) before the step."""
        self.t += 1

        def update(i: int, state: dict, grads: dict[str, torch.Tensor]) -> None:
            self._adam(state, grads)
            self.store.save(i, state)

        return self.gradients(rows, update)

    def gradients(self, rows: torch.Tensor, visit: Callable[[int, dict, dict[str, torch.Tensor]], None]) -> float:
        """The loss (mean KL per position) on ids[rows] and its gradient: visit(layer, state, grads) for each
        attention layer, last layer first, while it is materialised (state: the layer's stored tensors)."""
        h, calls, inputs = self._forward(rows, keep=True)
        loss, grad = self._loss(h, rows, backward=True)
        for i in reversed(range(self.lm.num_layers)):
            with self.lm.materialised(i) as layer:
                state = self.store.load(i, self.lm.device) if i in self.attn else None
                mod, installed = self._install(i, state, train=True)
                x = inputs[i].detach().requires_grad_(True)
                with torch.enable_grad():
                    run_layer(layer, x, calls[i]).backward(grad)
                grad = x.grad
                inputs[i] = None
                if mod is not None:
                    visit(i, state, self.block.grads(mod, installed))
            self.note(f"backward, layer {i + 1}/{self.lm.num_layers}")
        return loss

    def _adam(self, state: dict[str, torch.Tensor], g: dict[str, torch.Tensor]) -> None:
        b1, b2 = BETAS
        for f in _own(state):
            grad = g.get(f)
            if grad is None:
                continue
            m, v = state[f"{f}.m"], state[f"{f}.v"]
            m.mul_(b1).add_(grad, alpha=1 - b1)
            v.mul_(b2).addcmul_(grad, grad, value=1 - b2)
            denom = (v / (1 - b2 ** self.t)).sqrt_().add_(EPS)  # in place: one temporary per tensor
            state[f].addcdiv_(m, denom, value=-self.lr * float(state[f"{f}.lr"]) / (1 - b1 ** self.t))


def _own(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The layer's tensors of a stored state, without their Adam moments and step units (NAME.m / .v / .lr)."""
    return {f: t for f, t in state.items() if f"{f}.m" in state}


def distill(lm: "LayerwiseModel", ids: torch.Tensor, teacher: Teacher, get: Callable[[int], object],
            put: Callable[[int, object], None], *, steps: int, lr: float, num_heads: int | None = None, block=None,
            on_note: Callable[[str], None] | None = None, on_step: Callable[[], None] | None = None) -> dict:
    """`steps` Adam steps, one calibration sequence each in turn, on the tensors get(layer) returns (block:
    Distiller's); put(layer, tensors) receives the result. The start is kept if the KL over all calibration
    sequences is not lower after. on_note(what): progress within a pass; on_step(): after each step.
    Returns what provenance records."""
    note = on_note or (lambda s: None)
    d = None
    try:
        d = Distiller(lm, ids, teacher, get, num_heads=num_heads, block=block, lr=lr,
                      on_progress=lambda s: note(f"measuring the start: {s}"))
        start = d.kl()
        losses = []
        for step in range(steps):
            d.note = lambda s, step=step: note(f"step {step + 1}/{steps}: {s}")
            losses.append(d.step(torch.tensor([step % ids.shape[0]])))
            if on_step is not None:
                on_step()
        d.note = lambda s: note(f"measuring the result: {s}")
        end = d.kl() if steps else start
        kept = end < start
        if kept:
            for i in sorted(d.attn):
                put(i, d.projections(i))
        return {"kl_start": start, "kl_end": end if kept else start, "kl_reached": end, "improved": kept,
                "step_losses": [round(x, 5) for x in losses]}
    finally:
        if d is not None:
            d.close()


def distill_with_progress(lm: "LayerwiseModel", ids: torch.Tensor, teacher: Teacher, get: Callable[[int], object],
                          put: Callable[[int, object], None], *, steps: int, lr: float, num_heads: int | None = None,
                          block=None) -> dict:
    """`distill` with a progress bar of its own on stderr (one unit per step: the calibration's has finished its
    layers); returns its record with the teacher's top_k, what kvtool.json keeps."""
    from kvtool import progress as kv_progress

    bar = kv_progress.task("distill", total=steps, unit="steps")
    try:
        out = distill(lm, ids, teacher, get, put, steps=steps, lr=lr, num_heads=num_heads, block=block,
                      on_note=bar.set_note, on_step=bar.update)
    finally:
        bar.close()
    return {"top_k": TOP_K, **out}
