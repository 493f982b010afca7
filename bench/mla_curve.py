"""Perplexity ratio against KV bytes per token: MLA conversions as a line, head-merging points as markers.

Reads the JSON that `bench/mla_quality.py --json` writes (one row per conversion: label, kind "mla" or "merge",
kv_bytes_per_token, and per text the PPL ratio and its SE) and draws one panel per text, so the curve can be
redrawn without rerunning the conversions:

    python bench/mla_curve.py bench/mla_curve.json docs/mla-curve.png

The original model is a merge point at ratio 1 with no error (the rows carry it). An MLA point whose cached row
(kv_lora_rank + qk_rope_head_dim) the newest vLLM release kvtool has read does not serve is drawn hollow
(`served_by_vllm`; schemas/engines/mla_backends.json): it was measured in transformers only. The figure is written through
kvtool.io.outputfile.replace like kvtool's own plots (kvtool/budget/plot.py): a fresh file renamed over the
target, never written through a link.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KIB = 1024


def texts_of(rows: list[dict]) -> list[str]:
    """The texts every row was scored on, in the first row's order."""
    names = [k for k, v in rows[0].items() if isinstance(v, dict) and "ppl_ratio" in v]
    return [n for n in names if all(n in r for r in rows)]


def served_by_vllm(row: dict, release: str | None = None) -> bool:
    """Whether vLLM (`release`, default the newest kvtool has read) serves this MLA row's cached size."""
    from kvtool.engines import mla

    release = release or mla.read_releases()[-1]
    return row.get("kind") != "mla" or row["cached_dims"] in mla.rows(release).head_sizes


def write_curve_plot(data: dict, path: str | Path) -> None:
    """data: {"title": str, "rows": [...]} as bench/mla_quality.py --json writes it; path: .png / .svg / .pdf."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from kvtool.errors import InputError, UsageError
    from kvtool.io.outputfile import replace

    target = Path(path)
    if target.suffix.lower() not in (".png", ".svg", ".pdf"):
        raise UsageError(f"{path}: use a .png, .svg or .pdf file name", option="plot")
    if not target.parent.is_dir():
        raise InputError("folder does not exist", file=str(target.parent))
    rows = data["rows"]
    texts = texts_of(rows)
    fig, axes = plt.subplots(1, len(texts), figsize=(3.6 * len(texts), 3.4), dpi=100, squeeze=False)
    for ax, text in zip(axes[0], texts):
        lines: dict[str, list[dict]] = {}
        for r in rows:
            if r.get("kind") == "mla":
                lines.setdefault(r.get("series", "MLA"), []).append(r)
        for name, pts in lines.items():
            pts = sorted(pts, key=lambda r: r["kv_bytes_per_token"])
            line = ax.errorbar([r["kv_bytes_per_token"] / KIB for r in pts], [r[text]["ppl_ratio"] for r in pts],
                               yerr=[r[text]["ppl_ratio_se"] for r in pts], capsize=3, linewidth=1.4, label=name)
            color = line[0].get_color()
            for filled in (True, False):  # hollow: a row vLLM does not serve (transformers only)
                pick = [r for r in pts if served_by_vllm(r) == filled]
                ax.plot([r["kv_bytes_per_token"] / KIB for r in pick], [r[text]["ppl_ratio"] for r in pick], "o",
                        markersize=5, color=color, markerfacecolor=color if filled else "white", linestyle="none")
        for r in rows:
            if r.get("kind") == "merge":
                ax.errorbar([r["kv_bytes_per_token"] / KIB], [r[text]["ppl_ratio"]], yerr=[r[text]["ppl_ratio_se"]],
                            marker="s", markersize=6, capsize=3, linestyle="none", label=r["conversion"])
        ax.set_title(text, fontsize=10)
        ax.set_xlabel("KV cache KiB / token")
        ax.grid(True, alpha=0.3)
    axes[0][0].set_ylabel("PPL ratio to the original (± SE)")
    axes[0][0].annotate("hollow: a row vLLM does not serve", xy=(0.02, 0.02), xycoords="axes fraction", fontsize=7)
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(data.get("title", ""), fontsize=9)
    fig.tight_layout()
    try:
        replace(target, lambda fh: fig.savefig(fh, format=target.suffix.lower()[1:]))
    finally:
        plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", type=Path, help="rows written by bench/mla_quality.py --json")
    ap.add_argument("plot", type=Path, help="the figure to write (.png, .svg, .pdf)")
    a = ap.parse_args()
    write_curve_plot(json.loads(a.json.read_text()), a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
