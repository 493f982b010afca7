"""RoPE-aware key merging: one shared key per group, per-head coefficients folded into q.

RoPE rotates each dimension pair (i, i + r/2) of the rotate_half layout by a position angle, i.e.
multiplies the complex number k_i + i*k_{i+r/2} by e^{i theta t}. A complex scale c on a pair
commutes with that rotation, so if head j's key pair is approximated as c_j * (shared pair), the
query heads reading j can absorb conj(c_j) and the q.k score is kept for every position.

Per pair, the shared key is a linear function of the layer input x: z' = x u (u complex). For
random relative rotation the expected squared score error of a query head reading head j is
E|z_q|^2 * E|z_j - c_j z'|^2 / 2, so u is the top complex singular direction of the group's key
activations weighted by the energy of the queries that read each head, and c_j is the least-squares
coefficient. Both come from the input covariance alone (no per-token work). Dims past the rotary
part (partial rotary, or no RoPE at all) are merged as a real subspace weighted by the query
covariance, with the per-head map folded into the query rows.
"""

from __future__ import annotations

import torch

from kvtool.convert.aware.linalg import subspace_merge


def merge_keys(wq: torch.Tensor, wk: torch.Tensor, cov: torch.Tensor, *, num_heads: int, num_kv_heads: int,
               groups: int, head_dim: int, rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """wq [H*hd, D], wk [KV*hd, D] (augmented, float64) -> (new wq [H*hd, D], new wk [G*hd, D])."""
    H, KV, G, hd = num_heads, num_kv_heads, groups, head_dim
    m, rq, P, D = KV // G, H // KV, rotary_dim // 2, wq.shape[1]
    q = wq.reshape(H, hd, D)
    k = wk.reshape(KV, hd, D)
    new_q = q.clone()
    new_k = torch.empty(G, hd, D, dtype=wk.dtype, device=wk.device)
    if P:
        cc = cov.to(torch.complex128)
        zq = torch.complex(q[:, :P], q[:, P:2 * P])  # [H, P, D]
        zk = torch.complex(k[:, :P], k[:, P:2 * P]).reshape(G, m, P, D)
        # energy of the queries that read each KV head, per pair
        eq = torch.einsum("hpd,hpd->hp", zq.conj(), zq @ cc).real.clamp_min(0)
        wsq = eq.reshape(KV, rq, P).sum(1).reshape(G, m, P).sqrt().permute(0, 2, 1)  # [G, P, m]
        ck = zk @ cc
        gram = torch.einsum("gapd,gbpd->gpab", zk.conj(), ck)  # <k_a, k_b>
        gram_w = wsq[..., :, None] * gram * wsq[..., None, :]
        gram_w = (gram_w + gram_w.conj().transpose(-1, -2)) / 2
        _, evecs = torch.linalg.eigh(gram_w)
        f = evecs[..., -1] * wsq  # [G, P, m]
        u = torch.einsum("gpa,gapd->gpd", f, zk)  # shared pair weights [G, P, D]
        cu = u @ cc
        ucu = torch.einsum("gpd,gpd->gp", u.conj(), cu).real
        e_heads = torch.einsum("gapd,gapd->gp", zk.conj(), ck).real / m
        scale = torch.where(ucu > 0, (e_heads / ucu.clamp_min(1e-300)).sqrt(), torch.ones_like(ucu))
        u, cu, ucu = u * scale[..., None], cu * scale[..., None], ucu * scale ** 2
        coef = torch.einsum("gpd,gapd->gap", cu.conj(), zk) / ucu.clamp_min(1e-300)[:, None, :]  # [G, m, P]
        new_k[:, :P], new_k[:, P:2 * P] = u.real, u.imag
        c_h = coef.reshape(KV, P).repeat_interleave(rq, dim=0).conj()[..., None]  # [H, P, 1]
        zq_new = c_h * zq
        new_q[:, :P], new_q[:, P:2 * P] = zq_new.real, zq_new.imag
    n = hd - 2 * P
    if n:
        qn = q[:, 2 * P:]  # [H, n, D]
        qcov = (qn @ cov @ qn.transpose(-1, -2)).reshape(KV, rq, n, n).sum(1).reshape(G, m, n, n)
        u, b = subspace_merge(k[:, 2 * P:].reshape(G, m, n, D), qcov, cov)
        new_k[:, 2 * P:] = u
        # score q.k_j ~= q.(B_j^T k') = (B_j q).k'
        b_h = b.reshape(KV, n, n).repeat_interleave(rq, dim=0)
        new_q[:, 2 * P:] = b_h @ qn
    return new_q.reshape(H * hd, D), new_k.reshape(G * hd, D)
