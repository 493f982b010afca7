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
               ops=("mean", "aware0", "aware1", "aware2", "quantize", "eval"),
               deep_ops=("mean", "aware0", "quantize", "eval")),
    "70b": dict(hidden=8192, heads=64, kv=8, inter=28672, vocab=49152, depths=(1, 2), groups=4, tokens=64, seq=32,
                ops=("mean", "aware0", "quantize"), deep_ops=("mean", "quantize")),
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
                     "--refine-steps", op[-1], *calib, "--no-eval", "--no-progress",
                     # the original stream that refinement fits by default, and the error grouping, have their own
                     # terms in kvtool.model.costs
                     "--method-opt", "refine_target=layer", "--grouping", "contiguous"]
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
    ap.add_argument("--coefficients", action="store_true",
                    help="only print kvtool/model/costs.json fitted from --json (no runs)")
    ap.add_argument("--copy-gbps", type=float, help="--coefficients: convert --method mean's measured GB/s "
                    "(bench/convert_bench.py at the 8B shape)")
    ap.add_argument("--report", action="store_true", help="only print docs/scaling.md's tables from --json")
    ap.add_argument("--convert-startup", type=float, default=0.3, help="--coefficients: convert start-up seconds")
    args = ap.parse_args()
    if args.coefficients:
        print(json.dumps(fit(json.loads(Path(args.json).read_text()), args.copy_gbps, args.convert_startup), indent=2))
        return 0
    if args.report:
        print(report(json.loads(Path(args.json).read_text())))
        return 0
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
            want = s.get("deep_ops", ops) if d == s["depths"][-1] and not args.ops else ops
            todo = [op for op in want if f"{op}@{d}" not in runs]  # --json: resume where a run stopped
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
            if a and not b and name != "8b" and op in results["derived"].get("8b", {}):
                # one depth only (70B aware: ~2 CPU-minutes a layer): the rest is taken from the 8B fit
                rest = results["derived"]["8b"][op]["base_cpu_s"]
                der[op] = {"layer_cpu_s": (a["cpu"] - rest) / d1, "base_cpu_s": rest, "rss_d1": a["rss"],
                           "rss_d2": a["rss"], "layer_wall_s": None, "d1": d1, "d2": d1, "one_depth": True}
                continue
            if not (a and b):
                continue
            per = (b["cpu"] - a["cpu"]) / (d2 - d1)
            der[op] = {"layer_cpu_s": per, "base_cpu_s": a["cpu"] - d1 * per, "rss_d1": a["rss"], "rss_d2": b["rss"],
                       "layer_wall_s": (b["wall"] - a["wall"]) / (d2 - d1), "d1": d1, "d2": d2}
        if args.json:
            Path(args.json).write_text(json.dumps(results, indent=1))
    print_table(results)
    return 0


def _median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if len(xs) % 2 else (xs[len(xs) // 2 - 1] + xs[len(xs) // 2]) / 2


def _line(points):
    """Least-squares a + b x through (x, y) points (b >= 0)."""
    n = len(points)
    mx, my = sum(x for x, _ in points) / n, sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    b = max(0.0, sum((x - mx) * (y - my) for x, y in points) / sxx) if sxx else 0.0
    return my - b * mx, b


def fit(results: dict, copy_gbps: float | None, convert_startup: float) -> dict:
    """The coefficients of kvtool.model.costs from the derived per-layer costs (see that module)."""
    shapes, der = results["shapes"], results["derived"]
    real = [n for n in ("1b", "8b") if n in der]  # fitted on these; the 70B runs check the fit

    def params(n):
        s = shapes[n]
        return s["layer_params"], s["vocab"] * s["hidden"] * 2 + s["hidden"]

    def attn(n):
        s = shapes[n]
        hd = s["hidden"] // s["heads"]
        return 2 * s["heads"] * hd * s["hidden"] + 2 * s["kv"] * hd * s["hidden"]

    def per_token(op):
        return _median([der[n][op]["layer_cpu_s"] / (shapes[n]["layer_params"] * shapes[n]["tokens"])
                        for n in real if op in der[n]])

    def calib(op, tok_slope, cubed: bool):
        """Per layer: s_per_param x params + slope x params x tokens (+ s_per_hidden_cubed x hidden^3).
        The token slope comes from the 1B runs at two token counts (--tokens-json); the rest is solved
        from the 1B and 8B per-layer costs (exactly, two shapes, two unknowns when `cubed`)."""
        two = [n for n in ("1b", "8b") if op in der.get(n, {})]
        resid = {n: der[n][op]["layer_cpu_s"] - tok_slope * shapes[n]["layer_params"] * shapes[n]["tokens"]
                 for n in two}
        p1, p2 = (shapes[n]["layer_params"] for n in two)
        h1, h2 = (shapes[n]["hidden"] ** 3 for n in two)
        r1, r2 = (resid[n] for n in two)
        if cubed:
            det = p1 * h2 - p2 * h1
            per_param, per_h3 = (r1 * h2 - r2 * h1) / det, (p1 * r2 - p2 * r1) / det
            if per_param < 0:
                per_param, per_h3 = 0.0, _median([r1 / h1, r2 / h2])
        else:  # weights handling dominates at these token counts: averaged over the 8B and 70B widths
            wide = [n for n in ("8b", "70b") if op in der.get(n, {})]
            per_param = max(0.0, sum((der[n][op]["layer_cpu_s"] - tok_slope * shapes[n]["layer_params"]
                                      * shapes[n]["tokens"]) / shapes[n]["layer_params"] for n in wide) / len(wide))
            per_h3 = 0.0
        a, b = _line([(sum(params(n)), der[n][op]["rss_d1"]) for n in two])
        sq = 0.0
        three = [n for n in ("1b", "8b", "70b") if op in der.get(n, {})]
        per_layer = None
        if len(three) == 3:  # memory, solved on the three widths
            import numpy as np

            # aware: base + per parameter + per hidden^2 (its float64 Gram matrices);
            # quantize: base + per embedding parameter + per parameter of the resident layer
            third = (lambda n: shapes[n]["hidden"] ** 2) if cubed else (lambda n: shapes[n]["layer_params"])
            m = np.array([[1.0, sum(params(n)), third(n)] for n in three])
            a, b, z = np.linalg.solve(m, np.array([float(der[n][op]["rss_d1"]) for n in three]))
            if cubed:
                sq = z
            else:
                per_layer = b + z
        out = {"startup_s": round(max(1.0, _median([der[n][op]["base_cpu_s"] for n in two])), 2),
               "s_per_param": float(f"{per_param:.3g}"), "s_per_param_token": float(f"{tok_slope:.3g}"),
               "rss_base_bytes": int(max(a, 1e8)), "rss_per_param": round(max(b, 0.1), 3)}
        if cubed:
            out["s_per_hidden_cubed"] = float(f"{per_h3:.3g}")
            out["rss_per_hidden_squared"] = round(max(sq, 0.0), 1)
        if per_layer is not None:
            out["rss_per_layer_param"] = round(max(per_layer, 0.1), 3)
        return out

    tok = results.get("tokens", {})
    slope = {}
    for op in ("aware0", "quantize"):
        lo, hi = results["runs"]["1b"][f"{op}@2"], tok.get(op)
        s1 = shapes["1b"]
        slope[op] = max(0.0, (hi["cpu"] - lo["cpu"]) / (2 * s1["layer_params"] * (tok["tokens"] - s1["tokens"]))
                        if hi else per_token(op))

    out = {"about": "kvtool.model.costs coefficients: CPU-core seconds (one thread) and peak RSS bytes, fitted by "
                    "bench/scaling_bench.py --coefficients (per-layer costs at 1B / 8B / 70B widths) and "
                    "bench/convert_bench.py (copy speed); docs/scaling.md has the measurements."}
    mean = [(shapes[n]["kv"] * (shapes[n]["hidden"] // shapes[n]["heads"]) * shapes[n]["hidden"] * 2 * 2,
             der[n]["mean"]["rss_d1"]) for n in real if "mean" in der[n]]
    a, b = _line(mean)
    out["convert_mean"] = {"startup_s": convert_startup, "copy_bytes_per_s": (copy_gbps or 1.0) * 1e9,
                           # pooled K/V bytes per CPU second: in-process user time, the 1.5 GB bf16 convert
                           "pool_bytes_per_s": 1.5e9, "rss_base_bytes": int(max(a, 3e7)),
                           "rss_per_layer_kv_byte": round(max(b, 1.0), 3)}
    aw = calib("aware0", slope["aware0"], cubed=True)
    step = fixed = None
    for n in real:  # refinement costs are per layer: from the shallow depth, (aware2 - aware1) / layers
        r, s = results["runs"][n], shapes[n]
        d1 = s["depths"][0]
        if all(f"aware{k}@{d1}" in r for k in (0, 1, 2)):
            a0, a1, a2 = (r[f"aware{k}@{d1}"]["cpu"] / d1 for k in (0, 1, 2))
            step = (a2 - a1) / (attn(n) * s["seq"])
            fixed = (a1 - a0 - step * attn(n) * s["seq"]) / attn(n)
    aw["refine_fixed_s_per_attn_param"] = float(f"{max(fixed or 0, 1e-12):.3g}")
    aw["refine_step_s_per_attn_param_token"] = float(f"{max(step or 0, 1e-12):.3g}")
    aw["distill_step_passes"] = DISTILL_STEP_PASSES
    aw["grouping_s_per_group"] = GROUPING_S_PER_GROUP
    out["convert_aware"] = aw
    out["quantize_kv"] = calib("quantize", slope["quantize"], cubed=False)
    a, b = _line([(shapes[n]["layer_params"] * der[n]["eval"]["d1"] + params(n)[1], der[n]["eval"]["rss_d1"])
                  for n in real if "eval" in der[n]])
    s1, lo, hi = shapes["1b"], results["runs"]["1b"]["eval@2"], tok.get("eval")
    ev_slope = ((hi["cpu"] - lo["cpu"]) / ((2 * s1["layer_params"] + s1["vocab"] * s1["hidden"])
                                          * (tok["tokens"] - s1["tokens"])) if hi else per_token("eval"))
    ev_param = _median([max(0.0, der[n]["eval"]["layer_cpu_s"] - ev_slope * shapes[n]["layer_params"]
                            * shapes[n]["tokens"]) / shapes[n]["layer_params"] for n in real if "eval" in der[n]])
    out["eval"] = {"startup_s": round(max(1.0, _median([der[n]["eval"]["base_cpu_s"] for n in real
                                                          if "eval" in der[n]])), 2),
                   "s_per_param": float(f"{ev_param:.3g}"), "s_per_param_token": float(f"{ev_slope:.3g}"),
                   "rss_base_bytes": int(max(a, 1e8)), "rss_per_param": round(max(b, 1.0), 3)}
    return out


# CPU cost of one --distill-steps step, in forward passes over its sequence (LM head included): measured on
# SmolLM2-135M (docs/convert-quality.md, "End-to-end distillation"), not fitted here
DISTILL_STEP_PASSES = 2.5
# CPU seconds of one candidate group's closed-form merge under --grouping error (its attention passes apart):
# measured on SmolLM2-135M expanded to MHA 9 and merged to 3 (docs/convert-quality.md, 2520 groups), not fitted here
GROUPING_S_PER_GROUP = 0.049


# GPU estimates (no GPU measured): CPU-measured work converted to FLOPs at the CPU's measured rate,
# run at GPU_EFFICIENCY of the H200's dense bf16 peak, plus reading the bf16 weights once.
H200_BF16_FLOPS = 989e12
GPU_EFFICIENCY = 0.4
DISK_BYTES_PER_S = 2e9
GPU_STARTUP_S = 15.0
FULL = {  # the real models the projections are for
    "8B": dict(layers=32, hidden=4096, heads=32, kv=8, inter=14336, vocab=128256),
    "70B": dict(layers=80, hidden=8192, heads=64, kv=8, inter=28672, vocab=128256),
}


def _full_shape(m: dict):
    from kvtool.model.costs import Shape

    hd = m["hidden"] // m["heads"]
    s = {"hidden": m["hidden"], "heads": m["heads"], "kv": m["kv"], "inter": m["inter"]}
    lp = layer_params(s)
    other = 2 * m["vocab"] * m["hidden"] + m["hidden"]
    return Shape(layers=m["layers"], hidden=m["hidden"], layer_params=lp, other_params=other,
                 attn_params=2 * m["heads"] * hd * m["hidden"] + 2 * m["kv"] * hd * m["hidden"],
                 layer_kv_bytes=2 * m["kv"] * hd * m["hidden"] * 2, weight_bytes=2 * (m["layers"] * lp + other),
                 vocab=m["vocab"])


def _dur(s: float) -> str:
    from kvtool.model.costs import fmt_duration

    return fmt_duration(s)


def report(results: dict) -> str:
    """The measured table and the projections (kvtool.model.costs with costs.json) as markdown."""
    from kvtool.convert.aware.partition import cost_terms
    from kvtool.model import costs
    from kvtool.units import fmt_bytes

    shapes, der = results["shapes"], results["derived"]
    names = {"mean": "convert --method mean", "aware0": "convert --method aware (training-free)",
             "aware1": "aware, --refine-steps 1", "aware2": "aware, --refine-steps 2",
             "quantize": "quantize-kv --no-eval (calibration)", "eval": "eval"}
    out = ["| width | command | tokens | CPU s per layer | CPU s rest | peak RSS (depth) |",
           "| --- | --- | ---: | ---: | ---: | --- |"]
    for n in ("1b", "8b", "70b"):
        for op, v in der.get(n, {}).items():
            s = shapes[n]
            tok = "" if op == "mean" else str(s["tokens"])
            rss = f"{fmt_bytes(v['rss_d1'])} ({v['d1']} L), {fmt_bytes(v['rss_d2'])} ({v['d2']} L)"
            out.append(f"| {n.upper()} | {names[op]} | {tok} | {v['layer_cpu_s']:.2f} | {v['base_cpu_s']:.1f} | {rss} |")
    r8 = results["runs"].get("8b", {})
    if all(f"aware{k}@2" in r8 for k in (0, 1, 2)):
        a = [r8[f"aware{k}@2"]["cpu"] / 2 for k in (0, 1, 2)]
        out.append("")
        out.append(f"8B width, 2 layers, per layer: training-free {a[0]:.1f} CPU s; the first refinement step adds "
                   f"{a[1] - a[0]:.1f} s (the loss before / after on all calibration sequences, plus the step), "
                   f"each further step {a[2] - a[1]:.1f} s ({shapes['8b']['seq']}-token sequences).")
    cpu_rate = 2 / costs.coefficients()["eval"]["s_per_param_token"]  # FLOP/s of one core, measured
    out += ["", f"Projection (kvtool.model.costs; CPU: one core at the measured rate, {cpu_rate / 1e9:.1f} GFLOP/s "
                f"in eval; GPU: **estimate**, see below):", "",
            "| model | command | peak RSS | CPU, 1 core | CPU, 16 cores (ideal) | one H200 (estimate) |",
            "| --- | --- | ---: | ---: | ---: | ---: |"]
    for m, spec in FULL.items():
        sh = _full_shape(spec)
        kv = spec["kv"]
        grouping = cost_terms(kv, kv // 2, 4096, 256)
        rows = [("convert --method mean", costs.convert_mean(sh)),
                ("convert --method aware (4096 tokens; to MQA, or `--grouping contiguous`)",
                 costs.convert_aware(sh, 4096, 256)),
                (f"aware {kv} -> {kv // 2} KV heads (`--grouping error`)",
                 costs.convert_aware(sh, 4096, 256, **grouping)),
                ("aware, --refine-steps 64 (seq 1024)", costs.convert_aware(sh, 4096, 1024, 64, original_stream=True)),
                ("quantize-kv --no-eval (2048 tokens)", costs.quantize_kv(sh, 2048)),
                ("eval, 1k tokens", costs.evaluate(sh, 1000))]
        for what, e in rows:
            if e.disk_bound:
                cpu, ideal, gpu = _dur(e.cpu_seconds), "(disk-bound)", "(disk-bound)"
            else:
                cpu, ideal = _dur(e.cpu_seconds), _dur(e.cpu_seconds / 16)
                flops = e.cpu_seconds * cpu_rate
                gpu = _dur(GPU_STARTUP_S + sh.weight_bytes / DISK_BYTES_PER_S + flops / (H200_BF16_FLOPS * GPU_EFFICIENCY))
            out.append(f"| {m} | {what} | {fmt_bytes(e.peak_bytes)} | {cpu} | {ideal} | {gpu} |")
    return "\n".join(out)


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
