"""`kvtool quantize-kv`: calibrated FP8 KV-cache scales written the way vLLM loads them."""

from __future__ import annotations

from typing import List, Optional

import typer

from kvtool import progress as kv_progress
from kvtool.deps import require_torch
from kvtool.errors import EXIT_OK

DEFAULT_OBSERVER = "absmax-pow2:2"  # kept equal to kvtool.quantize.observers.DEFAULT_OBSERVER (a test checks)


def register(app: typer.Typer) -> None:
    @app.command("quantize-kv", help="Calibrate FP8 KV-cache scales on text and write SRC + scales to DST "
                                     "(compressed-tensors kv_cache_scheme; vLLM loads it as is).")
    def quantize_kv(
        src: str = typer.Argument(..., help="Source model folder (config.json + safetensors); never modified."),
        dst: Optional[str] = typer.Argument(None, help="Output folder (written to a temporary folder, renamed when "
                                                       "complete)."),
        calib_dataset: Optional[str] = typer.Option(None, "--calib-dataset",
                                                    help="pydoc (built-in, offline; the default) | wikitext2 | "
                                                         "wikitext103 (train split; need `datasets`)."),
        calib_text: Optional[List[str]] = typer.Option(None, "--calib-text",
                                                       help="UTF-8 calibration text file (repeatable; instead of "
                                                            "--calib-dataset)."),
        calib_tokens: int = typer.Option(2048, "--calib-tokens", help="Calibration tokens taken from the text."),
        seq_len: int = typer.Option(512, "--seq-len", help="Tokens per calibration sequence."),
        strategy: str = typer.Option("tensor", "--strategy", help="tensor (one scale per layer) | attn_head (one per KV head)."),
        observer: str = typer.Option(DEFAULT_OBSERVER, "--observer",
                                     help="absmax[:H] | absmax-pow2[:H] | attn-out[:H] | percentile:P | mse (default absmax-pow2:2: 2x the observed max, rounded up to a power of two)."),
        fmt: str = typer.Option("e4m3", "--format", help="FP8 format of the cache: e4m3."),
        device: str = typer.Option("auto", "--device", help="auto | cuda | cuda:N | cpu."),
        dtype: str = typer.Option("auto", "--dtype", help="Model dtype for calibration: auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32."),
        no_eval: bool = typer.Option(False, "--no-eval", help="Skip the quality report."),
        eval_text: Optional[List[str]] = typer.Option(None, "--eval-text",
                                                      help="Held-out text for the report (default: kvtool's built-in evaluation text)."),
        eval_tokens: int = typer.Option(1024, "--eval-tokens", help="Tokens of held-out text for the report."),
        link: bool = typer.Option(False, "--link", help="Hard-link the unchanged source shards into DST instead of "
                                  "copying them: saves disk, but editing either copy in place changes both."),
        force: bool = typer.Option(False, "--force", help="Replace a non-empty DST."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the estimated peak memory and time; write nothing."),
        progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help=kv_progress.FLAG_HELP),
    ) -> int:
        from kvtool.errors import UsageError
        from kvtool.io.preflight import check_loadable

        check_loadable(src)  # refuse a bad folder before check_options imports torch
        if dry_run:
            from kvtool.quantize.report import render_plan

            typer.echo(render_plan(src, dst, calib_tokens, 0 if no_eval else eval_tokens), nl=False)
            return EXIT_OK
        if not dst:
            raise UsageError("missing required argument (only --dry-run goes without one)", field="DST")
        require_torch("kvtool quantize-kv")  # before the imports below, which need it
        with kv_progress.session(progress):
            with kv_progress.task("starting (importing torch and transformers)"):
                from kvtool.quantize.report import render
                from kvtool.quantize.run import QuantizeOptions, check_options, quantize_kv as run

            opts = QuantizeOptions(calib_texts=list(calib_text or []), calib_dataset=calib_dataset,
                                   calib_tokens=calib_tokens, seq_len=seq_len, strategy=strategy, observer=observer,
                                   format=fmt, device=device, dtype=dtype, evaluate=not no_eval,
                                   eval_texts=list(eval_text) if eval_text else None, eval_tokens=eval_tokens,
                                   force=force, link=link)
            check_options(opts)
            result = run(src, dst, opts)
        typer.echo(render(result), nl=False)
        return EXIT_OK
