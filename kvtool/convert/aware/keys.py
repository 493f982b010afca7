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

Pairs that RoPE barely turns over the context the model serves (the lowest frequencies: at most
`static_angle` radians over `horizon` positions) are merged with the non-rotary dims, as one real
subspace with a full map per head. The complex scale per pair cannot mix pairs; the real map can, so
the shared head keeps what the group's heads store across those pairs. The map does not commute with
the small rotation that remains, which is why the angle is bounded over the whole served context
(measured on SmolLM2, docs/convert-quality.md: pairs chosen for 1024 positions made 8192-token windows
twice as bad as no static pairs, while pairs chosen for 8192 improved both), and why the subspace's
basis is the one whose folded maps commute best with it (`commuting_basis`).
"""

from __future__ import annotations

import torch

from kvtool.convert.aware.linalg import subspace_merge


def pair_angles(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """float64 [r/2]: radians each rotary pair turns per position, from the layer's own cos/sin (two
    consecutive calibration positions), so rope scaling and per-layer bases are those transformers applies."""
    P = cos.shape[-1] // 2
    c = cos.reshape(-1, cos.shape[-1])[:2, :P].to(torch.float64)
    s = sin.reshape(-1, sin.shape[-1])[:2, :P].to(torch.float64)
    return torch.atan2(s[1] * c[0] - c[1] * s[0], c[1] * c[0] + s[1] * s[0]).abs()


def static_pairs(angles: torch.Tensor, horizon: int, angle: float) -> torch.Tensor:
    """bool [r/2]: the rotary pairs that turn by less than `angle` radians over `horizon` positions
    (angles: `pair_angles`)."""
    return angles * horizon < angle


def merge_keys(wq: torch.Tensor, wk: torch.Tensor, cov: torch.Tensor, *, num_heads: int, num_kv_heads: int,
               target_kv_heads: int, head_dim: int, rotary_dim: int, static: torch.Tensor | None = None,
               angles: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """wq [H*hd, D], wk [KV*hd, D] (augmented, float64) -> (new wq [H*hd, D], new wk [G*hd, D]).

    static: bool [rotary_dim / 2], the pairs merged with the non-rotary dims (`static_pairs`); angles
    [rotary_dim / 2]: each pair's radians per position (`pair_angles`), needed with static."""
    if static is not None and bool(static.any()):
        # move the static pairs behind the rotating ones, merge them as non-rotary dims, move them back
        P, D = rotary_dim // 2, wq.shape[1]
        pairs = torch.arange(P)
        rot, st = pairs[~static.cpu()], pairs[static.cpu()]
        perm = torch.cat([rot, rot + P, st, st + P, torch.arange(2 * P, head_dim)])
        back = torch.argsort(perm)
        # RoPE's generator on the merged block: pair (i, s + i) turns at angles[i] per position
        s, n = len(st), head_dim - 2 * len(rot)
        omega = torch.zeros(n, n, dtype=wq.dtype, device=wq.device)
        a = angles.to(wq.device, wq.dtype)[st.to(wq.device)]
        i = torch.arange(s, device=wq.device)
        omega[i, s + i], omega[s + i, i] = -a, a
        nq, nk = _merge(wq.reshape(num_heads, head_dim, D)[:, perm].reshape(-1, D),
                        wk.reshape(num_kv_heads, head_dim, D)[:, perm].reshape(-1, D), cov,
                        num_heads=num_heads, num_kv_heads=num_kv_heads, target_kv_heads=target_kv_heads,
                        head_dim=head_dim, rotary_dim=2 * len(rot), omega=omega)
        return (nq.reshape(num_heads, head_dim, D)[:, back].reshape(-1, D),
                nk.reshape(target_kv_heads, head_dim, D)[:, back].reshape(-1, D))
    return _merge(wq, wk, cov, num_heads=num_heads, num_kv_heads=num_kv_heads, target_kv_heads=target_kv_heads,
                  head_dim=head_dim, rotary_dim=rotary_dim, omega=None)


def commuting_basis(u: torch.Tensor, b: torch.Tensor, qcov: torch.Tensor, cov: torch.Tensor,
                    omega: torch.Tensor, iters: int = 30) -> tuple[torch.Tensor, torch.Tensor]:
    """The basis of the shared subspace in which the maps folded into q best commute with RoPE's rotation.

    The subspace merge returns any basis of the shared subspace (W_j ~= B_j^T U). Changing it by N
    (U -> N^-T U, B_j -> N B_j) keeps every score at distance 0, but the static pairs still turn a little,
    and a folded map B that does not commute with that turn errs, to first order in the distance d, by
    d q^T (B^T Omega - Omega B^T) k'. N minimises the expected square of that over the calibration
    (queries reading each head: qcov [G, m, n, n]; shared keys: U C U^T), by L-BFGS from the identity or
    the N closest to B_j = I, whichever starts lower (copies of one head start, and end, exact). The error
    is scale-free in N. 30 iterations reach ~90% of the reduction 100 reach, at a fifth of the time.
    u [G, n, D], b [G, m, n, n], omega [n, n]."""
    G, m, n, _ = b.shape
    eye = torch.eye(n, dtype=b.dtype, device=b.device)
    ck = u @ cov @ u.transpose(-1, -2)  # [G, n, n]

    def loss(nm: torch.Tensor, g: int) -> torch.Tensor:
        bt = (nm @ b[g]).transpose(-1, -2)  # B_j'^T  [m, n, n]
        a = bt @ omega - omega @ bt
        ninv = torch.linalg.inv(nm)
        k2 = ninv.T @ ck[g] @ ninv  # covariance of the shared keys in the new basis
        return torch.einsum("mij,mik,mkl,jl->", a, qcov[g], a, k2)

    s1 = b.transpose(-1, -2).sum(1)
    s2 = (b @ b.transpose(-1, -2)).sum(1) + 1e-12 * eye
    closest = torch.linalg.solve(s2, s1, left=False)  # argmin_N sum_j ||N B_j - I||^2
    new_u, new_b = u.clone(), b.clone()
    for g in range(G):
        start, start_loss = eye, float(loss(eye, g))
        if bool(torch.isfinite(closest[g]).all()) and float(torch.linalg.cond(closest[g])) < 1e8:
            if (value := float(loss(closest[g], g))) < start_loss:
                start, start_loss = closest[g], value
        nm = start.clone().requires_grad_(True)
        opt = torch.optim.LBFGS([nm], max_iter=iters, line_search_fn="strong_wolfe")

        def closure():
            opt.zero_grad()
            value = loss(nm, g)
            value.backward()
            return value

        try:
            opt.step(closure)
            nm = nm.detach()
            ok = float(torch.linalg.cond(nm)) < 1e8 and float(loss(nm, g)) < start_loss
        except torch.linalg.LinAlgError:  # the search reached a singular basis
            ok = False
        best = nm if ok else start
        new_u[g], new_b[g] = torch.linalg.solve(best.T, u[g]), best @ b[g]
    return new_u, new_b


def _merge(wq, wk, cov, *, num_heads, num_kv_heads, target_kv_heads, head_dim, rotary_dim, omega):
    """merge_keys with the static pairs, if any, already moved into the non-rotary dims (omega: RoPE's
    generator there, None when none are)."""
    H, KV, G, hd = num_heads, num_kv_heads, target_kv_heads, head_dim
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
        if omega is not None:
            u, b = commuting_basis(u, b, qcov, cov, omega)
        new_k[:, 2 * P:] = u
        # score q.k_j ~= q.(B_j^T k') = (B_j q).k'
        b_h = b.reshape(KV, n, n).repeat_interleave(rq, dim=0)
        new_q[:, 2 * P:] = b_h @ qn
    return new_q.reshape(H * hd, D), new_k.reshape(G * hd, D)
