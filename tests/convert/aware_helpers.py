"""Helpers shared by the --method aware tests: CLI conversion, logits of a written checkpoint, and the
aware-vs-mean comparison on held-out text."""

from __future__ import annotations

import shutil

import torch

from kvtool.cli import main

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def convert(src, dst, *args) -> int:
    return main(["convert", str(src), str(dst), "--no-eval", "--no-progress", *args])


def logits(folder, ids):
    """(logits, config) of a checkpoint that must load with no missing or unexpected keys."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


def tiny_model(folder, model_type, tokenizer_dir, kv_heads=2, seed=0):
    """A tiny random model with 4 query heads that shares SmolLM2's tokenizer (the calibration needs one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, vocab_size=49152,
                               max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger attention weights than the init, so attention is far from uniform
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.mul_(8.0 if name.endswith("weight") else 1.0).add_(torch.randn_like(p) * 0.1 if "bias" in name else 0)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def mqa_errors(src, work) -> tuple[float, float]:
    """Mean squared logit error against src of its MQA conversions (aware, mean) on 256 held-out tokens
    (the calibration reads the other part of the built-in text)."""
    from transformers import AutoTokenizer

    from kvtool.testing.text import evaluation_text

    assert convert(src, work / "aware", "--to", "mqa", "--method", "aware", "--calib-tokens", "512") == 0
    assert convert(src, work / "mean", "--to", "mqa") == 0
    ids = torch.tensor(AutoTokenizer.from_pretrained(src)(evaluation_text())["input_ids"][:256]).unsqueeze(0)
    want, _ = logits(src, ids)
    aware, cfg = logits(work / "aware", ids)
    mean, _ = logits(work / "mean", ids)
    assert cfg.num_key_value_heads == 1 and torch.isfinite(aware).all()
    return float((aware - want).pow(2).mean()), float((mean - want).pow(2).mean())
