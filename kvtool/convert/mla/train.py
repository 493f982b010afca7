"""`--refine-steps` and `--distill-steps` for `--to mla`: the aware merge's two trainings on the solved MLA blocks.

- Refinement (kvtool.convert.aware.refine.refine_tensors): Adam on one layer's five MLA tensors against the
  source attention output on the converted stream (MlaStats.target, the aware merge's `layer` target), from
  the training-free solve; then o_proj refitted on every calibration token, as the aware merge does after
  its refinement.
- Distillation (kvtool.convert.aware.distill): KL to the source model's next-token distributions through the
  whole stack. The source model runs with each attention module's forward replaced by the solved block
  (`MlaBlock`, solve.mla_output), so only attention changes, as in the written checkpoint.

After either, `renormalise` gives each cached latent dimension unit RMS on the calibration again (the
FP8-friendly gain of solve.cached_gain; the model is unchanged by it).
"""

from __future__ import annotations

from typing import Callable

import torch

from kvtool.convert.aware.refine import refine_tensors
from kvtool.convert.aware.values import refit_o
from kvtool.convert.mla.rope import SourceRope
from kvtool.convert.mla.shape import MlaShape
from kvtool.convert.mla.solve import cached_gain, latent_of, mla_contexts, mla_output
from kvtool.convert.mla.stats import MlaStats


def refine_layer(tensors: dict[str, torch.Tensor], stats: MlaStats, shape: MlaShape, rope: SourceRope, *,
                 steps: int, lr: float, norm: str = "constant", o_ridge: float | None = 2.0, device: str = "cpu",
                 on_step: Callable[[], None] | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """The solved block `tensors` after `steps` refinement steps on stats (x -> target), run on `device`; returns
    (float32 tensors on the CPU, {"loss_start", "loss_end"}: the relative squared error on all calibration
    sequences). The start is kept when refinement does not lower it."""
    x, target = (t.to(device=device, dtype=torch.float32) for t in (stats.x, stats.target))
    tensors = {n: t.to(device=device, dtype=torch.float32) for n, t in tensors.items()}

    def forward(ps: dict[str, torch.Tensor], rows: torch.Tensor) -> torch.Tensor:
        return mla_output(x[rows], ps, shape, rope, norm=norm)

    best, first, last = refine_tensors(tensors, forward, target, steps=steps, lr=lr, on_step=on_step)
    if best is None:
        return {n: t.cpu() for n, t in tensors.items()}, {"loss_start": first, "loss_end": first}
    best = renormalise(best, x, shape, norm)
    if o_ridge:
        with torch.no_grad():
            ctx = mla_contexts(x, best, shape, rope, norm=norm)
            refit = {**best, "o_proj.weight": refit_o(ctx, target, best["o_proj.weight"], o_ridge)
                     .to(torch.float32)}
            err = float((mla_output(x, refit, shape, rope, norm=norm) - target).pow(2).mean()
                        / target.pow(2).mean().clamp_min(1e-30))
        if err < last:
            best, last = refit, err
    return ({n: t.detach().to("cpu", torch.float32).contiguous() for n, t in best.items()},
            {"loss_start": first, "loss_end": last})


def renormalise(t: dict[str, torch.Tensor], x: torch.Tensor, shape: MlaShape, norm: str = "constant"
                ) -> dict[str, torch.Tensor]:
    """t with kv_a_layernorm.weight giving each cached latent dimension unit RMS on x again and kv_b_proj's columns
    the inverse (solve.cached_gain): the block computes the same, its cache keeps FP8's normal range."""
    with torch.no_grad():
        r = shape.kv_lora_rank
        rows = t["kv_a_proj_with_mqa.weight"][:r].to(torch.float64)
        c = latent_of(x.reshape(-1, x.shape[-1]).to(torch.float64), rows, norm)
        w = t["kv_a_layernorm.weight"].to(torch.float64)
        gain = cached_gain(c * w)  # the extra factor that brings the cached dims (c * w) to unit RMS
        return {**t, "kv_a_layernorm.weight": (w * gain).to(torch.float32),
                "kv_b_proj.weight": (t["kv_b_proj.weight"].to(torch.float64) / gain).to(torch.float32)}


def source_hidden(lm, ids: torch.Tensor) -> torch.Tensor:
    """The source model's hidden states leaving its last decoder layer on ids [n, T] (the distillation's teacher,
    kvtool.convert.aware.distill.teacher_targets), one layer at a time."""
    from kvtool.runtime.layerwise import run_layer

    h, calls = lm.capture(ids)
    with torch.no_grad():
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer:
                h = run_layer(layer, h, calls[i])
    return h


class MlaBlock:
    """The distillation's view of an MLA block (kvtool.convert.aware.distill.Distiller's `block`): the tensors are
    solve.solve_layer's, installed as the forward of the source model's attention module."""

    def __init__(self, shape: MlaShape, rope: SourceRope, norm: str = "constant") -> None:
        self.shape, self.rope, self.norm = shape, rope, norm

    def tensors(self, value: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(value)

    def pack(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return dict(tensors)

    def install(self, module: torch.nn.Module, tensors: dict[str, torch.Tensor], train: bool) -> dict:
        """The module computes the MLA block from now on (positions 0.. of each calibration sequence, causal, as
        the solve's reference); returns the installed parameters (their .grad after a backward)."""
        params = {n: t.detach().clone().requires_grad_(train) for n, t in tensors.items()}
        shape, rope, norm = self.shape, self.rope, self.norm

        def forward(hidden_states: torch.Tensor, *args, **kwargs):
            return mla_output(hidden_states, params, shape, rope, norm=norm), None

        module.forward = forward
        return params

    def grads(self, module: torch.nn.Module, installed: dict) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in installed.items() if p.grad is not None}
