"""`kvtool quantize-kv`: calibrated FP8 KV-cache scales written the way vLLM loads them."""

from __future__ import annotations

import typer

from kvtool import console
from kvtool import progress as kv_progress
from kvtool.commands.options_cli import command
from kvtool.deps import require_torch
from kvtool.errors import EXIT_OK, UsageError
from kvtool.options.quantize_kv import QuantizeOptions


def register(app: typer.Typer) -> None:
    @command(app, QuantizeOptions, help="Calibrate FP8 KV-cache scales on text and write SRC + scales to DST "
                                        "(compressed-tensors kv_cache_scheme; vLLM loads it as is).")
    def quantize_kv(opts: QuantizeOptions) -> int:
        from kvtool.model.preflight import check_loadable

        check_loadable(opts.src)  # refuse a bad folder before check_options imports torch
        if opts.dry_run:
            from kvtool.quantize.report import render_plan
            from kvtool.quantize.run import check_options  # torch-free: the run's option refusals, before torch

            check_options(opts)

            console.out(render_plan(opts.src, opts.dst, opts.calib_tokens, 0 if opts.no_eval else opts.eval_tokens))
            return EXIT_OK
        if not opts.dst:
            raise UsageError("missing required argument (only --dry-run goes without one)", option="dst")
        require_torch("kvtool quantize-kv")  # before the imports below, which need it
        with kv_progress.session(opts.progress):
            with kv_progress.task("starting (importing torch and transformers)"):
                from kvtool.quantize.report import render
                from kvtool.quantize.run import check_options, quantize_kv as run

            check_options(opts)
            result = run(opts.src, opts.dst, opts)
        console.out(render(result))
        return EXIT_OK
