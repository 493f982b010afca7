"""Value merging: one shared value head per group, per-head maps folded into o_proj.

Head j's value x W_j^T is approximated as (x U^T) B_j; the query heads reading j then use
o_h B_j^T. The error that reaches the output is weighted by o_h^T o_h summed over those heads, so U
spans the top principal subspace of the o-weighted concatenated head values (`subspace_merge`).
`refit_o` then re-solves o_proj by ridge least squares on the converted layer's actual attention
contexts against the original layer's output, which also absorbs what the key merge lost.
"""

from __future__ import annotations

import torch

from kvtool.convert.aware.linalg import subspace_merge


def merge_values(wv: torch.Tensor, o: torch.Tensor, cov: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                 target_kv_heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wv [KV*hd, D] (augmented), o [hidden, H*hd] (float64) -> (new wv [G*hd, D], new o)."""
    H, KV, G, hd = num_heads, num_kv_heads, target_kv_heads, head_dim
    m, rq, D = KV // G, H // KV, wv.shape[1]
    oh = o.reshape(o.shape[0], H, hd).permute(1, 0, 2)  # [H, hidden, hd]
    metric = (oh.transpose(-1, -2) @ oh).reshape(KV, rq, hd, hd).sum(1).reshape(G, m, hd, hd)
    u, b = subspace_merge(wv.reshape(G, m, hd, D), metric, cov)
    b_h = b.reshape(KV, hd, hd).repeat_interleave(rq, dim=0)  # [H, hd, hd]
    new_o = (oh @ b_h.transpose(-1, -2)).permute(1, 0, 2).reshape(o.shape[0], H * hd)
    return u.reshape(G * hd, D), new_o


def refit_o(ctx: torch.Tensor, target: torch.Tensor, o_prior: torch.Tensor, ridge: float) -> torch.Tensor:
    """argmin_W ||ctx W^T - target||^2 + lam ||W - o_prior||^2, lam = ridge * (P / N) * mean(diag(ctx^T ctx)).

    ctx [N, P = H*hd] contexts of the converted layer, target [N, hidden] the original layer's
    output without o bias. The ridge pulls toward the folded o, more strongly when calibration
    tokens are few relative to the P unknowns per output (a least-squares fit's variance grows as
    P / N): measured on SmolLM2, a fixed ridge that suits 4096 tokens overfits at 1024.
    """
    ctx = ctx.reshape(-1, ctx.shape[-1]).to(torch.float64)
    target = target.reshape(-1, target.shape[-1]).to(torch.float64)
    a = ctx.T @ ctx
    lam = ridge * (ctx.shape[1] / ctx.shape[0]) * a.diagonal().mean().clamp_min(1e-300)
    a = a + lam * torch.eye(a.shape[0], dtype=a.dtype, device=a.device)
    rhs = ctx.T @ target + lam * o_prior.to(torch.float64).T
    return torch.linalg.solve(a, rhs).T
