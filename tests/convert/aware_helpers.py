"""Helpers shared by the --method aware tests: CLI conversion, logits of a written checkpoint, and the
aware-vs-mean comparison on held-out text."""

from __future__ import annotations

import torch

from kvtool.cli import main


def convert(src, dst, *args) -> int:
    return main(["convert", str(src), str(dst), "--no-eval", "--no-progress", *args])


def logits(folder, ids):
    """(logits, config) of a checkpoint that must load with no missing or unexpected keys."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


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
