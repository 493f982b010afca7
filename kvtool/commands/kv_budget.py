"""`kvtool kv-budget`: what the KV cache costs and how much fits on a GPU (config + headers, no torch)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool import console
from kvtool.commands.options_cli import command
from kvtool.errors import EXIT_FINDINGS, EXIT_OK
from kvtool.options.kv_budget import KvBudgetOptions


if TYPE_CHECKING:  # typer is imported by the typer CLI only (kvtool/commands/argv.py)
    import typer


def register(app: typer.Typer) -> None:
    @command(app, KvBudgetOptions, help=(
        "KV-cache bytes per layer, token and sequence, and how many sequences fit on a GPU, as vLLM's paged "
        "allocator sizes them. Exit 1 when the model or the asked batch does not fit, or vLLM would refuse the "
        "tensor-parallel size; 2 on bad input."))
    def kv_budget(o: KvBudgetOptions) -> int:
        from kvtool.budget.report import render_json, render_text
        from kvtool.budget.run import apply, plan

        p = plan(o)
        b = apply(p)
        if o.plot:
            from kvtool.budget.plot import write_plot

            write_plot(p.spec, b, o.plot)
        console.out(render_json(b) if o.format == "json" else render_text(b))
        return EXIT_FINDINGS if b.problems else EXIT_OK
