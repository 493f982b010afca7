"""Rebuild the bundled example checkpoints (tiny, randomly initialised, seeded).

    python examples/build.py

Each folder is a complete Hugging Face checkpoint that transformers loads: config.json,
generation_config.json, model.safetensors and a 256-token character-level tokenizer. They exist
to show kvtool's commands on real files in seconds (`kvtool lint examples/*/`), not to generate
sensible text. Needs torch and transformers; kvtool itself does not to lint them.
"""

from __future__ import annotations

import shutil
import string
from pathlib import Path

HERE = Path(__file__).resolve().parent
VOCAB = 256

COMMON = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

EXAMPLES = {
    # Llama layout with grouped-query attention: 8 query heads share 2 KV heads.
    "llama-gqa-tiny": ("LlamaConfig", "LlamaForCausalLM", {
        **COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 8,
        "num_key_value_heads": 2, "max_position_embeddings": 2048, "rope_theta": 10000.0,
        "tie_word_embeddings": False}),
    # Gemma-3 text layout: sliding-window layers with one global layer, explicit head_dim.
    "gemma3-sliding-tiny": ("Gemma3TextConfig", "Gemma3ForCausalLM", {
        **COMMON, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 1, "head_dim": 32, "max_position_embeddings": 4096, "sliding_window": 512,
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"]}),
    # DeepSeek-V3 layout: multi-head latent attention and routed + shared experts; a cached row of kv_lora_rank 304 +
    # qk_rope_head_dim 16 = 320 values, one vLLM serves (lint's KV404: schemas/engines/mla_backends.json).
    "deepseek-mla-tiny": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        **COMMON, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 304, "q_lora_rank": None,
        "qk_rope_head_dim": 16, "qk_nope_head_dim": 16, "v_head_dim": 16, "n_routed_experts": 4,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
        "max_position_embeddings": 4096, "tie_word_embeddings": False}),
}


def tokenizer_files(folder: Path) -> None:
    """A character-level WordLevel tokenizer: 3 specials + printable ASCII, padded to VOCAB ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    for c in chars:
        vocab.setdefault(c, len(vocab))
    for i in range(len(vocab), VOCAB):
        vocab[f"<extra_{i}>"] = i
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", model_max_length=2048)
    fast.save_pretrained(folder)


def build() -> None:
    import torch
    import transformers

    for name, (cfg_cls, model_cls, kwargs) in EXAMPLES.items():
        folder = HERE / name
        shutil.rmtree(folder, ignore_errors=True)
        torch.manual_seed(0)
        config = getattr(transformers, cfg_cls)(**kwargs)
        config.dtype = torch.bfloat16
        model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
        model.generation_config.max_new_tokens = 32
        model.save_pretrained(folder)
        tokenizer_files(folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{name}: {size / 1024:.0f} KiB")


if __name__ == "__main__":
    build()
