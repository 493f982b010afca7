"""Small float64 linear-algebra helpers shared by the key and value merges."""

from __future__ import annotations

import torch


def augmented_covariance(x: torch.Tensor) -> torch.Tensor:
    """E[xa xa^T] for xa = [x, 1] over all tokens of x [..., hidden]: biases ride on the last column."""
    x = x.reshape(-1, x.shape[-1]).to(torch.float64)
    xa = torch.cat((x, torch.ones_like(x[:, :1])), dim=1)
    return (xa.T @ xa) / xa.shape[0]


def shrink_covariance(cov: torch.Tensor, alpha: float) -> torch.Tensor:
    """(1 - alpha) C + alpha (tr C / D) I on the input block of an augmented covariance (bias row kept).

    Directions the calibration text never excites get weight: text of another genre uses them."""
    if not alpha:
        return cov
    d = cov.shape[0] - 1
    out = cov.clone()
    block = cov[:d, :d]
    out[:d, :d] = (1 - alpha) * block + alpha * block.diagonal().mean() * torch.eye(d, dtype=cov.dtype,
                                                                                        device=cov.device)
    out[:d, d], out[d, :d] = (1 - alpha) * cov[:d, d], (1 - alpha) * cov[d, :d]
    return out


def augment(w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[rows, hidden] weight and optional bias -> [rows, hidden + 1] float64."""
    w = w.to(torch.float64)
    col = torch.zeros_like(w[:, :1]) if b is None else b.to(torch.float64)[:, None]
    return torch.cat((w, col), dim=1)


def psd_sqrt(m: torch.Tensor) -> torch.Tensor:
    """Symmetric square root of a (batched) positive semi-definite matrix."""
    m = (m + m.transpose(-1, -2)) / 2
    evals, evecs = torch.linalg.eigh(m)
    return (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)


def subspace_merge(ws: torch.Tensor, metric: torch.Tensor, cov: torch.Tensor, ridge: float = 1e-10
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the heads of each group into one real head of the same width.

    ws [G, m, n, D]: each head's rows (n output dims over D inputs); metric [G, m, n, n]: PSD weight
    on each head's output error (how much what reads it cares); cov [D, D]: input covariance.
    Minimises sum_j E|| (x W_j^T - x U^T B_j) S_j^{1/2} ||^2 over the shared U [n, D] and maps B_j:
    U spans the top-n principal subspace of the metric-weighted concatenated heads.
    Returns U [G, n, D] and B [G, m, n, n] with x W_j^T ~= (x U^T) B_j.
    """
    G, m, n, D = ws.shape
    s = psd_sqrt(metric)  # [G, m, n, n]
    y = s @ ws  # S^{1/2} W_j  [G, m, n, D]
    yc = y @ cov
    gram = torch.einsum("gand,gbkd->ganbk", yc, y).reshape(G, m * n, m * n)
    gram = (gram + gram.transpose(-1, -2)) / 2
    _, evecs = torch.linalg.eigh(gram)
    f = evecs[..., -n:].reshape(G, m, n, n)  # top-n eigenvectors, split per head
    u = torch.einsum("gank,gand->gkd", f, y)  # [G, n, D]
    # Scale the shared rows to the mean energy of the heads they replace (keeps values in range for bf16).
    e_heads = torch.einsum("gand,de,gane->g", ws, cov, ws) / m
    e_u = torch.einsum("gnd,de,gne->g", u, cov, u)
    u = u * torch.where(e_u > 0, (e_heads / e_u.clamp_min(1e-300)).sqrt(), torch.ones_like(e_u))[:, None, None]
    ucu = u @ cov @ u.transpose(-1, -2)  # [G, n, n]
    eye = torch.eye(n, dtype=cov.dtype, device=cov.device)
    # the ridge follows the energy; with none (inputs zero on the calibration: zeroed layer norms) a ridge of
    # 1e-310 would make 0/1e-310 NaN in the solve, so it is 1 there (rhs is zero too: B = 0, exact)
    energy = ucu.diagonal(dim1=-2, dim2=-1).mean(-1)
    ucu = ucu + ridge * torch.where(energy > 1e-200, energy, torch.ones_like(energy))[:, None, None] * eye
    rhs = torch.einsum("gkd,de,gane->gakn", u, cov, ws)  # U C W_j^T  [G, m, n, n]
    b = torch.linalg.solve(ucu[:, None], rhs)
    return u, b
