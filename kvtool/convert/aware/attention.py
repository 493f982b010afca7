"""Reference causal attention for calibration: per-head contexts from explicit weights.

Written out (not transformers' kernels) because calibration needs the pieces: per-head contexts
before o_proj, and a differentiable path for refinement. RoPE uses transformers' own cos/sin for
the layer (rope scaling, local/global theta), in the rotate_half layout over the first
`cos.shape[-1]` dims of each head; the rest of a head is not rotated (partial rotary).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class LayerInputs:
    """One layer's attention input over the calibration batch: x [B, T, hidden] (from the converted
    layers before this one), cos/sin [B, T, r]."""

    x: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    x_target: torch.Tensor | None = None  # the original model's input to this layer, when the target is its output


@dataclass
class Proj:
    """Attention projections of one layer in transformers' layout (biases may be None)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None

    def to(self, dtype) -> "Proj":
        return Proj(*(None if t is None else t.to(dtype) for t in (getattr(self, f) for f in PROJ_FIELDS)))

    @classmethod
    def of(cls, tensors) -> "Proj":
        """From a mapping field name -> tensor (missing fields: None)."""
        return cls(**{f: tensors.get(f) for f in PROJ_FIELDS})

    def tensors(self) -> dict[str, torch.Tensor]:
        """field name -> tensor, the fields that are set."""
        return {f: t for f in PROJ_FIELDS if (t := getattr(self, f)) is not None}


PROJ_FIELDS = tuple(f.name for f in fields(Proj))


def _linear(x, w, b):
    y = x @ w.T
    return y if b is None else y + b


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, hd]; rotate the first r = cos.shape[-1] dims (rotate_half layout)."""
    r = cos.shape[-1]
    if r == 0:
        return x
    cos, sin = cos.unsqueeze(1).to(x.dtype), sin.unsqueeze(1).to(x.dtype)
    rot, rest = x[..., :r], x[..., r:]
    a, b = rot[..., : r // 2], rot[..., r // 2:]
    rotated = rot * cos + torch.cat((-b, a), dim=-1) * sin
    return torch.cat((rotated, rest), dim=-1) if rest.shape[-1] else rotated


def causal_bias(T: int, window: int | None, device, dtype) -> torch.Tensor:
    """Additive mask [T, T]: 0 where key s may be read by query t (s <= t, within the window)."""
    t = torch.arange(T, device=device)
    ok = t[None, :] <= t[:, None]
    if window:
        ok &= (t[:, None] - t[None, :]) < window
    return torch.zeros(T, T, device=device, dtype=dtype).masked_fill(~ok, float("-inf"))


def head_contexts(inp: LayerInputs, p: Proj, num_heads: int, head_dim: int) -> torch.Tensor:
    """Per-head attention contexts [B, T, H*hd] (what o_proj reads), computed in p's dtype."""
    x = inp.x.to(p.q.dtype)
    B, T, _ = x.shape
    # k and v may have different head counts (diagnostics merge one and keep the other)
    kh, vh = p.k.shape[0] // head_dim, p.v.shape[0] // head_dim
    q = _linear(x, p.q, p.q_bias).view(B, T, num_heads, head_dim).transpose(1, 2)
    k = _linear(x, p.k, p.k_bias).view(B, T, kh, head_dim).transpose(1, 2)
    v = _linear(x, p.v, p.v_bias).view(B, T, vh, head_dim).transpose(1, 2)
    q, k = apply_rope(q, inp.cos, inp.sin), apply_rope(k, inp.cos, inp.sin)
    if inp.softcap or kh != vh:
        k, v = k.repeat_interleave(num_heads // kh, dim=1), v.repeat_interleave(num_heads // vh, dim=1)
        s = (q @ k.transpose(-1, -2)) * inp.scaling
        if inp.softcap:
            s = torch.tanh(s / inp.softcap) * inp.softcap
        s = s + causal_bias(T, inp.sliding_window, x.device, s.dtype)
        ctx = torch.softmax(s, dim=-1) @ v  # [B, H, T, hd]
    else:
        # the fused kernel (forward and backward) is what makes --refine-steps affordable on a CPU
        mask = None if not inp.sliding_window else causal_bias(T, inp.sliding_window, x.device, q.dtype)
        ctx = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                               scale=inp.scaling, enable_gqa=kh != num_heads)
    return ctx.transpose(1, 2).reshape(B, T, num_heads * head_dim)


def attention_output(inp: LayerInputs, p: Proj, num_heads: int, head_dim: int) -> torch.Tensor:
    """o_proj(contexts) [B, T, hidden]."""
    return _linear(head_contexts(inp, p, num_heads, head_dim), p.o, p.o_bias)
