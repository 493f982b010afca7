"""`eval --kv-sweep --plot FILE.png`: KV bytes per token against PPL ratio and against KLD, one mark per option
(standard errors as bars; hollow: fails the gates), the Pareto frontier as a line, the recommendation ringed."""

from __future__ import annotations

import math
from pathlib import Path

from kvtool.io import plotfile


LABEL_ALL = 20  # beyond this many options only the frontier and the recommendation are named
SPAN = 20  # a metric spanning more than this factor is drawn on a log axis


def write_plot(report, path: str) -> None:
    plt = plotfile.pyplot()
    target = plotfile.check_target(path)
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), dpi=120)
    panels = (("ppl_ratio", "ppl_ratio_se", "frontier_ppl", "PPL ratio (candidate / baseline)"),
              ("kld_mean", "kld_se", "frontier_kld", "KLD (baseline || option), nats/token"))
    models = list(dict.fromkeys(o.model for o in report.options))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    crowded = len(report.options) > LABEL_ALL
    for ax, (metric, se, flag, ylabel) in zip(axes, panels):
        ys = [v for o in report.options
              if isinstance(v := (o.metrics or {}).get(metric), (int, float)) and math.isfinite(v) and v > 0]
        for o in report.options:
            y = (o.metrics or {}).get(metric)
            if not isinstance(y, (int, float)) or not math.isfinite(y):
                continue
            err = (o.metrics or {}).get(se)
            err = err if isinstance(err, (int, float)) and math.isfinite(err) else 0.0
            color = colors[models.index(o.model) % len(colors)]
            marker = "s" if o.candidate else "o"
            ax.errorbar([o.bytes_per_token], [y], yerr=[err], fmt=marker, color=color, markersize=7,
                        markerfacecolor=color if o.passed or not o.gates else "none", capsize=2)
            if o is report.recommended:
                ax.plot([o.bytes_per_token], [y], "o", markersize=15, markerfacecolor="none", color="black")
            if not crowded or getattr(o, flag) or o is report.recommended:  # many options: name the frontier's
                ax.annotate(o.label, (o.bytes_per_token, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
        front = sorted((o.bytes_per_token, (o.metrics or {})[metric]) for o in report.options if getattr(o, flag))
        if front:
            ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="gray", linewidth=1,
                    label="Pareto frontier")
        if ys and max(ys) > SPAN * min(ys):  # a wrecked conversion (PPL x1000) would flatten every dtype to 0
            if metric == "ppl_ratio":
                ax.set_yscale("log")
            else:  # KLD: the baseline's 0 stays on the axis
                ax.set_yscale("symlog", linthresh=min(ys))
        ax.set_xscale("log", base=2)
        ax.set_xlabel("KV cache bytes per token (all layers, as vLLM allocates)")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        for i, m in enumerate(models):  # one colour a checkpoint
            ax.plot([], [], "s" if i else "o", color=colors[i % len(colors)], label=Path(m).name or m)
        ax.legend(fontsize=8)
    gate = "hollow: fails the gates; " if any(o.gates for o in report.options) else ""
    fig.suptitle(f"{Path(report.model).name or report.model}: KV cache options on {report.text} "
                 f"({report.tokens} tokens; {gate}ringed: recommended)", fontsize=10)
    fig.tight_layout()
    plotfile.save(fig, target)
