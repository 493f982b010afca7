"""Peak memory of the quality report (kvtool eval against a baseline with FP8 KV emulation): layer by layer
against the whole model, same run, on SmolLM2 and on a copy with every layer repeated (60 layers).

Each case runs as a fresh process under /usr/bin/time (wall time, CPU time, peak RSS):
  floor       python importing torch / transformers / kvtool.eval and loading the tokenizer
  whole       evaluate_many(baseline=SRC, [SRC with FP8 scale 1.0], layerwise=False): every weight resident
              (how `kvtool eval`, `convert --eval` and quantize-kv's report ran before)
  layerwise   the same evaluation one decoder layer at a time (the default for model folders)
and prints peak RSS, the peak above the floor, and how each peak grows from 30 to 60 layers. The figures of
the two ways are compared (relative difference of PPL, PPL ratio and KLD).

    OMP_NUM_THREADS=1 python bench/eval_memory.py [--model DIR] [--tokens 1024] [--max-length 256] [--deeper 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from convert_memory import deeper_copy, measure, models_of  # noqa: E402

FLOOR = r'''
import sys, torch, transformers, accelerate, safetensors
import kvtool.eval.api, kvtool.eval.layerwise, kvtool.runtime.layerwise
from kvtool.runtime.torch_utils import load_tokenizer
load_tokenizer(sys.argv[1])
'''

EVAL = r'''
import json, sys
from kvtool.eval.api import Candidate, evaluate_many
src, mode, tokens, length, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
r = evaluate_many([Candidate(src, "fp8", "one", label="fp8 scale 1.0")], src, max_tokens=tokens, max_length=length,
                  device="cpu", dtype="fp32", layerwise=(mode == "layerwise"))[0]
json.dump({"metrics": r.metrics, "memory": r.memory}, open(out, "w"))
'''

KEYS = ("ppl", "baseline_ppl", "ppl_ratio", "kld_mean", "top1_agreement")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the SmolLM2-135M fixture)")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--max-length", type=int, default=256)
    ap.add_argument("--deeper", type=int, default=2, metavar="K", help="also a copy with every layer repeated K times")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    env, models = models_of(args)
    work = Path(tempfile.mkdtemp(prefix="kvtool-bench-evalmem-"))
    try:
        if args.deeper > 1:
            models[f"x{args.deeper}"] = deeper_copy(models["x1"], work / "deeper", args.deeper)
        cases = {("x1", "floor"): [sys.executable, "-c", FLOOR, str(models["x1"])]}
        for tag, src in models.items():
            for mode in ("whole", "layerwise"):
                cases[(tag, mode)] = [sys.executable, "-c", EVAL, str(src), mode, str(args.tokens),
                                      str(args.max_length), str(work / f"{tag}-{mode}.json")]
        runs = measure(cases, env, args.repeat)
        results = {(tag, mode): json.loads((work / f"{tag}-{mode}.json").read_text())
                   for tag in models for mode in ("whole", "layerwise")}
        sizes = {tag: _sizes(src) for tag, src in models.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    mib = 2**20
    peak = {k: max(r["rss"] for r in v) for k, v in runs.items()}
    floor = peak[("x1", "floor")]
    print(f"model {models['x1'].name}, {args.tokens} tokens, windows of {args.max_length}, baseline + FP8 (scale 1.0) "
          f"candidate, fp32 on CPU, repeat {args.repeat}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}")
    for tag, (layers, weights, layer) in sizes.items():
        print(f"{tag}: {layers} layers, fp32 weights {weights / mib:.0f} MiB, largest layer {layer / mib:.1f} MiB")
    print(f"{'model':<6} {'case':<10} {'wall s':>7} {'cpu s':>7} {'peak MiB':>9} {'above floor':>12}")
    for (tag, case), rs in runs.items():
        wall = min(r["wall"] for r in rs)
        cpu = min(r["cpu"] for r in rs)
        print(f"{tag:<6} {case:<10} {wall:>7.1f} {cpu:>7.1f} {peak[(tag, case)] / mib:>9.0f} "
              f"{(peak[(tag, case)] - floor) / mib:>12.0f}")
    for tag in models:
        a, b = results[(tag, "layerwise")]["metrics"], results[(tag, "whole")]["metrics"]
        rel = max(abs(a[k] - b[k]) / abs(b[k]) if b[k] else abs(a[k] - b[k]) for k in KEYS)
        print(f"{tag}: layerwise / whole peak {peak[(tag, 'layerwise')] / peak[(tag, 'whole')]:.2f}; figures differ "
              f"by at most {rel:.1e} relative ({', '.join(KEYS)}); layerwise held {results[(tag, 'layerwise')]['memory']}")
    if len(models) > 1:
        deep = f"x{args.deeper}"
        for case in ("whole", "layerwise"):
            grow = (peak[(deep, case)] - peak[("x1", case)]) / mib
            print(f"{case}: peak grows {grow:+.0f} MiB from x1 to {deep} "
                  f"({(sizes[deep][1] - sizes['x1'][1]) / mib:.0f} MiB more weights)")
    if args.json:
        print(json.dumps({"runs": {f"{t}/{c}": v for (t, c), v in runs.items()},
                          "metrics": {f"{t}/{m}": r for (t, m), r in results.items()}}, indent=2))
    return 0


def _sizes(src: Path) -> tuple[int, int, int]:
    from kvtool.eval.memory import weight_sizes
    from kvtool.model.checkpoint import open_checkpoint

    s = weight_sizes(open_checkpoint(src).tensors, 4)
    return s.layers, s.total, s.largest_layer


if __name__ == "__main__":
    raise SystemExit(main())
