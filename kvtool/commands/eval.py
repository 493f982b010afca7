"""`kvtool eval`: perplexity / KL-divergence quality gate, with FP8 KV-cache emulation."""

from __future__ import annotations

import json
import math
from typing import List, Optional

import typer

from kvtool import progress as kv_progress
from kvtool.deps import require_torch
from kvtool.errors import EXIT_FINDINGS, EXIT_OK, UsageError


def register(app: typer.Typer) -> None:
    @app.command("eval", help="Perplexity of MODEL and, against --baseline, PPL ratio, KL divergence and top-1 "
                              "agreement on the same tokens; exit 1 when a gate fails.")
    def eval_cmd(
        model: str = typer.Argument(..., help="Model folder or hub id (the candidate)."),
        baseline: Optional[str] = typer.Option(None, "--baseline", help="Reference model (same tokenizer)."),
        text: Optional[List[str]] = typer.Option(None, "--text", help="UTF-8 text file(s), joined into one stream."),
        dataset: Optional[str] = typer.Option(None, "--dataset", help="pydoc (built-in, offline; the default), "
                                                                       "wikitext2, wikitext103 (need `datasets`)."),
        max_length: int = typer.Option(1024, "--max-length", help="Window length L in tokens."),
        stride: Optional[int] = typer.Option(None, "--stride", help="Window step S < L (default L/2)."),
        max_tokens: Optional[int] = typer.Option(None, "--max-tokens", help="Use only the first N tokens of the stream."),
        device: str = typer.Option("auto", "--device", help="auto | cuda | cuda:N | cpu"),
        dtype: str = typer.Option("auto", "--dtype", help="auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp16 | fp32"),
        device_map: Optional[str] = typer.Option(None, "--device-map", help="auto: shard over all GPUs (+CPU) with accelerate."),
        max_memory: Optional[str] = typer.Option(None, "--max-memory", help="With --device-map: per-device limits, e.g. 0=70GiB,cpu=100GiB (the rest is offloaded to disk)."),
        batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Windows per forward (default 1 on CPU, 8192/L on CUDA)."),
        kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto (fp8 when the checkpoint has KV scales) | fp8 | off"),
        kv_scales: str = typer.Option("checkpoint", "--kv-scales", help="checkpoint | one (1.0, vLLM's default)"),
        max_ppl_increase: str = typer.Option("2%", "--max-ppl-increase", help="Gate: PPL ratio - 1 (with --baseline; 'off' disables)."),
        max_kld: Optional[float] = typer.Option(None, "--max-kld", help="Gate: mean KL(baseline||model), nats/token."),
        min_top1: Optional[float] = typer.Option(None, "--min-top1", help="Gate: top-1 agreement with the baseline."),
        output_format: str = typer.Option("text", "--format", help="text | json"),
        progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help=kv_progress.FLAG_HELP),
    ) -> int:
        from kvtool.eval.texts import read_texts
        from kvtool.units import gate_threshold, parse_percent

        if output_format not in ("text", "json"):
            raise UsageError(f"unknown format {output_format!r}; use text or json", field="--format")
        gates = {}
        if max_ppl_increase.strip().lower() not in ("off", "none", ""):
            try:
                gates["--max-ppl-increase"] = parse_percent(max_ppl_increase)
            except ValueError as exc:
                raise UsageError(str(exc), field="--max-ppl-increase") from None
        if max_kld is not None:
            try:
                gates["--max-kld"] = gate_threshold(max_kld)
            except ValueError as exc:
                raise UsageError(str(exc), field="--max-kld") from None
        if min_top1 is not None:
            if not 0.0 <= min_top1 <= 1.0:
                raise UsageError(f"must be between 0 and 1, got {min_top1}", field="--min-top1")
            gates["--min-top1"] = min_top1
        if baseline is None:
            explicit = [g for g in gates if g != "--max-ppl-increase"]
            if explicit:
                raise UsageError("compares against a baseline; give --baseline", field=explicit[0])
            gates = {}  # the default PPL gate needs a baseline; without one, PPL alone
        texts, text_name = read_texts(text, dataset)
        if max_memory is not None:
            from kvtool.eval.api import parse_max_memory  # torch-free: parses only

            max_memory = parse_max_memory(max_memory)
        from kvtool.io.preflight import check_loadable

        check_loadable(model, baseline)  # refuse a bad folder before torch and transformers are imported
        require_torch("kvtool eval")
        with kv_progress.session(progress):
            with kv_progress.task("starting (importing torch and transformers)"):
                from kvtool.eval.api import evaluate
            report = evaluate(model, baseline, texts=texts, text_name=text_name, max_length=max_length,
                              stride=stride, max_tokens=max_tokens, device=device, dtype=dtype,
                              kv_cache_dtype=kv_cache_dtype, kv_scales=kv_scales, batch_size=batch_size,
                              device_map=device_map, max_memory=max_memory, gates=gates)
        if output_format == "json":
            typer.echo(json.dumps(_finite(report.as_dict()), indent=2, sort_keys=True))
        else:
            typer.echo(render_text(report))
        if not report.passed:
            names = ", ".join(f"{g.metric} ({g.option})" for g in report.failed_gates)
            typer.echo(f"kvtool: gate failed: {names}", err=True)
            return EXIT_FINDINGS
        return EXIT_OK


def _finite(obj):
    """JSON has no NaN: undefined values (e.g. a standard error of one token) become null."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def render_text(r) -> str:
    m = r.metrics
    lines = [f"model     {r.model}" + (f"  (baseline {r.baseline})" if r.baseline else "")]
    lines.append(f"text      {r.text}: {m['tokens']} tokens scored, {r.windows} windows of {r.window} (stride {r.stride})")
    kv = r.kv_cache_dtype
    if r.kv_scales:
        s = r.kv_scales
        if s["layers"] == 0:
            kv += " emulated, scale 1.0 in every layer (vLLM's default without scales)"
        else:
            kv += f" emulated, {s['source']} scales for {s['layers']} layers ({s['min_scale']:.4g}..{s['max_scale']:.4g})"
    lines.append(f"device    {r.device}, {r.dtype}, KV cache {kv}")
    lines.append(f"ppl       {m['ppl']:.4f} ± {m['ppl_se']:.4f}")
    if r.baseline:
        lines.append(f"baseline  {m['baseline_ppl']:.4f} ± {m['baseline_ppl_se']:.4f}")
        lines.append(f"ratio     {m['ppl_ratio']:.5f} ± {m['ppl_ratio_se']:.5f}  (log {m['log_ppl_ratio']:+.5f})")
        lines.append(f"kld       {m['kld_mean']:.6f} ± {m['kld_se']:.6f} nats/token (KL(baseline || model))")
        lines.append(f"top-1     {m['top1_agreement']:.4f} ± {m['top1_se']:.4f}")
        lines.append(f"p(correct) change: mean {m['dp_mean']:+.5f} ± {m['dp_se']:.5f}, rms {m['dp_rms']:.5f}")
    rate = m["tokens"] / r.seconds if r.seconds > 0 else float("nan")
    lines.append(f"time      {r.seconds:.1f} s ({rate:,.0f} scored tokens/s, {r.forwards_per_window} model "
                 f"forward(s) per window)")
    for g in r.gates:
        lines.append(f"gate      {g.line()}")
    if r.gates:
        lines.append("result    " + ("passed" if r.passed else "FAILED"))
    return "\n".join(lines)
