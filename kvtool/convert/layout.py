"""AttentionWeights: one layer's attention projections, unfused, in transformers' layout.

q [H*hd, hidden], k and v [KV*hd, hidden], o [hidden, H*hd]; optional biases (q/k/v [rows],
o [hidden]); q_norm / k_norm weights with their scope: "head" ([hd], shared by every head, so
untouched by pooling) or "all" ([H*hd] / [KV*hd], one weight per channel of the projection, as in
olmo2). Query head h reads KV head h // (H / KV) (transformers' `repeat_kv`). Merge methods take
and return this; the convert driver splits fused tensors into it and re-fuses the result.
Tensors are torch tensors, or float numpy arrays for methods with `array_api = "numpy"` (storage
arrays of the safetensors dtype `storage`, e.g. BF16 as uint16, when that is set).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    import torch


@dataclass
class AttentionWeights:
    layer: int
    q: "torch.Tensor"
    k: "torch.Tensor"
    v: "torch.Tensor"
    o: "torch.Tensor"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    target_kv_heads: int  # KV heads wanted after the merge
    q_bias: Optional["torch.Tensor"] = None
    k_bias: Optional["torch.Tensor"] = None
    v_bias: Optional["torch.Tensor"] = None
    o_bias: Optional["torch.Tensor"] = None
    q_norm: Optional["torch.Tensor"] = None
    k_norm: Optional["torch.Tensor"] = None
    norm_scope: str = "head"  # head | all
    storage: Optional[str] = None  # numpy arrays hold this safetensors dtype's storage (kvtool.io.arrays)

    @property
    def target_groups(self) -> int:
        """The name `target_kv_heads` had before issue 30 (merge methods written against it keep working)."""
        return self.target_kv_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head now."""
        return self.num_heads // self.num_kv_heads

    def with_(self, **changes) -> "AttentionWeights":
        """A copy with some fields replaced (tensors are not copied)."""
        return replace(self, **changes)

    def check(self) -> None:
        """Raise ValueError when shapes disagree with the head counts (catches a wrong table early)."""
        H, KV, hd = self.num_heads, self.num_kv_heads, self.head_dim
        want = {"q": (H * hd, None), "k": (KV * hd, None), "v": (KV * hd, None), "o": (None, H * hd)}
        for name, (rows, cols) in want.items():
            t = getattr(self, name)
            if t.ndim != 2 or (rows is not None and t.shape[0] != rows) or (cols is not None and t.shape[1] != cols):
                raise ValueError(f"layer {self.layer}: {name} has shape {list(t.shape)}, expected "
                                 f"[{rows if rows is not None else 'hidden'}, {cols if cols is not None else 'hidden'}]"
                                 f" for {H} heads, {KV} KV heads, head_dim {hd}")
        for name, n in (("q_bias", H * hd), ("k_bias", KV * hd), ("v_bias", KV * hd)):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"layer {self.layer}: {name} has shape {list(t.shape)}, expected [{n}]")
        if self.k_norm is not None:
            n = hd if self.norm_scope == "head" else KV * hd
            if tuple(self.k_norm.shape) != (n,):
                raise ValueError(f"layer {self.layer}: k_norm has shape {list(self.k_norm.shape)}, expected [{n}]"
                                 f" (scope {self.norm_scope})")
