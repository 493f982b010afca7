"""Train a tiny llama-architecture MHA model on the built-in calibration text, for a bounded time.

Gives `kvtool convert --method aware` a model that was genuinely trained with one KV head per query
head (issue 6: "a trained MHA model halved to GQA"). Trains on kvtool.testing.text.calibration_text()
only, so the built-in evaluation text of `kvtool eval` stays held out.

    python bench/train_tiny_mha.py OUT --minutes 6 --threads 1
    python bench/train_tiny_mha.py OUT --steps 251 --threads 1   # the same model, however busy the machine

With --minutes the schedule follows the clock, so two machines (or a busy one) train different models: two
8-to-14-minute trainings of 251 and 255 steps merged at +3.0% and +2.0% (docs/convert-quality.md). --steps
makes the schedule and the stopping point a step count: the same model for the same seed, torch build, kind
of CPU and thread count, however busy the machine.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--minutes", type=float, default=6.0, help="training time budget")
    ap.add_argument("--steps", type=int, default=None,
                    help="train exactly this many optimizer steps instead (the schedule follows steps, not --minutes)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        ap.error(f"--steps must be >= 1, got {args.steps}")

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kvtool.testing.fixtures import smollm2_dir
    from kvtool.testing.text import calibration_text

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    device = "cuda" if torch.cuda.is_available() else "cpu"

    tok = AutoTokenizer.from_pretrained(smollm2_dir())
    ids = torch.tensor(tok(calibration_text())["input_ids"], dtype=torch.long)
    n_seq = len(ids) // args.seq
    data = ids[: n_seq * args.seq].view(n_seq, args.seq)
    print(f"{len(ids)} training tokens, {n_seq} sequences of {args.seq}, device {device}")

    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=args.hidden,
        intermediate_size=4 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        head_dim=args.hidden // args.heads,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
    )
    model = LlamaForCausalLM(config).to(device)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    budget = args.minutes * 60.0
    start = time.perf_counter()
    step, last_print, ema = 0, 0.0, None
    gen = torch.Generator().manual_seed(args.seed)
    def done_share() -> float:  # the share of the budget spent: steps, or else the clock
        if args.steps is not None:
            return step / args.steps
        return (time.perf_counter() - start) / budget

    while done_share() < 1.0:
        # Warmup, then cosine decay over the rest of the budget.
        elapsed = time.perf_counter() - start
        warm = min(1.0, (step + 1) / args.warmup)
        decay = 0.5 * (1 + math.cos(math.pi * min(1.0, done_share())))
        for g in opt.param_groups:
            g["lr"] = args.lr * warm * max(0.05, decay)
        batch = data[torch.randint(0, n_seq, (args.batch,), generator=gen)].to(device)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        if elapsed - last_print >= 20 or step == 1:
            last_print = elapsed
            print(f"step {step:5d}  {elapsed:6.0f}s  loss {loss.item():.3f}  ema {ema:.3f}", flush=True)
    print(f"done: {step} steps in {time.perf_counter() - start:.0f}s, final ema loss {ema:.3f}")

    model.eval()
    args.out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(args.out)
    tok.save_pretrained(args.out)
    print(f"saved to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
