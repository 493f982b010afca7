"""Calibration statistics of one attention layer for the MLA solve (kvtool.convert.mla.solve).

The solve needs the layer's input covariance (the closed-form subspaces, as the aware merge), and the
calibration inputs themselves for the two least-squares fits that see DeepSeek's latent RMSNorm: the
up-projection from the normalised latent, and the o_proj refit against the source attention output.
`collect_stats` runs the source model once over the calibration ids with a hook on every attention
module; with `convert` each layer is solved as the forward reaches it and its converted output goes on, so
later layers see the converted stream (sequential calibration, as the aware merge).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvtool.convert.aware.linalg import augmented_covariance


@dataclass
class MlaStats:
    """One layer over the calibration batch. x: the attention input [B, T, hidden] (float32); target: the source
    attention output [B, T, hidden] (o_proj's output, float32); cov: E[[x, 1][x, 1]^T] (float64); scaling: the
    source softmax scale."""

    x: torch.Tensor
    target: torch.Tensor
    cov: torch.Tensor
    scaling: float

    @classmethod
    def of(cls, x: torch.Tensor, target: torch.Tensor, scaling: float) -> "MlaStats":
        x = x.detach().to(torch.float32)
        return cls(x=x, target=target.detach().to(torch.float32), cov=augmented_covariance(x), scaling=float(scaling))


def collect_stats(model, ids: torch.Tensor,
                  convert: Callable[[int, MlaStats], Callable[[torch.Tensor], torch.Tensor]] | None = None
                  ) -> dict[int, MlaStats]:
    """layer index -> MlaStats, from one forward of a loaded transformers model over ids [B, T].

    convert: sequential calibration. convert(layer, stats) returns the converted block's attention (x -> output),
    which replaces the layer's attention output in the forward, so every later layer's statistics come from the
    converted stream (the target stays the source attention on that stream, as the aware merge's default)."""
    from kvtool.convert.aware.modules import attention_scale
    from kvtool.runtime.kv_hooks import attention_modules

    seen: dict[int, MlaStats] = {}
    handles = []

    def hook(module, args, kwargs, out):
        x = kwargs.get("hidden_states", args[0] if args else None)
        y = out[0] if isinstance(out, tuple) else out
        st = seen[module.layer_idx] = MlaStats.of(x.cpu(), y.cpu(), attention_scale(module))
        if convert is None:
            return None
        new = convert(module.layer_idx, st)(st.x).to(y.dtype).to(y.device)
        return (new, *out[1:]) if isinstance(out, tuple) else new

    for m in attention_modules(model):
        handles.append(m.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            model(input_ids=ids.to(next(model.parameters()).device), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return dict(sorted(seen.items()))
