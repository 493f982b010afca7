"""The bias of `kvtool eval --server`'s top-k KL estimate (kvtool.eval.topk), measured on the local path where the
full-vocabulary KL is known: the same model and candidate, each position's log-probabilities truncated to what a
server returns (its top k and the target) versus the whole vocabulary.

Pair: SmolLM2-135M in float32 (baseline) against itself with an FP8 e4m3 KV cache at scale 1.0 (vLLM's default
without scales; kvtool.eval.fp8), a small, realistic divergence. Texts: kvtool's pydoc evaluation split and,
another genre, the licence texts of /usr/share/common-licenses (bench/other_texts.py). Windows of 256 tokens,
stride 128, as `kvtool eval --max-length 256`.

    python bench/topk_kld_bias.py [--max-tokens 1024] [--k 1,5,20,100]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _mean_se(x) -> tuple[float, float]:
    x = np.asarray(x, dtype=np.float64)
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size))


def measure(text: str, ks: list[int], max_tokens: int, window: int = 256) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtool import fixtures
    from kvtool.eval import topk
    from kvtool.eval.fp8 import KVScales
    from kvtool.eval.windows import windows
    from kvtool.runtime.kv_hooks import kv_hook

    path = fixtures.smollm2_dir()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = tok(text)["input_ids"][:max_tokens]
    full, est = [], {k: [] for k in ks}
    top1 = {k: [] for k in ks}
    hook = KVScales(source="one").hook()
    with torch.inference_mode():
        for w in windows(len(ids), window, window // 2):
            x = torch.tensor([ids[w.begin:w.end]])
            b = torch.log_softmax(model(input_ids=x).logits[0, -w.n_scored - 1:-1].float(), -1)
            with kv_hook(model, hook):
                c = torch.log_softmax(model(input_ids=x).logits[0, -w.n_scored - 1:-1].float(), -1)
            full += (b.exp() * (b - c)).sum(-1).clamp_min(0).tolist()
            targets = ids[w.first_target:w.end]
            bn, cn = b.double().numpy(), c.double().numpy()
            for i, t in enumerate(targets):
                for k in ks:
                    tb, tc = topk.truncate(bn[i], t, k), topk.truncate(cn[i], t, k)
                    est[k].append(topk.kld(tb, tc, k))
                    top1[k].append(topk.top1(tb) == topk.top1(tc))
    out = {"tokens": len(full), "full": _mean_se(full)}
    for k in ks:
        d = np.asarray(est[k]) - np.asarray(full)
        out[k] = {"estimate": _mean_se(est[k]), "bias": _mean_se(d), "relative": float(d.mean() / np.mean(full))}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--k", default="1,5,20,100")
    a = ap.parse_args(argv)
    ks = [int(k) for k in a.k.split(",")]
    from kvtool.datasets import evaluation_text
    from other_texts import licenses_text

    for name, text in (("pydoc (evaluation split)", evaluation_text()), ("licences (other genre)", licenses_text())):
        r = measure(text, ks, a.max_tokens)
        m, se = r["full"]
        print(f"{name}: {r['tokens']} tokens, full-vocabulary KLD {m:.5f} ± {se:.5f}")
        for k in ks:
            e, b = r[k]["estimate"], r[k]["bias"]
            print(f"  top-{k:<3d} estimate {e[0]:.5f} ± {e[1]:.5f}   bias {b[0]:+.5f} ± {b[1]:.5f} "
                  f"({r[k]['relative'] * 100:+.1f}%)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
