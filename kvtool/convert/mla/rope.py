"""The source's RoPE and the part of it an MLA block keeps rotating.

A GQA key rotates in each of its `rotary_dim / 2` pairs; an MLA key rotates only in the shared
`qk_rope_head_dim` part, whose frequencies transformers' DeepseekV3RotaryEmbedding derives from the
converted config's `rope_theta` and `qk_rope_head_dim` alone: pair t turns by theta'^(-2t / d_r) per
position. The source's first d_r / 2 pairs (its highest frequencies, theta^(-2t / rotary_dim)) are
exactly that sequence for theta' = theta^(d_r / rotary_dim), so the shared rope key takes them and
the converted model rotates them as the source did. Lower-frequency pairs go to the latent as NoPE:
those that barely turn over the served context (`static_pairs`) keep most of their score there; the
rest are dropped or kept unrotated (`SolveOptions.rotating_pairs`, docs/convert-mla.md, Quality).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SourceRope:
    """The source model's RoPE as its config states it: theta, the head's rotated dims (partial rotary: fewer
    than head_dim), neox (rotate_half pairs (i, i + r/2); False: interleaved (2i, 2i+1)), rope scaling."""

    theta: float
    head_dim: int
    rotary_dim: int
    neox: bool = True
    scaling: dict | None = None  # the source's rope_parameters / rope_scaling past theta, None for "default"

    @property
    def pairs(self) -> int:
        return self.rotary_dim // 2

    def pair_angles(self) -> torch.Tensor:
        """float64 [pairs]: radians each pair turns per position (default RoPE)."""
        return self.theta ** (-torch.arange(self.pairs, dtype=torch.float64) * 2 / self.rotary_dim)

    @classmethod
    def of_config(cls, config: dict) -> "SourceRope":
        """From a source config.json (text config): rope_theta / rope_parameters, head_dim, partial_rotary_factor."""
        params = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
        theta = float(params.pop("rope_theta", config.get("rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        head_dim = int(config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"])
        rotary = int(head_dim * float(params.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0))))
        return cls(theta=theta, head_dim=head_dim, rotary_dim=rotary,
                   scaling=None if kind == "default" else params)


def rope_pairs(rope: SourceRope, qk_rope_head_dim: int) -> torch.Tensor:
    """long [qk_rope_head_dim / 2]: the source pairs the shared rope key takes (the highest frequencies)."""
    if qk_rope_head_dim % 2 or not 0 <= qk_rope_head_dim <= rope.rotary_dim:
        raise ValueError(f"qk_rope_head_dim {qk_rope_head_dim}: an even number up to the rotary dims {rope.rotary_dim}")
    return torch.arange(qk_rope_head_dim // 2)


def mla_rope_parameters(rope: SourceRope, qk_rope_head_dim: int) -> dict:
    """The converted config's RoPE: `rope_parameters` under which DeepSeek's rotary embedding of qk_rope_head_dim
    dims turns pair t as the source turns pair t, and `rope_interleave` true (solve_layer writes the rope rows in
    DeepSeek's interleaved pair order; vLLM 0.33.0 always rotates them so: vllm/model_executor/models/deepseek_v2.py,
    DeepseekV2MLAAttention.__init__, get_rope(..., is_neox_style=False)).

    Only default RoPE carries over: the same function rewrites any other rope_type to deepseek_yarn or
    deepseek_llama_scaling, and a scaled source's frequencies are no geometric series DeepSeek's default gives."""
    if rope.scaling:
        kind = rope.scaling.get("rope_type", rope.scaling.get("type"))
        raise ValueError(f"source rope_type {kind!r}: only default RoPE carries over to the shared rope key")
    from kvtool.convert.mla.config import rope_theta  # the one formula (the dry run shows it without torch)

    theta = rope_theta(rope.theta, qk_rope_head_dim, rope.rotary_dim) if qk_rope_head_dim else rope.theta
    return {"rope_parameters": {"rope_theta": theta, "rope_type": "default"}, "rope_interleave": True}


def static_pairs(rope: SourceRope, horizon: int, angle: float) -> torch.Tensor:
    """bool [pairs]: pairs turning by less than `angle` radians over `horizon` positions (kept as NoPE)."""
    return rope.pair_angles() * horizon < angle
