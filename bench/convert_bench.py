"""Benchmark `kvtool convert` against `cp -r` and the naive transformers way, same run, same files.

Writes a random-weight Llama-layout checkpoint (default: issue 18's 1.5 GB bf16, 12 layers, 16 KV
heads, 2 shards) into a temp folder, then times, as fresh processes under /usr/bin/time -v (wall time
and peak RSS of the process):
  cp      `cp -r SRC DST`
  kvtool  `kvtool convert SRC DST --to gqa --groups G --no-eval --no-progress`
  naive   (--naive) transformers from_pretrained -> mean-pool k_proj / v_proj -> save_pretrained
Steady state (issue 18): right after a checkpoint is written, the kernel writes dirty pages back and
`cp` slows 3x, so the bench syncs, makes one warm-up copy (every tool then reads from the page cache),
and syncs again after every run (untimed) before the next. kvtool runs from bytecode, as an installed
package does (one untimed --dry-run writes it to a scratch PYTHONPYCACHEPREFIX first). Tools alternate, --repeat runs each
(default 5); min and median wall, median CPU and the largest peak RSS are reported, and the ratio
cp / kvtool of the medians. Goals: kvtool >= 0.7x of cp (issue 18); naive: >= 3x faster and <= 1/4
the peak memory (issue 4). Say how busy the machine was: the load average is printed.

    python bench/convert_bench.py [--layers 12] [--hidden 2048] [--heads 16] [--kv-heads 16] [--groups 4]
        [--dtype bf16] [--shard-gb 5] [--repeat 5] [--naive] [--ref /work/main] [--keep DIR] [--dir SCRATCH]

The 8B shape (Llama-3-8B, ~16 GB, 5 GB shards, 8 -> 4 KV heads):
    python bench/convert_bench.py --layers 32 --hidden 4096 --heads 32 --kv-heads 8 --intermediate 14336 \
        --vocab 128256 --groups 4 --shard-gb 5 --repeat 3 --dir /work/bench-scratch
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

NAIVE = r'''
import sys, torch
from transformers import AutoModelForCausalLM
src, dst, G = sys.argv[1], sys.argv[2], int(sys.argv[3])
model = AutoModelForCausalLM.from_pretrained(src, dtype="auto")
cfg = model.config
H, KV = cfg.num_attention_heads, cfg.num_key_value_heads
hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // H
with torch.no_grad():
    for layer in model.model.layers:
        attn = layer.self_attn
        for name in ("k_proj", "v_proj"):
            old = getattr(attn, name)
            w = old.weight.reshape(G, KV // G, hd, -1).float().mean(1).to(old.weight.dtype).reshape(G * hd, -1)
            new = torch.nn.Linear(w.shape[1], w.shape[0], bias=False, dtype=w.dtype)
            new.weight.copy_(w)
            setattr(attn, name, new)
cfg.num_key_value_heads = G
model.save_pretrained(dst)
'''


DTYPES = {"bf16": ("BF16", "bfloat16"), "fp16": ("F16", "float16"), "fp32": ("F32", "float32")}


def make_checkpoint(folder: Path, layers: int, hidden: int, heads: int, inter: int, vocab: int, *,
                    kv_heads: int | None = None, dtype: str = "fp16", shard_bytes: int | None = None) -> int:
    """Random-weight Llama checkpoint (normal, std 0.02), written with kvtool's own ShardWriter.

    `shard_bytes` None: 2 shards. Weights are drawn one row block at a time in torch (bounded memory)."""
    import torch

    from kvtool.io.writer import PlannedTensor, ShardWriter

    st, name = DTYPES[dtype]
    kv_heads = kv_heads or heads
    hd = hidden // heads
    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv_heads, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": name,
           "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes[f"{p}.self_attn.q_proj.weight"] = (hidden, hidden)
        shapes[f"{p}.self_attn.k_proj.weight"] = (kv_heads * hd, hidden)
        shapes[f"{p}.self_attn.v_proj.weight"] = (kv_heads * hd, hidden)
        shapes[f"{p}.self_attn.o_proj.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    plan = [PlannedTensor(n, st, s) for n, s in shapes.items()]
    total = sum(p.nbytes for p in plan)
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(folder, max_shard_size=shard_bytes or total // 2 + 1, plan=plan)
    tdtype = getattr(torch, name)
    for n, s in shapes.items():
        t = torch.empty(s, dtype=tdtype)
        step = max(1, 2**24 // max(1, math.prod(s[1:])))
        for a in range(0, s[0], step):
            t[a:a + step] = torch.randn((min(step, s[0] - a), *s[1:]), generator=g) * 0.02
        w.add(n, t)
    w.finalize()
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return sum(p.stat().st_size for p in folder.iterdir())


def timed(cmd: list[str], env: dict | None = None, cwd: str | None = None) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds user + system) of one fresh process (/usr/bin/time -v).

    `env` replaces the environment when given."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True,
                          env=env, cwd=cwd)
    if proc.returncode != 0:
        raise SystemExit(f"command failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-2000:]}")
    wall = re.search(r"Elapsed \(wall clock\) time.*: (?:(\d+):)?(\d+):([\d.]+)", proc.stderr)
    h, m, s = wall.groups()
    seconds = int(h or 0) * 3600 + int(m) * 60 + float(s)
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    cpu = sum(float(re.search(rf"{k} time \(seconds\): ([\d.]+)", proc.stderr).group(1)) for k in ("User", "System"))
    return seconds, rss_kb * 1024, cpu


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=None, help="default 12")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--kv-heads", type=int, default=None, help="default: --heads (MHA)")
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    ap.add_argument("--shard-gb", type=float, default=None, help="shard size (default: 2 shards)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--naive", action="store_true", help="also time the naive transformers way")
    ap.add_argument("--ref", help="also time the kvtool checkout at this path (e.g. /work/main: before / after)")
    ap.add_argument("--keep", help="reuse / keep the generated checkpoint in this folder")
    ap.add_argument("--dir", default=os.environ.get("TMPDIR"), help="scratch folder for the outputs")
    args = ap.parse_args()
    args.layers = 12 if args.layers is None else args.layers

    base = Path(tempfile.mkdtemp(prefix="kvtool-convert-bench-", dir=args.dir))
    src = Path(args.keep) if args.keep else base / "src"
    try:
        if not (src / "config.json").exists():
            print("writing the checkpoint ...", file=sys.stderr)
            size = make_checkpoint(src, args.layers, args.hidden, args.heads, args.intermediate, args.vocab,
                                   kv_heads=args.kv_heads, dtype=args.dtype,
                                   shard_bytes=int(args.shard_gb * 1e9) if args.shard_gb else None)
        else:
            size = sum(p.stat().st_size for p in src.iterdir())
        naive_py = base / "naive.py"
        naive_py.write_text(NAIVE)
        kvtool = [sys.executable, "-m", "kvtool", "convert", str(src), None, "--to", "gqa", "--groups",
                  str(args.groups), "--no-eval", "--no-progress"]
        tools = {
            "cp": lambda d: ["cp", "-r", str(src), str(d)],
            "kvtool": lambda d: [x if x is not None else str(d) for x in kvtool],
        }
        # Python runs from bytecode as in an installed package: a PYTHONDONTWRITEBYTECODE=1 shell would
        # otherwise make every run compile kvtool from source (~40 ms), which no installed kvtool does.
        py_env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
        py_env["PYTHONPYCACHEPREFIX"] = str(base / "pycache")
        envs = {"kvtool": py_env, "naive": py_env}
        if args.ref:
            tools["kvtool@ref"] = tools["kvtool"]
            # `python -m` puts the working directory first on sys.path: run the reference from its checkout
            envs["kvtool@ref"] = {**py_env, "PYTHONPATH": str(Path(args.ref).resolve())}
        if args.naive:
            tools["naive"] = lambda d: [sys.executable, str(naive_py), str(src), str(d), str(args.groups)]
        for name in [t for t in tools if t.startswith("kvtool")]:  # writes the bytecode, untimed
            timed([*tools[name](base / "warm"), "--dry-run"], envs[name], args.ref if name == "kvtool@ref" else None)
        os.sync()
        timed(tools["cp"](base / "warm"))  # warm the page cache for everyone
        shutil.rmtree(base / "warm")
        os.sync()  # steady state: no dirty pages of earlier runs being written back during a timed run
        load = [os.getloadavg()[0]]
        results: dict[str, list[tuple[float, int, float]]] = {t: [] for t in tools}
        for i in range(args.repeat):
            for name, cmd in tools.items():
                out = base / f"out-{name}"
                results[name].append(timed(cmd(out), envs.get(name), args.ref if name == "kvtool@ref" else None))
                print(f"run {i + 1}/{args.repeat} {name}: {results[name][-1][0]:.2f} s", file=sys.stderr)
                shutil.rmtree(out)
                os.sync()
                load.append(os.getloadavg()[0])
        kv_heads = args.kv_heads or args.heads
        print(f"checkpoint: {size / 1e9:.2f} GB {args.dtype} ({args.layers} layers, hidden {args.hidden}, "
              f"{args.heads} heads, {kv_heads} KV heads) -> {args.groups} KV heads; {args.repeat} alternating runs "
              f"each after a sync and a warm-up copy")
        print(f"{'tool':10} {'min s':>7} {'median s':>9} {'GB/s':>7} {'CPU s':>7} {'peak RSS MiB':>13}")
        summary = {}
        for name, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            low = min(r[0] for r in runs)
            rss = max(r[1] for r in runs)
            cpu = statistics.median(r[2] for r in runs)
            summary[name] = (wall, rss, cpu, low)
            print(f"{name:10} {low:7.2f} {wall:9.2f} {size / wall / 1e9:7.2f} {cpu:7.2f} {rss / 2**20:13.0f}")
        print(f"load average (1 min) during the runs: {min(load):.1f}-{max(load):.1f} on {os.cpu_count()} CPUs")
        cp, kv = summary["cp"], summary["kvtool"]
        print(f"kvtool vs cp: {cp[0] / kv[0]:.2f}x of cp's speed (medians), {cp[3] / kv[3]:.2f}x (minima); goal >= 0.7")
        if "kvtool@ref" in summary:
            ref = summary["kvtool@ref"]
            print(f"kvtool@ref ({args.ref}) vs cp: {cp[0] / ref[0]:.2f}x (medians), {cp[3] / ref[3]:.2f}x (minima)")
        if "naive" in summary:
            naive = summary["naive"]
            print(f"kvtool vs naive: {naive[0] / kv[0]:.2f}x faster (goal >= 3), peak RSS {kv[1] / naive[1]:.2f}x "
                  f"of naive (goal <= 0.25)")
    finally:
        if args.keep:
            for p in base.iterdir():
                shutil.rmtree(p) if p.is_dir() and not p.is_symlink() else p.unlink()
            base.rmdir()
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
