"""Where the two engines read the written checkpoint differently (tabled in docs/convert-mla.md)."""

from __future__ import annotations

from pathlib import Path

DATA = Path(__file__).resolve().parents[2] / "data" / "vllm" / "0.33.0"


def test_latent_norm_epsilon_differs_between_engines():
    """vLLM 0.33 gives kv_a_layernorm the config's rms_norm_eps; transformers keeps DeepseekV3RMSNorm's 1e-6."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    cfg = DeepseekV3Config(hidden_size=64, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None,
                           kv_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                           rms_norm_eps=1e-5, num_hidden_layers=1, vocab_size=16, intermediate_size=32)
    attn = DeepseekV3Attention(cfg, 0)
    assert attn.kv_a_layernorm.variance_epsilon == 1e-6 != cfg.rms_norm_eps
    vllm = (DATA / "vllm__model_executor__models__deepseek_v2.py.txt").read_text()
    assert "self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=config.rms_norm_eps)" in vllm
