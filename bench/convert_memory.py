"""Peak memory of `kvtool convert --method aware`: layer by layer against the whole model, same run.

Each case runs as a fresh process under /usr/bin/time (wall time, CPU time, peak RSS):
  floor       python importing torch / transformers / kvtool's aware method and loading the tokenizer
              (what any calibration pays before touching a weight)
  hf-load     floor + AutoModelForCausalLM.from_pretrained(SRC, dtype=float32) and one decoder forward
              over the calibration tokens: the plain transformers way, every weight resident
  whole       `kvtool convert SRC DST --to mqa --method aware --method-opt layerwise=false`
              (the whole model loaded with transformers, the approach before layer-by-layer loading)
  layerwise   `kvtool convert SRC DST --to mqa --method aware` (the default)
and prints peak RSS, peak above the floor, and that over the model's weight bytes (fp32, as the
calibration holds them) and over one decoder layer + one layer's calibration activations. The two
converted checkpoints are compared tensor by tensor (they must agree to float tolerance).

    OMP_NUM_THREADS=1 python bench/convert_memory.py [--model DIR] [--to mqa] [--calib-tokens 2048] [--repeat 1]
        [--deeper K]   # also a copy with every layer repeated K times: the layerwise peak must not grow

Default model: the SmolLM2-135M fixture (kvtool.testing.fixtures; ~540 MB of fp32 weights).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

FLOOR = r'''
import sys, torch, transformers, accelerate, safetensors
import kvtool.convert.aware.merge, kvtool.runtime.layerwise
from kvtool.runtime.torch_utils import load_tokenizer
load_tokenizer(sys.argv[1])
'''

HF_LOAD = FLOOR + r'''
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
with torch.no_grad():  # touch every weight (from_pretrained may leave them memory-mapped and unread)
    model.model(input_ids=torch.arange(int(sys.argv[2])).reshape(-1, 256) % 1000, use_cache=False)
'''


def timed(cmd: list[str], env: dict) -> dict:
    """Wall / CPU seconds and peak RSS (bytes) of one fresh process."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as out:
        proc = subprocess.run(["/usr/bin/time", "-o", out.name, "-f", "%e %U %S %M", *cmd], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
        wall, user, sys_, rss_kb = out.read().split()[-4:]
    return {"wall": float(wall), "cpu": float(user) + float(sys_), "rss": int(rss_kb) * 1024}


def model_sizes(src: Path, tokens: int) -> dict:
    """fp32 bytes of all weights, of the largest decoder layer, and of one layer's activations."""
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.spec import build_spec

    ckpt = open_checkpoint(src)
    spec = build_spec(ckpt.config)
    layer_tmpl = spec.arch.weights["layer"]
    per_layer: dict[int, int] = {}
    total = 0
    for name, info in ckpt.tensors.items():
        n = 4 * (info.nbytes // max(_elem(info.dtype), 1))
        total += n
        for i in range(spec.num_layers):
            if name.startswith(layer_tmpl.format(layer=i) + "."):
                per_layer[i] = per_layer.get(i, 0) + n
                break
    hidden = int(spec.config.get("hidden_size") or 0)
    return {"weights": total, "layer": max(per_layer.values(), default=0), "activations": tokens * hidden * 4,
            "layers": spec.num_layers}


def _elem(st: str) -> int:
    return {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}.get(st, 1)


def compare(a: Path, b: Path) -> float:
    """Largest absolute difference between the tensors of two converted checkpoints (one tensor at a time)."""
    from kvtool.io.reader import CheckpointReader

    with CheckpointReader(a) as ra, CheckpointReader(b) as rb:
        if set(ra.names()) != set(rb.names()):
            raise SystemExit("the two outputs hold different tensor names")
        return max(float((ra.get(n).float() - rb.get(n).float()).abs().max()) for n in ra.names())


def deeper_copy(src: Path, dst: Path, times: int) -> Path:
    """src with every decoder layer repeated `times` times (layer i -> layers i*times .. i*times+times-1),
    tensor bytes copied file to file: the same per-layer work, `times` x the weights."""
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.io.reader import CheckpointReader
    from kvtool.io.writer import PlannedTensor, ShardWriter
    from kvtool.model.spec import build_spec

    ckpt = open_checkpoint(src)
    spec = build_spec(ckpt.config)
    prefix = spec.arch.weights["layer"].split("{layer}")[0]
    dst.mkdir(parents=True)
    with CheckpointReader(src) as reader:
        pairs = []  # (new name, source name)
        for name in reader.names():
            if name.startswith(prefix):
                i, rest = name[len(prefix):].split(".", 1)
                pairs += [(f"{prefix}{int(i) * times + k}.{rest}", name) for k in range(times)]
            else:
                pairs.append((name, name))
        plan = [PlannedTensor(new, reader.info(old).dtype, tuple(reader.info(old).shape)) for new, old in pairs]
        with ShardWriter(dst, 10 ** 12, {}, plan=plan) as writer:
            for new, old in pairs:
                writer.copy_from(new, *reader.byte_range(old))
            writer.finalize()
    config = dict(ckpt.config)
    config["num_hidden_layers"] = spec.num_layers * times
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name == "special_tokens_map.json":
            shutil.copy(f, dst / f.name)
    return dst



def measure(cases: dict, env: dict, repeat: int) -> dict:
    """{case: [timed run, ...]}: every case `repeat` times, interleaved so machine load hits every case alike."""
    runs: dict = {k: [] for k in cases}
    for _ in range(repeat):
        for key, cmd in cases.items():
            runs[key].append(timed(cmd, env))
    return runs


def report(cases: dict, runs: dict, sizes: dict, header: str, verdicts: dict, deeper: int | None) -> None:
    """Print sizes, the per-case table (peak RSS above the x1 floor case), layerwise vs whole per model
    (with `verdicts[tag]` appended) and how each peak grows with depth."""
    peak = {k: max(r["rss"] for r in v) for k, v in runs.items()}
    wall = {k: statistics.median(r["wall"] for r in v) for k, v in runs.items()}
    cpu = {k: statistics.median(r["cpu"] for r in v) for k, v in runs.items()}
    floor = peak[("x1", "floor")]
    mib = 2 ** 20
    for tag, sz in sizes.items():
        print(f"{tag}: {sz['layers']} layers, fp32 weights {sz['weights'] / mib:.0f} MiB, largest layer "
              f"{sz['layer'] / mib:.1f} MiB, hidden states of the calibration tokens {sz['activations'] / mib:.1f} MiB")
    print(header)
    print(f"{'model':<6} {'case':<10} {'wall s':>7} {'cpu s':>7} {'peak MiB':>9} {'above floor':>12} {'/ weights':>10}")
    for (tag, case) in cases:
        above = peak[(tag, case)] - floor
        print(f"{tag:<6} {case:<10} {wall[(tag, case)]:>7.1f} {cpu[(tag, case)]:>7.1f} {peak[(tag, case)] / mib:>9.0f} "
              f"{above / mib:>12.0f} {above / sizes[tag]['weights']:>10.2f}")
    for tag in sizes:
        lw, wh = peak[(tag, "layerwise")], peak[(tag, "whole")]
        print(f"{tag}: layerwise / whole peak {lw / wh:.2f}, above the floor {(lw - floor) / (wh - floor):.2f}; "
              f"{verdicts[tag]}")
    if deeper:
        deep = f"x{deeper}"
        for case in ("layerwise", "whole"):
            grow = (peak[(deep, case)] - peak[("x1", case)]) / mib
            more = (sizes[deep]["weights"] - sizes["x1"]["weights"]) / mib
            print(f"{case}: peak grows {grow:+.0f} MiB from x1 to {deep} ({more:.0f} MiB more weights)")


def add_common_args(ap: argparse.ArgumentParser) -> None:
    """--model, --calib-tokens, --repeat, --deeper, --json: what every memory bench takes."""
    ap.add_argument("--model", type=Path, default=None, help="model folder (default: the SmolLM2-135M fixture)")
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--deeper", type=int, default=0, metavar="K",
                    help="also measure a copy with every layer repeated K times (the layerwise peak should not grow)")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON too")


def models_of(args) -> tuple[dict, dict]:
    """(environment for the measured processes, {"x1": model folder}) after add_common_args' parsing."""
    if args.model is None:
        from kvtool.testing.fixtures import smollm2_dir

        args.model = smollm2_dir()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    return env, {"x1": args.model.resolve()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--to", default="mqa")
    args = ap.parse_args(argv)
    env, models = models_of(args)
    work = Path(tempfile.mkdtemp(prefix="kvtool-bench-mem-"))
    try:
        if args.deeper > 1:
            models[f"x{args.deeper}"] = deeper_copy(models["x1"], work / "deeper-src", args.deeper)
        cases = {}
        for tag, src in models.items():
            convert = ["kvtool", "convert", str(src), str(work / f"{tag}-out"), "--to", args.to, "--method", "aware",
                       "--calib-tokens", str(args.calib_tokens), "--no-eval", "--no-progress", "--force"]
            if tag == "x1":
                cases[(tag, "floor")] = [sys.executable, "-c", FLOOR, str(src)]
            cases[(tag, "hf-load")] = [sys.executable, "-c", HF_LOAD, str(src), str(args.calib_tokens)]
            cases[(tag, "whole")] = [*convert[:3], str(work / f"{tag}-whole"), *convert[4:],
                                     "--method-opt", "layerwise=false"]
            cases[(tag, "layerwise")] = convert
        runs = measure(cases, env, args.repeat)
        diffs = {tag: compare(work / f"{tag}-whole", work / f"{tag}-out") for tag in models}
        sizes = {tag: model_sizes(src, args.calib_tokens) for tag, src in models.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report(cases, runs, sizes, f"model {models['x1'].name}, --to {args.to}, {args.calib_tokens} calibration tokens, "
           f"repeat {args.repeat}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}",
           {tag: f"outputs differ by at most {diffs[tag]:.2e}" for tag in models}, args.deeper if len(models) > 1 else None)
    if args.json:
        print(json.dumps({"sizes": sizes, "runs": {f"{t}/{c}": v for (t, c), v in runs.items()},
                          "max_abs_diff": diffs}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
