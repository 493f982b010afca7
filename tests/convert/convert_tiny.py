"""Tiny random checkpoints of every architecture `kvtool convert` supports (transformers from_config)."""

from __future__ import annotations

import json
from pathlib import Path

_COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128,
               max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

# model_type -> (config overrides, KV field name); KV heads are set per build.
ARCHS: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": None},
    "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1},
    "qwen2": {},
    "qwen2_moe": {"num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "qwen3": {"head_dim": 16},
    "qwen3_moe": {"head_dim": 16, "num_experts": 2, "num_experts_per_tok": 1, "moe_intermediate_size": 32},
    "gemma": {"head_dim": 16},
    "gemma2": {"head_dim": 16, "sliding_window": 8},
    "gemma3_text": {"head_dim": 16, "sliding_window": 8},
    "phi3": {},
    "starcoder2": {},
    "olmo2": {},
    "granite": {},
    "cohere": {"use_qk_norm": True},
    "falcon": {"new_decoder_architecture": True, "multi_query": False, "bias": True},
    "gpt_bigcode": {},
}

# Where the KV-head count goes for each build (gpt_bigcode: only MHA or MQA).
KV_KEY = {"falcon": "num_kv_heads", "gpt_bigcode": "multi_query"}


def config_kwargs(model_type: str, kv_heads: int) -> dict:
    """The config fields `build` gives transformers (no torch): also the configs the plan-parity corpus adds."""
    if model_type == "gpt_bigcode":
        return dict(n_embd=64, n_layer=2, n_head=4, n_inner=64, vocab_size=128, n_positions=256,
                    bos_token_id=1, eos_token_id=2, multi_query=kv_heads == 1, tie_word_embeddings=False)
    kw = {**_COMMON, **ARCHS[model_type]}
    kw[KV_KEY.get(model_type, "num_key_value_heads")] = kv_heads
    return kw


def build(model_type: str, folder: Path, *, kv_heads: int, seed: int = 0, dtype=None) -> Path:
    """Save a random tiny `model_type` with `kv_heads` KV heads (of 4 query heads) to `folder`."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **config_kwargs(model_type, kv_heads))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # non-trivial norms and biases, so pooling them is visible
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name or "ln" in name:
                p.add_(torch.randn_like(p) * 0.1)
    if dtype is not None:
        model = model.to(dtype)
    model.save_pretrained(folder)
    (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 256}))
    (folder / "chat_template.jinja").write_text("{{ messages }}")
    return folder


def load(folder: Path):
    """Load with transformers; returns (model, loading_info)."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    return model.eval(), info


def logits(model, tokens=None):
    import torch

    if tokens is None:
        tokens = torch.arange(3, 27).reshape(2, 12) % 128
    with torch.no_grad():
        return model(input_ids=tokens).logits


def state(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out
