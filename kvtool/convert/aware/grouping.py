"""Which KV heads share a group: contiguous (transformers' order), by measured merge error, or by similarity.

`error` (the default): each candidate group is merged alone on the calibration inputs and its attention-output
error measured (`GroupCost`); kvtool.convert.aware.partition searches the partition with the lowest sum. On the
trained tiny MHA model (8 -> 4 KV heads) it took the training-free KLD from 0.013 to 0.004, where `similarity`
changed nothing beyond noise (docs/convert-quality.md).

Similarity of two heads is how well one shared head can stand for both, measured the way the merge
measures error: for keys the query-energy-weighted complex coherence of each RoPE pair, for values
the o-weighted RV coefficient. Groups are grown greedily from the most similar pairs; the chosen
order is then made contiguous by permuting KV heads together with the query heads that read them
(q rows, o columns), which leaves the layer's function unchanged.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from kvtool.convert.aware.attention import LayerInputs, Proj, head_contexts
from kvtool.convert.aware.closed_form import merge_heads
from kvtool.convert.aware.partition import GROUPING_TOKENS, measured_tokens


def head_similarity(wq: torch.Tensor, wk: torch.Tensor, wv: torch.Tensor, o: torch.Tensor, cov: torch.Tensor, *,
                    num_heads: int, num_kv_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """[KV, KV] similarity in [0, 1] (1: interchangeable up to the foldable maps) from augmented float64 weights."""
    H, KV, hd, P = num_heads, num_kv_heads, head_dim, rotary_dim // 2
    rq, D = H // KV, wq.shape[1]
    cc = cov.to(torch.complex128)
    q, k = wq.reshape(H, hd, D), wk.reshape(KV, hd, D)
    sims = []
    if P:
        zq = torch.complex(q[:, :P], q[:, P:2 * P])
        zk = torch.complex(k[:, :P], k[:, P:2 * P])  # [KV, P, D]
        eq = torch.einsum("hpd,hpd->hp", zq.conj(), zq @ cc).real.reshape(KV, rq, P).sum(1)  # [KV, P]
        gram = torch.einsum("apd,bpd->pab", zk.conj(), zk @ cc)  # [P, KV, KV]
        diag = gram.diagonal(dim1=-2, dim2=-1).real.clamp_min(1e-300)
        coh = gram.abs() ** 2 / (diag[:, :, None] * diag[:, None, :])  # [P, KV, KV]
        w = (eq.T[:, :, None] * diag[:, :, None] + eq.T[:, None, :] * diag[:, None, :])  # score energy at stake
        sims.append((coh * w).sum(0) / w.sum(0).clamp_min(1e-300))
    oh = o.reshape(o.shape[0], H, hd).permute(1, 0, 2)
    metric = (oh.transpose(-1, -2) @ oh).reshape(KV, rq, hd, hd).sum(1)
    evals, evecs = torch.linalg.eigh((metric + metric.transpose(-1, -2)) / 2)
    s = (evecs * evals.clamp_min(0).sqrt().unsqueeze(-2)) @ evecs.transpose(-1, -2)
    y = s @ wv.reshape(KV, hd, D)  # o-weighted value rows
    cross = torch.einsum("aid,de,bje->abij", y, cov, y)
    fro = cross.pow(2).sum((-1, -2))
    d = fro.diagonal().clamp_min(1e-300).sqrt()
    sims.append(fro / (d[:, None] * d[None, :]))
    return torch.stack(sims).mean(0)


def similarity_groups(sim: torch.Tensor, target_kv_heads: int) -> list[list[int]]:
    """Partition KV heads into `target_kv_heads` equal groups, greedily maximising within-group similarity."""
    kv = sim.shape[0]
    m = kv // target_kv_heads
    free = list(range(kv))
    out = []
    while free:
        if len(free) == m:
            out.append(sorted(free))
            break
        # seed with the most similar free pair, then add the head closest to the group so far
        sub = sim[free][:, free].clone()
        sub.fill_diagonal_(-1)
        i, j = divmod(int(sub.argmax()), len(free))
        group = [free[i], free[j]] if m > 1 else [free[i]]
        while len(group) < m:
            rest = [h for h in free if h not in group]
            score = torch.stack([sim[h, group].mean() for h in rest])
            group.append(rest[int(score.argmax())])
        out.append(sorted(group))
        free = [h for h in free if h not in group]
    return sorted(out)


def kv_order(groups: list[list[int]]) -> list[int]:
    return [h for g in groups for h in g]


def permute_heads(p: Proj, order: list[int], *, num_heads: int, head_dim: int,
                  num_kv_heads: int | None = None) -> Proj:
    """Reorder KV heads (and the query heads that read each) so that new KV head i is old head order[i].
    With num_kv_heads larger than len(order), the heads in order alone (the layer those heads make)."""
    kv, hd = num_kv_heads or len(order), head_dim
    rq = num_heads // kv
    kv_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in order])
    q_heads = [h * rq + i for h in order for i in range(rq)]
    q_rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in q_heads])

    def rows(t, idx):
        return None if t is None else t[idx.to(t.device)]

    return Proj(q=rows(p.q, q_rows), k=rows(p.k, kv_rows), v=rows(p.v, kv_rows), o=p.o[:, q_rows.to(p.o.device)],
                q_bias=rows(p.q_bias, q_rows), k_bias=rows(p.k_bias, kv_rows), v_bias=rows(p.v_bias, kv_rows),
                o_bias=p.o_bias)


class GroupCost:
    """What a group of KV heads costs the layer: the mean squared attention-output error (summed over the hidden
    dims) of merging those heads alone into one head, keys (static pairs as the layer's merge has them:
    keys.merge_keys) and values in closed form (closed_form.merge_heads), before the o refit, on the first
    calibration sequences (partition.GROUPING_TOKENS). Without the static pairs the choice was worse on the tiny
    MHA model (KLD 0.0053 against 0.0037).

    Each KV head's share of the original output (its query heads' contexts through their o columns) is computed
    once; a call merges the group and runs the attention of its heads only."""

    def __init__(self, inp: LayerInputs, src: Proj, cov: torch.Tensor, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, static: torch.Tensor | None = None, angles: torch.Tensor | None = None,
                 tokens: int = GROUPING_TOKENS):
        """src: float64; cov: the augmented input covariance (of all calibration tokens)."""
        B, T = inp.x.shape[:2]
        n = measured_tokens(B * T, T, tokens) // T

        def first(t):
            return t[:n] if t.shape[0] == B else t

        self.inp = replace(inp, x=first(inp.x).to(torch.float32), cos=first(inp.cos), sin=first(inp.sin))
        self.src, self.cov, self.static, self.angles = src, cov, static, angles
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        rq, hd = num_heads // num_kv_heads, head_dim
        ctx = head_contexts(self.inp, src.to(torch.float32), num_heads, hd).to(torch.float64)
        w = rq * hd  # context columns of one KV head's query heads
        self.shares = torch.stack([ctx[..., j * w:(j + 1) * w] @ src.o[:, j * w:(j + 1) * w].T
                                   for j in range(num_kv_heads)]).to(torch.float32)  # [KV, n, T, hidden]

    def __call__(self, heads: tuple[int, ...]) -> float:
        m, hd = len(heads), self.head_dim
        h = self.num_heads // self.num_kv_heads * m
        sub = permute_heads(self.src, list(heads), num_heads=self.num_heads, head_dim=hd,
                            num_kv_heads=self.num_kv_heads)
        merged = merge_heads(sub, self.cov, num_heads=h, num_kv_heads=m, target_kv_heads=1, head_dim=hd,
                             rotary_dim=self.inp.cos.shape[-1], static=self.static, angles=self.angles)
        got = head_contexts(self.inp, merged.to(torch.float32), h, hd).to(torch.float64) @ merged.o.T
        want = self.shares[list(heads)].to(torch.float64).sum(0)
        return float((got - want).pow(2).sum(-1).mean())
