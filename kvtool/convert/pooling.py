"""Where K/V heads are pooled: mean pooling (GQA paper, Ainslie et al. 2023) and exact expansion.

KV heads are contiguous blocks of `head_dim` rows in k_proj / v_proj (and their biases). Going
from KV to G = target_kv_heads heads (G divides KV), new head j is the mean of old heads j*r .. j*r + r - 1,
r = KV / G: exactly the heads that the query heads of new group j read, because query head h
reads KV head h // (H / KV) (transformers' repeat_kv). Going up (KV divides G, e.g. --to mha),
new head j is a copy of old head j // (G / KV): the model computes exactly the same function.

Means are taken in float64 for 32/64-bit tensors and float32 for 16-bit ones, then cast back;
this makes expand-then-pool bit-exact (r equal values sum exactly in the wider dtype, and r*x / r is x).
(numpy: in float64, rounded to float32, then to the stored dtype; BF16 storage arrays are pooled
block by block by kvtool.io.arrays with exactly that result, without a whole-array float copy.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool.convert.methods import MergeMethod, register_method

if TYPE_CHECKING:
    from kvtool.convert.layout import AttentionWeights


def _acc_dtype(dtype):
    import torch

    return torch.float64 if dtype in (torch.float32, torch.float64) else torch.float32


def _is_numpy(t) -> bool:
    return type(t).__module__.startswith("numpy")


def pool_heads(t, num_kv_heads: int, target_kv_heads: int, head_dim: int, storage: str | None = None):
    """Rows of `t` grouped as [num_kv_heads, head_dim, ...] -> [target_kv_heads, head_dim, ...].

    target_kv_heads < num_kv_heads: mean over contiguous groups; target_kv_heads > num_kv_heads: repeat each head;
    equal: `t` itself. `t` is a torch tensor or a float numpy array (means in float64 there), or
    with `storage="BF16"` a BF16 storage array (uint16), pooled to the same bits as the float path.
    """
    if target_kv_heads == num_kv_heads:
        return t
    rest = tuple(t.shape[1:])
    if t.shape[0] != num_kv_heads * head_dim:
        raise ValueError(f"{t.shape[0]} rows do not split into {num_kv_heads} heads of {head_dim}")
    if target_kv_heads < num_kv_heads and num_kv_heads % target_kv_heads:
        raise ValueError(f"cannot pool {num_kv_heads} KV heads into {target_kv_heads} groups")
    if target_kv_heads > num_kv_heads and target_kv_heads % num_kv_heads:
        raise ValueError(f"cannot expand {num_kv_heads} KV heads into {target_kv_heads}")
    heads = t.reshape(num_kv_heads, head_dim, *rest)
    if storage is not None:
        if storage != "BF16" or not _is_numpy(t):
            raise ValueError(f"no storage-array pooling for {storage}")
        from kvtool.io.arrays import mean_groups_bf16, repeat_groups_bf16

        if target_kv_heads < num_kv_heads:
            out = mean_groups_bf16(heads.reshape(target_kv_heads, num_kv_heads // target_kv_heads, -1))
        else:
            out = repeat_groups_bf16(heads, target_kv_heads // num_kv_heads)
        return out.reshape(target_kv_heads * head_dim, *rest)
    if _is_numpy(t):
        import numpy as np

        if target_kv_heads < num_kv_heads:
            r = num_kv_heads // target_kv_heads
            grouped = heads.reshape(target_kv_heads, r, head_dim, *rest)
            acc = grouped[:, 0].astype(np.float64)
            for i in range(1, r):  # elementwise adds: much faster than a reduction over a middle axis
                acc += grouped[:, i]
            out = (acc / r).astype(t.dtype)
        else:
            out = np.repeat(heads, target_kv_heads // num_kv_heads, axis=0)
        return np.ascontiguousarray(out.reshape(target_kv_heads * head_dim, *rest))
    if t.is_meta:  # shape-only use
        return t.new_empty((target_kv_heads * head_dim, *rest))
    if target_kv_heads < num_kv_heads:
        grouped = heads.reshape(target_kv_heads, num_kv_heads // target_kv_heads, head_dim, *rest)
        out = grouped.mean(dim=1, dtype=_acc_dtype(t.dtype)).to(t.dtype)
    else:
        out = heads.repeat_interleave(target_kv_heads // num_kv_heads, dim=0)
    return out.reshape(target_kv_heads * head_dim, *rest).contiguous()


def mean_pool(w: "AttentionWeights") -> "AttentionWeights":
    """Pool (or expand) k, v, their biases and an all-heads k_norm to `w.target_kv_heads` KV heads."""
    target_kv_heads, KV, hd = w.target_kv_heads, w.num_kv_heads, w.head_dim

    def p(t):
        return None if t is None else pool_heads(t, KV, target_kv_heads, hd, w.storage)

    k_norm = w.k_norm
    if k_norm is not None and w.norm_scope == "all":
        # One weight per channel of the whole K projection: pooled like the rows it scales. The
        # RMS it divides by now spans fewer heads, so the result is approximate when pooling.
        k_norm = p(k_norm)
    return w.with_(k=p(w.k), v=p(w.v), k_bias=p(w.k_bias), v_bias=p(w.v_bias), k_norm=k_norm,
                   num_kv_heads=target_kv_heads)


@register_method("mean")
class MeanPooling(MergeMethod):
    """Mean of the K/V heads in each group (no data needed); copies heads when expanding."""

    approximate = True
    array_api = "numpy"  # no torch import: it would cost more than the pooling itself
    reads = frozenset({"k", "v", "k_bias", "v_bias", "k_norm"})  # q and o are copied file to file
    storage_dtypes = ("BF16",)

    def summary(self) -> str:
        return "mean of each group's K/V heads (approximate without retraining)"

    def estimate(self, plan, shape):
        from kvtool.model import costs

        return costs.convert_mean(shape)

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        return mean_pool(w)
