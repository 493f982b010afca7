"""Wall time of `kvtool kv-budget` on a model folder against modelinfo-cli on the same weights.

Both tools read only the safetensors header and config; both are timed as fresh processes, the way
a user runs them, interleaved, median of --repeat runs, in the same session (so the ratio holds on
a loaded machine even when absolute times do not). kvtool's in-process time (open + compute +
render, imports already done) is reported too, to separate start-up cost from the work.

    python bench/kv_budget_bench.py [--repeat 7] [--model FOLDER ...]

Without --model it uses the cached Gemma-3-270M fixture (kvtool.testing.fixtures, if built) and a
synthetic Llama-layout checkpoint written to a temporary folder. modelinfo-cli is optional
(`pip install modelinfo-cli`); without it only kvtool is timed.
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
import time
from pathlib import Path


def synthetic_checkpoint(root: Path) -> Path:
    """A 32-layer Llama-layout checkpoint (291 tensors, ~70 MB) with a config that matches its shapes."""
    import numpy as np
    from safetensors.numpy import save_file

    h, inter, layers, heads, kv, vocab = 256, 512, 32, 8, 2, 32000
    hd = h // heads
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": h,
           "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "vocab_size": vocab, "max_position_embeddings": 32768,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False, "rope_theta": 500000.0}
    t = {"model.embed_tokens.weight": np.zeros((vocab, h), np.float16),
         "lm_head.weight": np.zeros((vocab, h), np.float16), "model.norm.weight": np.zeros(h, np.float16)}
    for i in range(layers):
        p = f"model.layers.{i}"
        t[f"{p}.self_attn.q_proj.weight"] = np.zeros((heads * hd, h), np.float16)
        t[f"{p}.self_attn.k_proj.weight"] = np.zeros((kv * hd, h), np.float16)
        t[f"{p}.self_attn.v_proj.weight"] = np.zeros((kv * hd, h), np.float16)
        t[f"{p}.self_attn.o_proj.weight"] = np.zeros((h, heads * hd), np.float16)
        t[f"{p}.mlp.gate_proj.weight"] = np.zeros((inter, h), np.float16)
        t[f"{p}.mlp.up_proj.weight"] = np.zeros((inter, h), np.float16)
        t[f"{p}.mlp.down_proj.weight"] = np.zeros((h, inter), np.float16)
        t[f"{p}.input_layernorm.weight"] = np.zeros(h, np.float16)
        t[f"{p}.post_attention_layernorm.weight"] = np.zeros(h, np.float16)
    folder = root / "synthetic-llama-32l"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(t, str(folder / "model.safetensors"))
    return folder


def default_models(tmp: Path) -> list[Path]:
    models = []
    try:
        from kvtool.testing.fixtures import cache_root

        g = cache_root() / "gemma3-270m-v1"
        if (g / "model.safetensors").is_file():
            models.append(g)
    except ImportError:
        pass
    models.append(synthetic_checkpoint(tmp))
    return models


def wall(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    res = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    dt = time.perf_counter() - t0
    if res.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()[-300:]}")
    return dt


def in_process(folder: Path, repeat: int) -> float:
    from kvtool.budget.budget import BudgetOptions, compute
    from kvtool.budget.gpus import resolve
    from kvtool.budget.report import render_json
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.spec import build_spec

    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ckpt = open_checkpoint(str(folder), read_side_files=False)
        spec = build_spec(ckpt.config)
        render_json(compute(ckpt, spec, BudgetOptions(max_model_len=32768, gpu=resolve("RTX-4090"))))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--model", action="append", type=Path, help="model folder (config.json + one .safetensors)")
    args = ap.parse_args()
    kvtool = [sys.executable, "-m", "kvtool"]
    modelinfo = shutil.which("modelinfo")
    print(f"python {sys.version.split()[0]}, repeat {args.repeat}, modelinfo: {modelinfo or 'not installed'}")
    print("| checkpoint | kvtool kv-budget (s) | modelinfo --vllm (s) | ratio kvtool/modelinfo | kvtool in-process (ms) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    with tempfile.TemporaryDirectory() as tmp:
        # from bytecode, as an installed package runs (the warm-up call writes kvtool's), in any shell
        os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
        os.environ["PYTHONPYCACHEPREFIX"] = str(Path(tmp) / "pycache")
        print(f"load average {os.getloadavg()[0]:.1f}")
        for folder in args.model or default_models(Path(tmp)):
            files = sorted(folder.glob("*.safetensors"))
            k_cmd = [*kvtool, "kv-budget", str(folder), "--gpu", "RTX-4090", "--max-model-len", "32768"]
            m_cmd = [modelinfo, str(files[0]), "--context", "32768", "--gpu", "RTX4090", "--vllm"] if modelinfo and len(files) == 1 else None
            wall(k_cmd)  # warm the page cache for both
            if m_cmd:
                wall(m_cmd)
            k, m = [], []
            for _ in range(args.repeat):
                k.append(wall(k_cmd))
                if m_cmd:
                    m.append(wall(m_cmd))
            km = statistics.median(k)
            mm = statistics.median(m) if m else None
            ratio = f"{km / mm:.2f}" if mm else "-"
            inproc = in_process(folder, args.repeat) * 1000
            print(f"| {folder.name} | {km:.3f} | {'-' if mm is None else f'{mm:.3f}'} | {ratio} | {inproc:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
