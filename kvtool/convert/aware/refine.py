"""Optional block reconstruction: a few Adam steps on the converted attention tensors of one layer.

The loss is the normalised squared error between the converted layer's attention output and the
original layer's, both on the same calibration inputs; it starts from the closed-form solve, so a
handful of steps only polish it. Step sizes are relative to each tensor's RMS (scale-free).
`refine_tensors` takes any block (a forward of its tensors: the MLA solve's, kvtool.convert.mla.refine);
`refine` is it for the merged q/k/v/o of transformers' attention (kvtool.convert.aware.attention).
"""

from __future__ import annotations

import torch

from typing import Callable

from kvtool.convert.aware.attention import LayerInputs, Proj, attention_output


def refine(inp: LayerInputs, start: Proj, target: torch.Tensor, *, num_heads: int, head_dim: int, steps: int,
           lr: float = 5e-3, batch: int = 1, holdout_every: int = 0, check_every: int = 8, reg: float = 0.0,
           on_step: Callable[[], None] | None = None, stats: dict | None = None) -> tuple[Proj, float, float]:
    """Returns (refined projections, loss before, loss after on all calibration sequences).
    on_step(): called after each optimizer step (progress).

    lr is relative to each tensor's RMS: 5e-3 was best of 3e-3 / 5e-3 / 1e-2 / 2e-2-cosine on SmolLM2 MQA with
    64 steps (1.95x / 1.89x / 1.94x / 2.21x) for the layer's own target; the original stream's target takes larger
    steps (kvtool/convert/aware/method.py). The other arguments: `refine_tensors`.
    """
    inp32 = LayerInputs(inp.x.to(torch.float32), inp.cos, inp.sin, inp.scaling, inp.sliding_window, inp.softcap)
    n = inp32.x.shape[0]

    def forward(ps: dict[str, torch.Tensor], rows) -> torch.Tensor:
        # cos/sin often have batch 1 (shared positions): slice them only when they are per sequence
        cos, sin = (t[rows] if t.shape[0] == n else t for t in (inp32.cos, inp32.sin))
        part = LayerInputs(inp32.x[rows], cos, sin, inp.scaling, inp.sliding_window, inp.softcap)
        return attention_output(part, Proj.of(ps), num_heads, head_dim)

    best, first, last = refine_tensors(start.tensors(), forward, target, steps=steps, lr=lr, batch=batch,
                                       holdout_every=holdout_every, check_every=check_every, reg=reg,
                                       on_step=on_step, stats=stats)
    return (start if best is None else Proj.of(best)), first, last


def refine_tensors(start: dict[str, torch.Tensor], forward: Callable[[dict[str, torch.Tensor], torch.Tensor],
                                                                     torch.Tensor],
                   target: torch.Tensor, *, steps: int, lr: float = 5e-3, batch: int = 1, holdout_every: int = 0,
                   check_every: int = 8, reg: float = 0.0, on_step: Callable[[], None] | None = None,
                   stats: dict | None = None) -> tuple[dict[str, torch.Tensor] | None, float, float]:
    """Adam on the tensors `start` (name -> tensor) of any attention block: forward(tensors, rows) is the block's
    output on calibration sequences `rows` (a LongTensor of indices into target's first axis), target [n, T, hidden]
    what it should give. Returns (refined float32 tensors, or None when the start was kept; loss before; loss after
    on all calibration sequences). The loss is the squared error over target's mean square.

    Each step uses `batch` calibration sequences in turn (cheap steps on CPU); the start is kept if refinement made
    the full calibration loss worse. Each tensor's step is lr times its RMS (scale-free).

    holdout_every k > 1 (and at least k sequences): every k-th sequence is held out of the steps, its loss
    is measured every check_every steps, and the tensors of the best check (the start included) are
    returned: refinement stops where it starts fitting what the held-out sequences do not share. stats
    (when given) receives best_step, holdout_start and holdout_best.

    reg > 0 adds reg * sum over the tensors of ||p - p_start||^2 / ||p_start||^2 to each step's loss: a pull
    toward the closed-form start, which uses only second moments of the calibration text.
    """
    params = {f: t.detach().to(torch.float32).clone().requires_grad_(True) for f, t in start.items()}
    groups = [{"params": [t], "lr": lr * float(t.detach().pow(2).mean().sqrt().clamp_min(1e-8))}
              for t in params.values()]
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    target = target.to(torch.float32)
    denom = target.pow(2).mean().clamp_min(1e-30)

    n = target.shape[0]
    held = list(range(holdout_every - 1, n, holdout_every)) if holdout_every > 1 and n >= holdout_every else []
    train = [i for i in range(n) if i not in held]
    everything = torch.arange(n)

    def loss_of(ps, rows=everything):
        return (forward(ps, rows) - target[rows]).pow(2).mean() / denom

    def held_loss() -> float:
        with torch.no_grad():
            return float(loss_of(params, torch.tensor(held)))

    with torch.no_grad():
        first = float(loss_of(params))
    best_step, best_held = 0, held_loss() if held else None
    start_held = best_held
    best = {f: t.detach().clone() for f, t in params.items()}
    anchor = {f: t.detach().clone() for f, t in params.items()}
    scale = {f: t.pow(2).sum().clamp_min(1e-30) for f, t in anchor.items()}
    with torch.enable_grad():
        for step in range(steps):
            j = (step * batch) % len(train)
            rows = torch.tensor([train[(j + b) % len(train)] for b in range(min(batch, len(train)))])
            opt.zero_grad(set_to_none=True)
            loss = loss_of(params, rows)
            if reg:
                loss = loss + reg * sum((params[f] - anchor[f]).pow(2).sum() / scale[f] for f in params)
            loss.backward()
            opt.step()
            if on_step is not None:
                on_step()
            if held and ((step + 1) % check_every == 0 or step + 1 == steps):
                h = held_loss()
                if h < best_held:
                    best_step, best_held = step + 1, h
                    best = {f: t.detach().clone() for f, t in params.items()}
    if not held:
        best_step, best = steps, {f: t.detach() for f, t in params.items()}
    if stats is not None:
        stats.update(best_step=best_step, holdout_start=start_held, holdout_best=best_held)
    with torch.no_grad():
        last = float(loss_of(best))
    if last >= first or best_step == 0:
        return None, first, first
    return best, first, last
