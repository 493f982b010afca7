"""Train a small MHA llama on kvtool's calibration text (pydoc topics), for the head-merging benchmark.

A trained model has the correlated heads that real checkpoints have (random ones do not), so it is a
fair test of halving the KV heads without retraining. It uses SmolLM2's tokenizer (the calibration
and evaluation code tokenizes text) and trains only on the calibration part of the text; the
benchmark evaluates on the disjoint evaluation part.

    python bench/train_tiny_mha.py OUT [--minutes 6] [--seed 0]
"""

from __future__ import annotations

import argparse
import math
import shutil
import time
from pathlib import Path

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from kvtool.testing.fixtures import smollm2_dir
from kvtool.testing.text import calibration_text


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=6.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    a = ap.parse_args()
    torch.manual_seed(a.seed)
    tok_dir = smollm2_dir()
    tok = AutoTokenizer.from_pretrained(tok_dir)
    ids = torch.tensor(tok(calibration_text(), add_special_tokens=False)["input_ids"])
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=24, max_position_embeddings=1024,
                      tie_word_embeddings=True, rope_theta=10000.0, bos_token_id=tok.bos_token_id,
                      eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01, betas=(0.9, 0.95))
    t0, step, budget = time.time(), 0, a.minutes * 60
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        for g in opt.param_groups:  # warmup then cosine, on wall time
            g["lr"] = 3e-3 * min(1.0, (step + 1) / 30) * 0.5 * (1 + math.cos(math.pi * frac))
        starts = torch.randint(0, len(ids) - a.seq - 1, (a.batch,))
        x = torch.stack([ids[s: s + a.seq] for s in starts.tolist()])
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        if step % 25 == 0:
            print(f"step {step} loss {loss.item():.3f} ({time.time() - t0:.0f}s)", flush=True)
    a.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(a.out)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (tok_dir / f).exists():
            shutil.copy(tok_dir / f, a.out / f)
    print(f"saved {a.out} after {step} steps, last loss {loss.item():.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
