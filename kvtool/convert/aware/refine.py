"""Optional block reconstruction: a few Adam steps on the converted q/k/v/o of one layer.

The loss is the normalised squared error between the converted layer's attention output and the
original layer's, both on the same calibration inputs; it starts from the closed-form merge, so a
handful of steps only polish it. Step sizes are relative to each tensor's RMS (scale-free).
"""

from __future__ import annotations

import torch

from kvtool.convert.aware.attention import LayerInputs, Proj, attention_output

_FIELDS = ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias")


def refine(inp: LayerInputs, start: Proj, target: torch.Tensor, *, num_heads: int, head_dim: int, steps: int,
           lr: float = 2e-3) -> tuple[Proj, float, float]:
    """Returns (refined projections, loss before, loss after); keeps the start if refinement made it worse."""
    params = {f: getattr(start, f).detach().to(torch.float32).clone().requires_grad_(True)
              for f in _FIELDS if getattr(start, f) is not None}
    groups = [{"params": [t], "lr": lr * float(t.detach().pow(2).mean().sqrt().clamp_min(1e-8))}
              for t in params.values()]
    opt = torch.optim.Adam(groups, betas=(0.9, 0.99))
    target = target.to(torch.float32)
    inp32 = LayerInputs(inp.x.to(torch.float32), inp.cos, inp.sin, inp.scaling, inp.sliding_window, inp.softcap)
    denom = target.pow(2).mean().clamp_min(1e-30)

    def loss_of(ps):
        out = attention_output(inp32, Proj(**{f: ps.get(f) for f in _FIELDS}), num_heads, head_dim)
        return (out - target).pow(2).mean() / denom

    with torch.enable_grad():
        first = None
        for _ in range(steps):
            opt.zero_grad(set_to_none=True)
            loss = loss_of(params)
            first = float(loss) if first is None else first
            loss.backward()
            opt.step()
    with torch.no_grad():
        last = float(loss_of(params))
        if first is None or last > first:
            return start, first or last, first or last
    return Proj(**{f: (params[f].detach() if f in params else None) for f in _FIELDS}), first, last
