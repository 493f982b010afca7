"""Cost curves at real shapes (issue 18): time per layer and peak RSS of kvtool's heavy commands.

Random-weight Llama checkpoints in sharded bf16 safetensors (bench/convert_bench.py's writer), at
the widths of TinyLlama-1.1B, Llama-3-8B and Llama-3-70B, truncated to two depths (num_hidden_layers
d1 < d2), so that a layer's cost is (cost(d2) - cost(d1)) / (d2 - d1) and the rest (start-up,
embeddings, lm_head) is cost(d1) - d1 * layer. Every command runs as a fresh process under
/usr/bin/time -v (wall, CPU user + system, peak RSS), with one thread (OMP_NUM_THREADS=1):

  mean      convert --method mean (to half the KV heads)
  aware0    convert --method aware, training-free (--refine-steps 0)
  aware1/2  the same with --refine-steps 1 and 2: a step is aware2 - aware1
  quantize  quantize-kv --no-eval (calibration of the FP8 KV scales)
  eval      eval --max-tokens N (perplexity on the built-in text), reported per 1k tokens

Calibration and evaluation use few tokens (256 at 1B, 128 at 8B, 64 at 70B width) so that the
runs fit on a shared 2-core machine; the costs are linear in tokens at these sequence lengths, and
the table says what was scaled. The tokenizer is SmolLM2's (the cached fixture): the 1B shape uses
its vocabulary (49152, not TinyLlama's 32000), as does the 70B shape (so that its fp32 embedding
and lm_head fit in memory; per-layer costs do not depend on the vocabulary). Output: a table on
stdout, the raw runs and derived costs as JSON (--json), progress on stderr.

    python bench/scaling_bench.py --dir /work/bench-scratch/scaling [--shapes 1b,8b,70b] [--ops mean,...]
        [--json bench/scaling.json]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_bench import make_checkpoint, timed  # noqa: E402

# name: (hidden, heads, kv_heads, intermediate, vocab, depths, groups, tokens, seq_len)
SHAPES = {
    "1b": dict(hidden=2048, heads=32, kv=4, inter=5632, vocab=49152, depths=(2, 4), groups=2, tokens=256, seq=128,
               ops=("mean", "aware0", "quantize", "eval")),
    "8b": dict(hidden=4096, heads=32, kv=8, inter=14336, vocab=128256, depths=(2, 4), groups=4, tokens=128, seq=64,
               ops=("mean", "aware0", "aware1", "aware2", "quantize", "eval")),
    "70b": dict(hidden=8192, heads=64, kv=8, inter=28672, vocab=49152, depths=(1, 2), groups=4, tokens=64, seq=32,
                ops=("mean", "aware0", "aware1", "quantize", "eval")),
    "tiny": dict(hidden=256, heads=4, kv=4, inter=512, vocab=49152, depths=(1, 2), groups=2, tokens=64, seq=32,
                 ops=("mean", "aware0", "aware1", "aware2", "quantize", "eval")),
}
OPS = ("mean", "aware0", "aware1", "aware2", "quantize", "eval")


def layer_params(s: dict) -> int:
    h, hd = s["hidden"], s["hidden"] // s["heads"]
    return 2 * h * h + 2 * s["kv"] * hd * h + 3 * h * s["inter"] + 2 * h


def command(op: str, src: Path, out: Path, s: dict) -> list[str]:
    kv = [sys.executable, "-m", "kvtool"]
    calib = ["--calib-tokens", str(s["tokens"]), "--seq-len", str(s["seq"])]
    if op == "mean":
        return kv + ["convert", str(src), str(out), "--to", "gqa", "--groups", str(s["groups"]), "--no-eval",
                     "--no-progress"]
    if op.startswith("aware"):
        return kv + ["convert", str(src), str(out), "--to", "gqa", "--groups", str(s["groups"]), "--method", "aware",
                     "--refine-steps", op[-1], *calib, "--no-eval", "--no-progress"]
    if op == "quantize":
        return kv + ["quantize-kv", str(src), str(out), "--no-eval", "--device", "cpu", *calib, "--no-progress"]
    if op == "eval":
        return kv + ["eval", str(src), "--max-tokens", str(s["tokens"]), "--max-length", str(s["seq"]),
                     "--device", "cpu", "--kv-cache-dtype", "off", "--no-progress"]
    raise ValueError(op)


def build(folder: Path, s: dict, layers: int, tokenizer: Path) -> None:
    if (folder / "config.json").exists():
        return
    print(f"writing {folder.name} ...", file=sys.stderr)
    make_checkpoint(folder, layers, s["hidden"], s["heads"], s["inter"], s["vocab"], kv_heads=s["kv"], dtype="bf16",
                    shard_bytes=5 * 10**9)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / f, folder / f)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="scratch folder (checkpoints are deleted when done)")
    ap.add_argument("--shapes", default="1b,8b,70b")
    ap.add_argument("--ops", default=None, help="default: each shape's list")
    ap.add_argument("--json", help="write the raw runs and derived costs here")
    args = ap.parse_args()
    from kvtool.fixtures import fixture_dir

    tokenizer = Path(fixture_dir("smollm2"))
    base = Path(args.dir)
    base.mkdir(parents=True, exist_ok=True)
    # One thread: on a shared machine CPU seconds are the steady measure, and with one thread they are
    # the wall time an idle core would take (the tables scale them to more cores).
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    results: dict = {"load": [], "runs": {}, "derived": {}, "shapes": {}}
    if args.json and Path(args.json).exists():
        results = json.loads(Path(args.json).read_text())
    for name in args.shapes.split(","):
        s = SHAPES[name]
        ops = args.ops.split(",") if args.ops else list(s["ops"])
        results["shapes"][name] = {**s, "layer_params": layer_params(s)}
        runs = results["runs"].setdefault(name, {})
        for d in s["depths"]:
            todo = [op for op in ops if f"{op}@{d}" not in runs]  # --json: resume where a run stopped
            if not todo:
                continue
            src = base / f"{name}-{d}l"
            build(src, s, d, tokenizer)
            os.sync()
            for op in todo:
                out = base / "out"
                shutil.rmtree(out, ignore_errors=True)
                t0 = time.time()
                wall, rss, cpu = timed(command(op, src, out, s))
                runs[f"{op}@{d}"] = {"wall": wall, "rss": rss, "cpu": cpu}
                results["load"].append(os.getloadavg()[0])
                print(f"{name} {d} layers {op}: {wall:.1f} s, {cpu:.1f} CPU s, {rss / 2**20:.0f} MiB "
                      f"(load {os.getloadavg()[0]:.1f})", file=sys.stderr)
                shutil.rmtree(out, ignore_errors=True)
                os.sync()
                if args.json:
                    Path(args.json).write_text(json.dumps(results, indent=1))
            shutil.rmtree(src)
        d1, d2 = s["depths"]
        der = results["derived"].setdefault(name, {})
        for op in ops:
            a, b = runs.get(f"{op}@{d1}"), runs.get(f"{op}@{d2}")
            if not (a and b):
                continue
            per = (b["cpu"] - a["cpu"]) / (d2 - d1)
            der[op] = {"layer_cpu_s": per, "base_cpu_s": a["cpu"] - d1 * per, "rss_d1": a["rss"], "rss_d2": b["rss"],
                       "layer_wall_s": (b["wall"] - a["wall"]) / (d2 - d1), "d1": d1, "d2": d2}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


def print_table(results: dict) -> None:
    print("CPU seconds (one thread) per layer and for the rest (start-up, embeddings, lm_head); peak RSS at both depths")
    print(f"{'shape':5} {'op':9} {'s/layer':>8} {'base s':>7} {'RSS MiB':>15}  note")
    for name, der in results["derived"].items():
        s = results["shapes"][name]
        for op, v in der.items():
            note = f"{s['tokens']} tokens" if op != "mean" else ""
            if op == "eval":
                note += f"; per 1k tokens: {v['layer_cpu_s'] * 1000 / s['tokens']:.2f} s/layer"
            rss = f"{v['rss_d1'] / 2**20:.0f}@{v['d1']}L {v['rss_d2'] / 2**20:.0f}@{v['d2']}L"
            print(f"{name:5} {op:9} {v['layer_cpu_s']:8.2f} {v['base_cpu_s']:7.2f} {rss:>15}  {note}")
    load = results.get("load") or [math.nan]
    print(f"load average (1 min) during the runs: {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    sys.exit(main())
