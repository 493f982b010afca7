"""The closed-form merge of one layer's heads: keys (keys.merge_keys) and values (values.merge_values) into
`target_kv_heads` shared heads, the per-head maps folded into q and o, before the o refit. The layer merge
(merge.merge_layer) and the cost of a candidate group (grouping.GroupCost) both run it."""

from __future__ import annotations

import torch

from kvtool.convert.aware.attention import Proj
from kvtool.convert.aware.keys import merge_keys
from kvtool.convert.aware.linalg import augment
from kvtool.convert.aware.values import merge_values


def _split(w: torch.Tensor, keep_bias: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    return w[:, :-1].contiguous(), (w[:, -1].contiguous() if keep_bias else None)


def merge_heads(src: Proj, cov: torch.Tensor, *, num_heads: int, num_kv_heads: int, target_kv_heads: int,
                head_dim: int, rotary_dim: int, static: torch.Tensor | None = None,
                angles: torch.Tensor | None = None) -> Proj:
    """src (float64) -> float64 projections with `target_kv_heads` KV heads; biases kept where src has them, o's
    unchanged. cov: the augmented input covariance; static / angles: keys.merge_keys'."""
    wq, wk = merge_keys(augment(src.q, src.q_bias), augment(src.k, src.k_bias), cov, num_heads=num_heads,
                        num_kv_heads=num_kv_heads, target_kv_heads=target_kv_heads, head_dim=head_dim,
                        rotary_dim=rotary_dim, static=static, angles=angles)
    wv, o = merge_values(augment(src.v, src.v_bias), src.o, cov, num_heads=num_heads, num_kv_heads=num_kv_heads,
                         target_kv_heads=target_kv_heads, head_dim=head_dim)
    q, q_bias = _split(wq, src.q_bias is not None)
    k, k_bias = _split(wk, src.k_bias is not None)
    v, v_bias = _split(wv, src.v_bias is not None)
    return Proj(q=q, k=k, v=v, o=o, q_bias=q_bias, k_bias=k_bias, v_bias=v_bias, o_bias=src.o_bias)
