"""Probe (not a kvtool option): end-to-end logit distillation after `kvtool convert --method aware`.

Issue 17 asks whether a few steps of KL(original || converted) on the next-token distributions, training only
the attention projections (q/k/v/o) of the converted model, carry further than per-layer reconstruction. This
script answers it on a small model; it loads both models whole (float32), so it is not how kvtool would ship it.

    python bench/distill_probe.py ORIGINAL CONVERTED OUT [--steps 24] [--lr 1e-5] [--tokens 4096] [--seq-len 1024]

Calibration: the same `mixed` tokens as `kvtool convert` (kvtool.convert.aware.calibration). The result in OUT
is a checkpoint for `kvtool eval OUT --baseline ORIGINAL --text FILE`.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("original", type=Path)
    ap.add_argument("converted", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--dataset", default="mixed")
    a = ap.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtool.convert.aware.calibration import calibration_batch, calibration_sources

    tok = AutoTokenizer.from_pretrained(a.original)
    ids = calibration_batch(tok, calibration_sources(None, a.dataset), a.tokens, a.seq_len, None)
    teacher = AutoModelForCausalLM.from_pretrained(a.original, dtype=torch.float32).eval()
    student = AutoModelForCausalLM.from_pretrained(a.converted, dtype=torch.float32)
    for p in teacher.parameters():
        p.requires_grad_(False)
    trained = []
    for name, p in student.named_parameters():
        keep = ".self_attn." in name
        p.requires_grad_(keep)
        if keep:
            trained.append(p)
    opt = torch.optim.Adam(trained, lr=a.lr)
    t0 = time.perf_counter()
    for step in range(a.steps):
        x = ids[step % ids.shape[0]][None]
        with torch.no_grad():
            t_logp = torch.log_softmax(teacher(x).logits.float(), -1)
        s_logp = torch.log_softmax(student(x).logits.float(), -1)
        loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"step {step + 1}/{a.steps}  KL {float(loss):.4f}  {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    student.save_pretrained(a.out)
    for f in a.converted.iterdir():
        if f.name.startswith("tokenizer") or f.name in ("chat_template.jinja", "generation_config.json"):
            shutil.copy(f, a.out / f.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())
