"""One layer's calibrated merge: grouping, keys, values, o refit, optional refinement."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

import torch

from kvtool.convert.aware.attention import LayerInputs, Proj, head_contexts
from kvtool.convert.aware.closed_form import merge_heads
from kvtool.convert.aware.grouping import GroupCost, head_similarity, kv_order, permute_heads, similarity_groups
from kvtool.convert.aware.keys import pair_angles, static_pairs
from kvtool.convert.aware.linalg import augment, augmented_covariance, shrink_covariance
from kvtool.convert.aware.partition import best_partition
from kvtool.convert.aware.refine import refine
from kvtool.convert.aware.values import refit_o


@dataclass
class MergeSettings:
    num_heads: int
    num_kv_heads: int
    target_kv_heads: int  # KV heads after the merge
    head_dim: int
    grouping: str = "error"  # error | contiguous | similarity (grouping.py)
    o_ridge: float | None = 2.0  # None: keep the folded o_proj (no least-squares refit)
    refine_steps: int = 0
    refine_holdout: int = 0  # > 1: every k-th calibration sequence picks the refinement step (refine.refine)
    refine_reg: float = 0.0  # pull of the refinement toward the closed-form merge (refine.refine's reg)
    refine_lr: float = 5e-3  # Adam step of the refinement, relative to each tensor's RMS
    cov_shrink: float = 0.0  # weight of the isotropic prior in the input covariance of the key / value merges
    # RoPE pairs turning by less than static_angle radians over `context` positions (the served context; a
    # sliding-window layer's window when shorter) merge as one real subspace (keys.py); None / 0: none do
    context: int | None = None
    static_angle: float = 0.0


@dataclass
class LayerReport:
    order: list[int]  # KV head order used (identity for contiguous)
    err_merged: float  # relative squared error of the attention output after the closed-form merge
    err_final: float  # ... after the o refit / refinement
    best_step: int | None = None  # refinement step kept (held-out early stopping)
    static_pairs: int = 0  # RoPE pairs merged as a real subspace


def _rel_err(out: torch.Tensor, target: torch.Tensor) -> float:
    return float((out - target).pow(2).mean() / target.pow(2).mean().clamp_min(1e-300))


def _output(inp: LayerInputs, p: Proj, num_heads: int, head_dim: int) -> torch.Tensor:
    """float64 attention output of p on inp, without the o bias."""
    return head_contexts(inp, p.to(torch.float32), num_heads, head_dim).to(torch.float64) @ p.o.T


def merge_layer(inp: LayerInputs, src: Proj, s: MergeSettings, on_step: Callable[[], None] | None = None,
                on_note: Callable[[str], None] | None = None) -> tuple[Proj, LayerReport]:
    """Merge src (num_kv_heads KV heads) into s.target_kv_heads KV heads; returns float32 projections.
    on_step(): called once after the closed-form merge and once per refinement step; on_note(text): what the
    merge is doing before that (progress)."""
    H, KV, G, hd = s.num_heads, s.num_kv_heads, s.target_kv_heads, s.head_dim
    src = src.to(torch.float64)
    # Attention passes run in float32 (they dominate the time); the solves run in float64.
    x32 = LayerInputs(inp.x.to(torch.float32), inp.cos.to(torch.float32), inp.sin.to(torch.float32), inp.scaling,
                      inp.sliding_window, inp.softcap)
    cov = shrink_covariance(augmented_covariance(inp.x), s.cov_shrink)
    rotary = inp.cos.shape[-1]
    static = angles = None
    if s.static_angle and s.context and rotary:
        horizon = min(s.context, inp.sliding_window or s.context)
        angles = pair_angles(inp.cos, inp.sin)
        static = static_pairs(angles, horizon, s.static_angle)
    o_target = _output(x32, src, H, hd)  # the original layer on this layer's inputs, without the o bias
    order = list(range(KV))
    if s.grouping == "error" and 1 < G < KV:
        cost = GroupCost(x32, src, cov, num_heads=H, num_kv_heads=KV, head_dim=hd, static=static, angles=angles)
        note = None if on_note is None else (lambda k: on_note(f"grouping, {k} candidate groups merged"))
        order = kv_order(best_partition(cost, KV, G, on_eval=note))
    elif s.grouping == "similarity" and 1 < G < KV:
        sim = head_similarity(augment(src.q, src.q_bias), augment(src.k, src.k_bias), augment(src.v, src.v_bias),
                              src.o, cov, num_heads=H, num_kv_heads=KV, head_dim=hd, rotary_dim=rotary)
        order = kv_order(similarity_groups(sim, G))
    if order != sorted(order):
        src = permute_heads(src, order, num_heads=H, head_dim=hd)
    new = merge_heads(src, cov, num_heads=H, num_kv_heads=KV, target_kv_heads=G, head_dim=hd, rotary_dim=rotary,
                      static=static, angles=angles)
    ctx = head_contexts(x32, new.to(torch.float32), H, hd).to(torch.float64)
    err_merged = _rel_err(ctx @ new.o.T, o_target)
    if s.o_ridge is not None:
        new.o = refit_o(ctx, o_target, new.o, s.o_ridge)
    err_final = _rel_err(ctx @ new.o.T, o_target)
    best_step = None
    if on_step is not None:
        on_step()
    if s.refine_steps:
        if inp.x_target is not None:
            # the original model's own output at this layer: refinement then also corrects what the merged layers
            # before this one left in its inputs (the closed form keeps o_target: measured worse with this one)
            o_target = _output(replace(x32, x=inp.x_target.to(torch.float32)), src, H, hd)
        target = o_target if src.o_bias is None else o_target + src.o_bias
        stats: dict = {}
        new, _, _ = refine(x32, new, target.to(torch.float32), num_heads=H, head_dim=hd, steps=s.refine_steps,
                           lr=s.refine_lr, holdout_every=s.refine_holdout, on_step=on_step, stats=stats,
                           reg=s.refine_reg)
        best_step = stats.get("best_step")
        new = new.to(torch.float64)
        # refinement moved q/k/v: re-solve o_proj on all calibration tokens for the new contexts
        ctx = head_contexts(x32, new.to(torch.float32), H, hd).to(torch.float64)
        if s.o_ridge is not None:
            new.o = refit_o(ctx, o_target, new.o, s.o_ridge)
        err_final = _rel_err(ctx @ new.o.T, o_target)
    n_static = 0 if static is None else int(static.sum())
    return new.to(torch.float32), LayerReport(order, err_merged, err_final, best_step, n_static)
