"""Cold `kvtool lint` on a model folder vs transformers.AutoConfig and modelinfo-cli on the same folder.

Every measurement is a fresh process (cold interpreter, warm OS file cache), interleaved, median of
--repeat runs after one warm-up each. Python runs from bytecode, as an installed package does: the warm-up
writes kvtool's to a scratch PYTHONPYCACHEPREFIX, even in a shell with PYTHONDONTWRITEBYTECODE=1. Two clocks: wall time (what a CI job waits) and CPU time
(user + sys of the child, from wait4: robust on a shared, oversubscribed machine).

Checkpoints:
  llama-3.1-8b-layout  the real Llama-3.1-8B config.json and its 4-shard layout (291 tensors, real names,
                       shapes and bf16 dtype, model.safetensors.index.json). Shard files are sparse: a real
                       header, then a hole up to the true size (16 GB apparent, ~0 on disk), so
                       header-only tools see exactly what they would on the hub checkpoint.
  smollm2-135m         the cached real SmolLM2-135M fixture (kvtool.testing.fixtures), when present.

    python bench/lint_bench.py [--repeat 7] [--json out.json] [--ref /work/main]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LLAMA_CONFIG = REPO / "tests" / "data" / "configs" / "llama-3.1-8b.json"


def _tensors_llama(cfg: dict) -> list[tuple[str, list[int]]]:
    h, inter, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * h // cfg["num_attention_heads"]
    out = [("model.embed_tokens.weight", [v, h])]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out += [(f"{p}.input_layernorm.weight", [h]), (f"{p}.post_attention_layernorm.weight", [h]),
                (f"{p}.self_attn.q_proj.weight", [h, h]), (f"{p}.self_attn.k_proj.weight", [kv, h]),
                (f"{p}.self_attn.v_proj.weight", [kv, h]), (f"{p}.self_attn.o_proj.weight", [h, h]),
                (f"{p}.mlp.gate_proj.weight", [inter, h]), (f"{p}.mlp.up_proj.weight", [inter, h]),
                (f"{p}.mlp.down_proj.weight", [h, inter])]
    return out + [("model.norm.weight", [h]), ("lm_head.weight", [v, h])]


def _write_sparse_shard(path: Path, tensors: list[tuple[str, list[int]]]) -> int:
    """A safetensors file whose data region is a hole: valid header, true size, no bytes on disk."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, shape in tensors:
        n = 2
        for d in shape:
            n *= d
        header[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(raw)))
        fh.write(raw)
        fh.truncate(8 + len(raw) + offset)
    return offset


def build_llama_layout(root: Path, shards: int = 4) -> Path:
    cfg = json.loads(LLAMA_CONFIG.read_text())
    folder = root / "llama-3.1-8b-layout"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(LLAMA_CONFIG, folder / "config.json")
    tensors = _tensors_llama(cfg)
    per = -(-len(tensors) // shards)
    weight_map, total = {}, 0
    for s in range(shards):
        name = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        chunk = tensors[s * per:(s + 1) * per]
        total += _write_sparse_shard(folder / name, chunk)
        weight_map.update({t: name for t, _ in chunk})
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return folder


def _run(cmd: list[str], cwd: Path) -> tuple[float, float, int]:
    """(wall s, cpu s, exit code) of one fresh process, from bytecode (a scratch PYTHONPYCACHEPREFIX).
    A command that starts with PYTHONPATH=DIR runs with that PYTHONPATH (another checkout: --ref)."""
    env = {**os.environ, "PYTHONPYCACHEPREFIX": str(cwd / "pycache")}
    if cmd[0].startswith("PYTHONPATH="):
        env["PYTHONPATH"], cmd = cmd[0].split("=", 1)[1], cmd[1:]
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    _pid, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    proc.returncode = os.waitstatus_to_exitcode(status)
    return wall, usage.ru_utime + usage.ru_stime, proc.returncode


def measure(tools: dict[str, list[str]], repeat: int, cwd: Path) -> dict[str, dict]:
    for cmd in tools.values():  # warm-up: OS file cache, .pyc files
        _run(cmd, cwd)
    samples: dict[str, list[tuple[float, float, int]]] = {k: [] for k in tools}
    for _ in range(repeat):
        for name, cmd in tools.items():  # interleaved, so load spikes hit every tool alike
            samples[name].append(_run(cmd, cwd))
    return {name: {"wall_s": statistics.median(s[0] for s in runs), "cpu_s": statistics.median(s[1] for s in runs),
                   "min_wall_s": min(s[0] for s in runs), "exit_codes": sorted({s[2] for s in runs})}
            for name, runs in samples.items()}


def in_process_ms(folder: Path, repeat: int) -> float:
    """kvtool's own work with imports done: open, headers, all rules, render (lint_one + text)."""
    sys.path.insert(0, str(REPO))
    from kvtool.rules.runner import lint_one
    from kvtool.output import render
    from kvtool.rules.registry import LintOptions

    render([lint_one(str(folder), LintOptions())], "text")  # first call compiles the schema validator
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        render([lint_one(str(folder), LintOptions())], "text")
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--json", type=Path, help="also write the results here")
    ap.add_argument("--ref", type=Path, help="also time `kvtool lint` from this checkout (e.g. /work/main: before / after)")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(prefix="kvtool-lint-bench-") as tmp:
        tmp_path = Path(tmp)
        folders = {"llama-3.1-8b-layout": build_llama_layout(tmp_path)}
        sys.path.insert(0, str(REPO))
        from kvtool.testing.fixtures import FIXTURE_VERSION, cache_root

        cached = cache_root() / f"smollm2-135m-{FIXTURE_VERSION}"  # only when built already: never build here
        if (cached / "model.safetensors").is_file():
            folders["smollm2-135m"] = cached
        modelinfo = shutil.which("modelinfo")
        results = {}
        for label, folder in folders.items():
            shards = sorted(str(p) for p in folder.glob("*.safetensors"))
            tools = {
                "python -c pass": [sys.executable, "-c", "pass"],
                "kvtool lint": [sys.executable, "-m", "kvtool", "lint", str(folder), "--isolated"],
                "AutoConfig.from_pretrained": [sys.executable, "-c",
                                               "import sys; from transformers import AutoConfig; "
                                               "AutoConfig.from_pretrained(sys.argv[1])", str(folder)],
            }
            if modelinfo:
                tools["modelinfo (modelinfo-cli)"] = [modelinfo, *shards]
            if args.ref:
                tools["kvtool lint @ref"] = [f"PYTHONPATH={args.ref.resolve()}", *tools["kvtool lint"]]
            load = os.getloadavg()
            res = measure(tools, args.repeat, tmp_path)
            res["kvtool in-process"] = {"ms": in_process_ms(folder, args.repeat)}
            res["load average"] = {"before": load[0], "after": os.getloadavg()[0]}
            results[label] = res
            base = res["kvtool lint"]
            print(f"\n{label}: {folder}  ({len(shards)} shard(s)); load average {load[0]:.1f} -> "
                  f"{os.getloadavg()[0]:.1f}")
            print(f"{'tool':30} {'wall s':>8} {'cpu s':>8} {'wall x kvtool':>14} {'cpu x kvtool':>13}  exit")
            for name, r in res.items():
                if "before" in r:
                    continue
                if "ms" in r:
                    print(f"{name:30} {r['ms'] / 1000:8.4f}")
                    continue
                print(f"{name:30} {r['wall_s']:8.3f} {r['cpu_s']:8.3f} {r['wall_s'] / base['wall_s']:14.2f} "
                      f"{r['cpu_s'] / base['cpu_s']:13.2f}  {r['exit_codes']}")
            ref = res.get("modelinfo (modelinfo-cli)")
            if "kvtool lint @ref" in res and ref:
                old = res["kvtool lint @ref"]
                print(f"kvtool @ref / modelinfo: {old['wall_s'] / ref['wall_s']:.2f}x wall, "
                      f"{old['cpu_s'] / ref['cpu_s']:.2f}x CPU")
            if ref:
                print(f"kvtool / modelinfo: {base['wall_s'] / ref['wall_s']:.2f}x wall, "
                      f"{base['cpu_s'] / ref['cpu_s']:.2f}x CPU (goal <= 2)")
            auto = res["AutoConfig.from_pretrained"]
            print(f"AutoConfig / kvtool: {auto['wall_s'] / base['wall_s']:.1f}x wall, "
                  f"{auto['cpu_s'] / base['cpu_s']:.1f}x CPU (goal >= 15)")
        if args.json:
            args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
