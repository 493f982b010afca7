"""tokens/s of `kvtool eval` against a plain transformers forward loop over the same windows.

The reference is the Hugging Face perplexity-guide loop (one window per forward, labels masked
with -100, the model's own loss), timed in the same process on the same device and dtype. kvtool
is timed over its window loop (report.seconds), without and with FP8 KV emulation. Goals:
overhead <= 10% without emulation, <= 25% with it. Each measurement is the best of --repeats.

    python bench/eval_bench.py                      # SmolLM2-135M fixture, CPU or CUDA
    python bench/eval_bench.py --tokens 8192 --max-length 1024 --device cuda --dtype bf16
"""

from __future__ import annotations

import argparse
import json
import time


def plain_loop(model, ids, max_length, stride, sync):
    import torch

    seq = torch.tensor(ids)[None].to(model.device)
    n = seq.shape[1]
    prev_end, total, count = 0, 0.0, 0
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        # the same windows kvtool uses (stream lengths are chosen so that no slide-back is needed)
        for begin in range(0, n, stride):
            end = min(begin + max_length, n)
            trg = end - prev_end
            inp = seq[:, begin:end]
            labels = inp.clone()
            labels[:, :-trg] = -100
            loss = model(input_ids=inp, labels=labels).loss
            valid = trg if begin else trg - 1
            total += loss * valid
            count += valid
            prev_end = end
            if end == n:
                break
        nll = float(total) / count
    sync()
    return time.perf_counter() - t0, nll, count


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model folder (default: the SmolLM2-135M fixture)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--max-length", type=int, default=512)
    ap.add_argument("--stride", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=2048, help="stream length (rounded to L + k*S)")
    ap.add_argument("--batch-size", type=int, default=1, help="kvtool windows per forward (the reference uses 1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtool.eval.api import evaluate
    from kvtool.testing.fixtures import smollm2_dir
    from kvtool.testing.text import evaluation_text
    from kvtool.runtime.torch_utils import pick_device, pick_dtype

    if args.threads:
        torch.set_num_threads(args.threads)
    path = args.model or str(smollm2_dir())
    dev = pick_device(args.device)
    dt = pick_dtype(args.dtype, dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation="sdpa").to(dev).eval()
    tok = AutoTokenizer.from_pretrained(path)
    L, S = args.max_length, args.stride
    n = L + max(0, (args.tokens - L) // S) * S
    text = evaluation_text()
    ids = tok(text)["input_ids"][:n]

    def kv(kv_dtype):
        r = evaluate(model, tokenizer=tok, texts=text, max_length=L, stride=S, max_tokens=n, kv_cache_dtype=kv_dtype,
                     kv_scales="one", batch_size=args.batch_size)
        return r.seconds, r.metrics["nll_mean"], r.tokens

    runs = {"plain": lambda: plain_loop(model, ids, L, S, sync), "kvtool": lambda: kv("off"), "kvtool_fp8": lambda: kv("fp8")}
    best: dict[str, tuple] = {}
    for name, fn in runs.items():
        fn()  # warm-up
    for _ in range(args.repeats):
        for name, fn in runs.items():  # interleaved: load changes hit all three alike
            sec, nll, count = fn()
            if name not in best or sec < best[name][0]:
                best[name] = (sec, nll, count)
    ref = best["plain"][0]
    out = {
        "model": path, "device": str(dev), "dtype": str(dt).replace("torch.", ""), "torch_threads": torch.get_num_threads(),
        "window": L, "stride": S, "tokens": best["plain"][2], "batch_size": args.batch_size, "repeats": args.repeats,
        "nll_plain": best["plain"][1], "nll_kvtool": best["kvtool"][1], "nll_kvtool_fp8": best["kvtool_fp8"][1],
        **{f"tok_s_{k}": round(v[2] / v[0], 1) for k, v in best.items()},
        "overhead_kvtool": round(best["kvtool"][0] / ref - 1, 4),
        "overhead_kvtool_fp8": round(best["kvtool_fp8"][0] / ref - 1, 4),
    }
    assert best["kvtool"][2] == best["plain"][2], "token counts differ"
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:22} {v}")


if __name__ == "__main__":
    main()
