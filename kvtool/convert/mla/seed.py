"""MLA seeded from the aware MQA merge: the one format contains the other.

With qk_rope_head_dim = head_dim the shared rope key is a whole MQA key head, rotated in every pair at the
source's own frequencies (kvtool.convert.mla.config.rope_theta gives theta itself for rope_dim = rotary_dim), and
a latent of head_dim dims holds the MQA value head; kv_b_proj then reads each query head's value through the
identity and o_proj carries the merge's per-head maps. So the aware MQA merge (kvtool.convert.aware.keys /
values, the same closed form `--to mqa --method aware` runs, static pairs included) is an MLA solution at MQA's
bytes, up to kv_a_layernorm, the RMSNorm DeepSeek applies to the latent (the rope key bypasses it, so the scores
are exact; only the values are divided by the latent's RMS per token: solve.SolveOptions.norm).

`mqa_parts` gives kvtool.convert.mla.solve's assembly (latent, kv_b_proj, q/o folds, o refit) its targets:

- the rope key: the MQA key's fastest qk_rope_head_dim / 2 pairs (all of them at rope = head_dim), the queries
  the merge's folded query rows;
- NoPE, from the latent: the MQA key's pairs outside the rope part (unrotated: the slowest, which the served
  context barely turns), and with residual_angle, per query head h reading source KV head j, what the MQA key
  misses of h's own score on the pairs that turn less than residual_angle over the horizon: q_h . k_j
  (original) - q'_h . k' (MQA, on those pairs in the rope part), a product the latent can carry per head because
  kv_b_proj's key rows are per head (the per-pair complex scale of MQA cannot);
- values: the MQA value head (one per source KV head when the keys differ per head, so that the assembly's
  weighting adds up the heads reading it), with the merge's per-head maps in o; or, with seed_values "source",
  the source's own value heads and o_proj (the latent's principal subspace then chooses among all of them).
"""

from __future__ import annotations

import torch

from kvtool.convert.aware.keys import merge_keys
from kvtool.convert.aware.values import merge_values
from kvtool.convert.mla.rope import SourceRope, static_pairs
from kvtool.convert.mla.shape import MlaShape


def mqa_parts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, cov: torch.Tensor,
              shape: MlaShape, rope: SourceRope, options):
    """solve.Parts from the aware MQA merge of q [H, hd, D+1], k / v [KV, hd, D+1] (rotate_half order, q scaled
    for DeepSeek's softmax), o [H, hidden, hd]; options: solve.SolveOptions."""
    from kvtool.convert.mla.solve import Parts

    H, hd, D1 = q.shape
    KV, P, m = k.shape[0], rope.pairs, shape.qk_rope_head_dim // 2
    static = static_pairs(rope, options.horizon, options.static_angle)
    mq, mk = merge_keys(q.reshape(H * hd, D1), k.reshape(KV * hd, D1), cov, num_heads=H, num_kv_heads=KV,
                        target_kv_heads=1, head_dim=hd, rotary_dim=rope.rotary_dim, static=static,
                        angles=rope.pair_angles())
    mq, mk = mq.reshape(H, hd, D1), mk.reshape(hd, D1)
    pairs = torch.arange(P)
    inter = torch.stack([pairs[:m], pairs[:m] + P], 1).flatten()  # DeepSeek's interleaved pairs (2i, 2i+1)
    q_rope, k_rope = mq[:, inter], mk[inter]

    def rows(sel: torch.Tensor) -> torch.Tensor:
        idx = pairs[sel]
        return torch.cat([idx, idx + P])

    resid = static_pairs(rope, options.horizon, options.residual_angle) if options.residual_angle else pairs < 0
    own, undo = rows(resid), rows(resid & (pairs < m))  # the source's own scores; the MQA part they replace
    shared = torch.cat([rows(~resid & (pairs >= m)), torch.arange(rope.rotary_dim, hd)])  # MQA's, unrotated
    # The MQA seed's targets span about one value head plus the per-head static keys (SmolLM2: 64 + 3 x 12); a
    # latent wider than that has nothing more to take from them, so "source" gives it every KV head's values.
    own_values = options.seed_values == "source"
    if len(own) or own_values:
        qn = torch.cat([q[:, own], -mq[:, undo], mq[:, shared]], dim=1)
        kn = torch.cat([k[:, own], mk[undo].expand(KV, -1, -1), mk[shared].expand(KV, -1, -1)], dim=1)
        if own_values:
            return Parts(q_rope, k_rope, qn, kn, v, o)
        mv, mo = _merged_values(v, o, cov)
        return Parts(q_rope, k_rope, qn, kn, mv.expand(KV, -1, -1), mo)
    mv, mo = _merged_values(v, o, cov)
    return Parts(q_rope, k_rope, mq[:, shared], mk[shared][None], mv[None], mo)


def _merged_values(v: torch.Tensor, o: torch.Tensor, cov: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The aware MQA merge's value head [hd, D+1] and per-head output maps o [H, hidden, hd] (only where the seed's
    values are the merge's: seed_values "mqa")."""
    (KV, hd, D1), (H, hidden, _) = v.shape, o.shape
    mv, mo = merge_values(v.reshape(KV * hd, D1), o.permute(1, 0, 2).reshape(hidden, H * hd), cov,
                          num_heads=H, num_kv_heads=KV, target_kv_heads=1, head_dim=hd)
    return mv, mo.reshape(hidden, H, hd).permute(1, 0, 2)
