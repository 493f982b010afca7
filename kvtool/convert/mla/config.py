"""config.json of a GQA/MHA model converted to MLA: DeepSeek-V3's layout, every layer dense.

Read by transformers' `DeepseekV3Config` (no remote code) and vLLM 0.33.0's `DeepseekV2ForCausalLM`
(vllm/model_executor/models/deepseek_v2.py, registered for DeepseekV3ForCausalLM). What each key is for:

- q_lora_rank null: queries from one q_proj (no q_a_proj / q_b_proj).
- first_k_dense_replace = num_hidden_layers: `DeepseekV2DecoderLayer.__init__` builds a MoE only where
  `layer_idx >= first_k_dense_replace` (transformers `DeepseekV3DecoderLayer.__init__` likewise), so every layer
  keeps the source's dense MLP (intermediate_size). n_routed_experts must still be an integer:
  `DeepseekV2Model.load_weights` adds it to n_shared_experts for its expert mapping (None raises).
- tie_word_embeddings false and lm_head.weight written: `DeepseekV2ForCausalLM.__init__` builds its own
  ParallelLMHead and never ties it to the embeddings.
- rope: rope_theta is the source's raised to qk_rope_head_dim / head_dim, so that the rope part turns as the
  source's fastest pairs did (`rope_theta`); only the default type converts (vLLM's `DeepseekV2MLAAttention.__init__` turns any other rope_type into
  deepseek_yarn / deepseek_llama_scaling); rope_interleave true, as vLLM always rotates GPT-J pairs
  (kvtool/convert/mla/layout.py).
- attention_bias false: vLLM's MLA projections have no bias.
- num_nextn_predict_layers 0: no multi-token-prediction layer.
"""

from __future__ import annotations

# Carried over from the source config as they are, when present (DeepseekV3Config takes each of them).
CARRIED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "hidden_act",
           "max_position_embeddings", "initializer_range", "rms_norm_eps", "use_cache", "bos_token_id",
           "eos_token_id", "pad_token_id", "attention_dropout", "dtype", "torch_dtype")


def rope_theta(source_theta: float, rope_dim: int, rotary_dim: int) -> float:
    """The converted config's rope_theta: DeepSeek's rotary embedding turns pair t of the rope part by
    theta'^(-2t / rope_dim), which is the source's pair t (theta^(-2t / rotary_dim)) for theta' =
    theta^(rope_dim / rotary_dim). The solve gives the rope part the source's first rope_dim / 2 pairs (its highest
    frequencies): kvtool.convert.mla.rope.rope_pairs / mla_rope_parameters, whose default-RoPE case this is."""
    return float(source_theta) ** (rope_dim / rotary_dim)


def mla_config(source: dict, spec, shape, *, rope_theta: float, dtype_name: str | None = None) -> dict:
    """The DeepSeek-V3 config.json of the converted model. source: the source config; spec: its ModelSpec;
    shape: the kvtool.convert.mla.shape.MlaShape; rope_theta: the rope part's (`rope_theta` above)."""
    L = int(spec.num_layers)
    out: dict = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    for key in CARRIED:
        if key in source:
            out[key] = source[key]
    out.update({
        "hidden_size": shape.hidden_size,
        "num_hidden_layers": L,
        "num_attention_heads": shape.num_heads,
        # transformers repeats K/V per query head from num_attention_heads // num_key_value_heads; MLA expands
        # every head from the latent itself
        "num_key_value_heads": shape.num_heads,
        "q_lora_rank": None,
        "kv_lora_rank": shape.kv_lora_rank,
        "qk_rope_head_dim": shape.qk_rope_head_dim,
        "qk_nope_head_dim": shape.qk_nope_head_dim,
        "v_head_dim": shape.v_head_dim,
        "first_k_dense_replace": L,
        "n_routed_experts": 1,
        "n_shared_experts": 0,
        "num_experts_per_tok": 1,
        "n_group": 1,
        "topk_group": 1,
        "moe_intermediate_size": int(spec.number("intermediate_size") or 1),
        "num_nextn_predict_layers": 0,
        "rope_theta": rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "rope_interleave": True,
        "attention_bias": False,
        "tie_word_embeddings": False,
    })
    if dtype_name:
        for key in ("dtype", "torch_dtype"):
            if key in out:
                out[key] = dtype_name
    return out
