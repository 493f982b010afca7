"""Fused QKV layouts: split one tensor into q, k, v rows and fuse them back (table `qkv_layout`).

Rows are what differ between layouts (trailing dims, e.g. `hidden` of a weight, ride along):
- concat: [q (H*hd) | k (KV*hd) | v (KV*hd)]                       phi3 qkv_proj, bigcode MQA
- grouped / falcon: per KV group, the group's H/KV query heads then one k and one v head:
          [KV, H/KV + 2, hd]                      internlm2 wqkv, falcon (new arch; multi_query is KV = 1)
- bloom / neox: per head [q, k, v]: [H, 3, hd], MHA only           bloom, gpt_neox, bigcode MHA
- bigcode: concat when there is one KV head (multi_query), else the per-head layout
"""

from __future__ import annotations

from typing import Any

# Works on torch tensors and numpy arrays alike (the mean method runs on numpy, without torch).
Array = Any


def _cat(parts: list, axis: int) -> Array:
    if type(parts[0]).__module__.startswith("numpy"):
        import numpy as np

        return np.concatenate(parts, axis=axis)
    import torch

    return torch.cat(parts, dim=axis).contiguous()


def _per_head_layout(layout: str, kv: int) -> bool:
    return layout in ("bloom", "neox") or (layout == "bigcode" and kv != 1)


def split_qkv(layout: str, t: Array, H: int, KV: int, hd: int):
    """-> (q [H*hd, ...], k [KV*hd, ...], v [KV*hd, ...])."""
    rest = tuple(t.shape[1:])
    if t.shape[0] != (H + 2 * KV) * hd:
        raise ValueError(f"fused qkv has {t.shape[0]} rows, expected (H + 2*KV) * head_dim = {(H + 2 * KV) * hd}")
    if layout in ("concat", "bigcode") and not _per_head_layout(layout, KV):
        return t[:H * hd], t[H * hd:(H + KV) * hd], t[(H + KV) * hd:]
    if layout in ("falcon", "grouped"):
        r = H // KV
        g = t.reshape(KV, r + 2, hd, *rest)
        q = g[:, :r].reshape(H * hd, *rest)
        k = g[:, r].reshape(KV * hd, *rest)
        v = g[:, r + 1].reshape(KV * hd, *rest)
        return q, k, v
    if _per_head_layout(layout, KV):
        if KV != H:
            raise ValueError(f"layout {layout!r} has one K and V per query head; got {H} heads, {KV} KV heads")
        g = t.reshape(H, 3, hd, *rest)
        return (g[:, 0].reshape(H * hd, *rest), g[:, 1].reshape(H * hd, *rest), g[:, 2].reshape(H * hd, *rest))
    raise ValueError(f"unknown qkv layout {layout!r}")


def fuse_qkv(layout: str, q: Array, k: Array, v: Array, H: int, KV: int, hd: int):
    """Inverse of split_qkv for KV heads (the new count)."""
    rest = tuple(q.shape[1:])
    if layout in ("concat", "bigcode") and not _per_head_layout(layout, KV):
        return _cat([q, k, v], 0)
    if layout in ("falcon", "grouped"):
        r = H // KV
        qg = q.reshape(KV, r, hd, *rest)
        kg = k.reshape(KV, 1, hd, *rest)
        vg = v.reshape(KV, 1, hd, *rest)
        return _cat([qg, kg, vg], 1).reshape((H + 2 * KV) * hd, *rest)
    if _per_head_layout(layout, KV):
        if KV != H:
            raise ValueError(f"layout {layout!r} cannot hold {KV} KV heads for {H} query heads")
        parts = [x.reshape(H, 1, hd, *rest) for x in (q, k, v)]
        return _cat(parts, 1).reshape(3 * H * hd, *rest)
    raise ValueError(f"unknown qkv layout {layout!r}")
