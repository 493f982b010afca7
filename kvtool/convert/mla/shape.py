"""The dimensions of one converted MLA attention block (DeepSeek-V2/V3 layout, `q_lora_rank` null).

Per token and layer the engine caches `kv_lora_rank` latent dimensions plus one shared RoPE key of
`qk_rope_head_dim` dimensions; every query head reads keys of `qk_nope_head_dim + qk_rope_head_dim` and values of
`v_head_dim` dimensions from them. Weight shapes (transformers `DeepseekV3Attention.__init__`):

- q_proj:             [num_heads * (qk_nope_head_dim + qk_rope_head_dim), hidden_size]
- kv_a_proj_with_mqa: [kv_lora_rank + qk_rope_head_dim, hidden_size]
- kv_a_layernorm:     [kv_lora_rank]
- kv_b_proj:          [num_heads * (qk_nope_head_dim + v_head_dim), kv_lora_rank]
- o_proj:             [hidden_size, num_heads * v_head_dim]
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MlaShape:
    """Dimensions of the MLA block a GQA/MHA attention block is converted to."""

    hidden_size: int
    num_heads: int  # query heads, unchanged by the conversion
    kv_lora_rank: int  # latent dimensions cached per token and layer
    qk_rope_head_dim: int  # the shared RoPE key, cached beside the latent
    qk_nope_head_dim: int  # per-head key dimensions read from the latent
    v_head_dim: int  # per-head value dimensions read from the latent

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def cached_dims(self) -> int:
        """Dimensions cached per token and layer (vLLM's MLA cache: one latent row, no separate V)."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def weight_shapes(self) -> dict[str, tuple[int, int] | tuple[int]]:
        """Shape of each attention weight, by its name under `self_attn.`."""
        h = self.num_heads
        return {
            "q_proj.weight": (h * self.qk_head_dim, self.hidden_size),
            "kv_a_proj_with_mqa.weight": (self.cached_dims, self.hidden_size),
            "kv_a_layernorm.weight": (self.kv_lora_rank,),
            "kv_b_proj.weight": (h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),
            "o_proj.weight": (self.hidden_size, h * self.v_head_dim),
        }
