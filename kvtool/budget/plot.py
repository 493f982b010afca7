"""`--plot FILE.png`: KV GiB per GPU against context length, one line per variant, with the KV pool line."""

from __future__ import annotations

from pathlib import Path

from kvtool.budget.budget import Budget, BudgetOptions, figures
from kvtool.io import plotfile

GIB = 2**30


def _lengths(max_len: int) -> list[int]:
    """About 64 context lengths from 1/64 of the maximum to the maximum (linear: windows show as kinks)."""
    n = 64
    return sorted({max(1, round(max_len * i / n)) for i in range(1, n + 1)})


def write_plot(spec, b: Budget, path: str) -> None:
    plt = plotfile.pyplot()
    target = plotfile.check_target(path)
    o: BudgetOptions = b.options
    lengths = _lengths(b.max_model_len)
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=120)
    for f in [b.current, *b.variants]:
        ys = []
        for n in lengths:
            g = figures(spec, f.name, f.kv_heads, f.kv_dtype, f.cache or f.elem_bytes, o, n, b.batched_tokens)
            ys.append(g.kv_bytes_total_per_gpu / GIB)
        ax.plot(lengths, ys, label=f"{f.name} ({f.kv_dtype})", linewidth=2 if f is b.current else 1.4)
    if b.kv_pool_per_gpu is not None:
        ax.axhline(max(b.kv_pool_per_gpu, 0) / GIB, color="black", linestyle="--",
                   label=f"KV pool on {o.gpu.name} ({max(b.kv_pool_per_gpu, 0) / GIB:,.1f} GiB)")
    per = f" per GPU (TP {o.tensor_parallel_size})" if o.tensor_parallel_size > 1 else ""
    ax.set_xlabel("context length (tokens per sequence)")
    ax.set_ylabel(f"KV cache GiB{per}, {o.batch} sequence{'s' if o.batch != 1 else ''}")
    ax.set_title(f"{Path(b.model).name or b.model}: KV cache vs context length", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    plotfile.save(fig, target)
