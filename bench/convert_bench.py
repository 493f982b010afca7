"""Benchmark `kvtool convert` against `cp -r` and the naive transformers way, same run, same files.

Writes a random-weight Llama-layout checkpoint (default ~1.3 GB fp16, 2 shards) into a temp folder,
then times, as fresh processes under /usr/bin/time -v (wall time and peak RSS of the process):
  cp      `cp -r SRC DST`
  naive   transformers from_pretrained -> mean-pool k_proj / v_proj -> save_pretrained
  kvtool  `kvtool convert SRC DST --to gqa --groups G --no-eval --no-progress`
Each tool runs --repeat times, interleaved, after one warm-up `cp` (so every tool reads from the
page cache); the median wall time and the largest peak RSS are reported. Outputs are removed
between runs. Goals (issue 4): kvtool >= 0.5x cp throughput; >= 3x faster and <= 1/4 the peak
memory of naive.

    python bench/convert_bench.py [--layers 10] [--hidden 2048] [--groups 4] [--repeat 3] [--keep DIR]
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


def make_checkpoint(folder: Path, layers: int, hidden: int, heads: int, inter: int, vocab: int) -> int:
    """Random fp16 Llama checkpoint (MHA), 2 shards, written with kvtool's own ShardWriter."""
    import torch

    from kvtool.io.writer import PlannedTensor, ShardWriter

    folder.mkdir(parents=True)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": heads, "vocab_size": vocab, "max_position_embeddings": 4096,
           "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float16",
           "bos_token_id": 1, "eos_token_id": 2}
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    shapes = {"model.embed_tokens.weight": (vocab, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        for n in ("q", "k", "v", "o"):
            shapes[f"{p}.self_attn.{n}_proj.weight"] = (hidden, hidden)
        shapes[f"{p}.mlp.gate_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.up_proj.weight"] = (inter, hidden)
        shapes[f"{p}.mlp.down_proj.weight"] = (hidden, inter)
        shapes[f"{p}.input_layernorm.weight"] = (hidden,)
        shapes[f"{p}.post_attention_layernorm.weight"] = (hidden,)
    shapes["model.norm.weight"] = (hidden,)
    shapes["lm_head.weight"] = (vocab, hidden)
    total = sum(2 * math.prod(s) for s in shapes.values())
    plan = [PlannedTensor(n, "F16", s) for n, s in shapes.items()]
    g = torch.Generator().manual_seed(0)
    w = ShardWriter(folder, max_shard_size=total // 2 + 1, plan=plan)
    for n, s in shapes.items():
        w.add(n, (torch.randn(s, generator=g) * 0.02).to(torch.float16))
    w.finalize()
    (folder / "generation_config.json").write_text('{"bos_token_id": 1, "eos_token_id": 2}')
    return sum(p.stat().st_size for p in folder.iterdir())


def timed(cmd: list[str]) -> tuple[float, int, float]:
    """(wall seconds, peak RSS bytes, CPU seconds user + system) of one fresh process (/usr/bin/time -v)."""
    proc = subprocess.run(["/usr/bin/time", "-v", *cmd], capture_output=True, text=True)
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
    ap.add_argument("--layers", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--intermediate", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--groups", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--keep", help="reuse / keep the generated checkpoint in this folder")
    args = ap.parse_args()

    base = Path(tempfile.mkdtemp(prefix="kvtool-convert-bench-", dir=os.environ.get("TMPDIR")))
    src = Path(args.keep) if args.keep else base / "src"
    try:
        if not (src / "config.json").exists():
            size = make_checkpoint(src, args.layers, args.hidden, args.heads, args.intermediate, args.vocab)
        else:
            size = sum(p.stat().st_size for p in src.iterdir())
        naive_py = base / "naive.py"
        naive_py.write_text(NAIVE)
        kvtool = [sys.executable, "-m", "kvtool", "convert", str(src), None, "--to", "gqa", "--groups",
                  str(args.groups), "--no-eval", "--no-progress"]
        tools = {
            "cp": lambda d: ["cp", "-r", str(src), str(d)],
            "naive": lambda d: [sys.executable, str(naive_py), str(src), str(d), str(args.groups)],
            "kvtool": lambda d: [x if x is not None else str(d) for x in kvtool],
        }
        timed(tools["cp"](base / "warm"))  # warm the page cache for everyone
        shutil.rmtree(base / "warm")
        results: dict[str, list[tuple[float, int, float]]] = {t: [] for t in tools}
        for _ in range(args.repeat):
            for name, cmd in tools.items():
                out = base / f"out-{name}"
                results[name].append(timed(cmd(out)))
                shutil.rmtree(out)
        print(f"checkpoint: {size / 1e9:.2f} GB fp16 ({args.layers} layers, hidden {args.hidden}, {args.heads} heads), "
              f"MHA -> GQA-{args.groups}; median wall of {args.repeat}, max peak RSS")
        print(f"{'tool':8} {'wall s':>8} {'GB/s':>7} {'CPU s':>7} {'peak RSS MiB':>13}")
        summary = {}
        for name, runs in results.items():
            wall = statistics.median(r[0] for r in runs)
            rss = max(r[1] for r in runs)
            cpu = statistics.median(r[2] for r in runs)
            summary[name] = (wall, rss, cpu)
            print(f"{name:8} {wall:8.2f} {size / wall / 1e9:7.2f} {cpu:7.2f} {rss / 2**20:13.0f}")
        print(f"load average during the run: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        cp, naive, kv = summary["cp"], summary["naive"], summary["kvtool"]
        print(f"kvtool throughput vs cp: {cp[0] / kv[0]:.2f}x (goal >= 0.5)")
        print(f"kvtool vs naive: {naive[0] / kv[0]:.2f}x faster (goal >= 3), peak RSS {kv[1] / naive[1]:.2f}x of naive "
              f"(goal <= 0.25)")
    finally:
        if args.keep:
            for p in base.iterdir():
                shutil.rmtree(p) if p.is_dir() else p.unlink()
            base.rmdir()
        else:
            shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
