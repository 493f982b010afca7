"""`kvtool eval`: perplexity / KL-divergence quality gate, with FP8 KV-cache emulation."""

from __future__ import annotations

import math

import typer

from kvtool import console
from kvtool import progress as kv_progress
from kvtool.commands.options_cli import command
from kvtool.deps import require_torch
from kvtool.errors import EXIT_FINDINGS, EXIT_OK
from kvtool.model.engine_tables import newest_read
from kvtool.options.eval import EvalOptions


def register(app: typer.Typer) -> None:
    @command(app, EvalOptions, help="Perplexity of MODEL and, against --baseline, PPL ratio, KL divergence and "
                                    "top-1 agreement on the same tokens; exit 1 when a gate fails.")
    def eval_cmd(o: EvalOptions) -> int:
        from kvtool.eval.run import apply, plan, render_plan

        p = plan(o.model, o)
        if o.dry_run:
            console.out(render_plan(p))
            return EXIT_OK
        if not o.server:  # a server's figures need neither torch nor transformers
            require_torch("kvtool eval")
        with kv_progress.session(o.progress):
            if not o.server:
                with kv_progress.task("starting (importing torch and transformers)"):
                    from kvtool.eval.api import evaluate  # noqa: F401  (the import is the task)
            report = apply(p)
        if o.format == "json":
            console.out(console.json_text(_finite(report.as_dict()), indent=2, sort_keys=True))
        elif o.kv_sweep:
            from kvtool.eval.sweep import render_text as sweep_text

            console.out(sweep_text(report))
        else:
            console.out(render_text(report))
        if not report.passed:
            names = ", ".join(f"{g.metric} ({g.flag})" for g in report.failed_gates)
            console.out(f"kvtool: gate failed: {names}", err=True)
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


def _kv_cache_lines(kv: dict | None) -> list[str]:
    """The emulation's row, as the report states it (kvtool.eval.api.kv_cache_info)."""
    if not kv:
        return []
    params = ", ".join(f"{k} {v}" for k, v in kv["params"].items())
    how = (f"exact (vLLM's code, {kv['oracle']})" if kv["match"] == "exact"
           else f"assumed: {kv['assumption']}")
    out = [f"kv cache  {kv['dtype']} emulated by the {kv['codec']} codec" + (f" ({params})" if params else "")
           + f"; scales: {kv['scales_used']}; {kv['cited']}",
           f"kv cache  {kv['reads']}; match to vLLM {how}"]
    if kv.get("kept_layers"):
        out.append(f"kv cache  layers {', '.join(map(str, kv['kept_layers']))} kept in the model dtype "
                   "(vLLM's boundary layers)")
    if kv.get("note"):
        out.append(f"kv cache  {kv['note']}")
    return out


def render_text(r) -> console.Text:
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
        if s.get("cache") == "mla_latent":
            kv += "; MLA: the cached latent (kv_c_normed) and rotated k_pe, one scale per layer (vLLM TRITON_MLA)"
    lines.append(f"device    {r.device}, {r.dtype}, KV cache {kv}")
    lines += _kv_cache_lines(getattr(r, "kv_cache", None))
    fa = getattr(r, "fp8_attention", None)
    if fa and fa["name"] != "cache-only":
        att = f"attention {fa['name']} emulated (vLLM {fa['vllm']}): "
        if fa.get("kv_format") and fa.get("kv_rounding"):  # how K/V are stored (toward-zero: vLLM's CPU build)
            att += f"K/V {fa['kv_format']} rounded {fa['kv_rounding']}, "
        att += f"queries {fa['queries']}"
        q = fa.get("q_scales")
        if q:
            att += (f", checkpoint q scales for {q['checkpoint_layers']} layers ({q['min_scale']:.4g}..{q['max_scale']:.4g})"
                    if q["checkpoint_layers"] else f", q scale {q['fallback']:g} (no q scales in the checkpoint; vLLM "
                                                   f"{newest_read('vllm')} uses 1.0, not k_scale)")
        lines.append(f"fp8       {att}; probabilities {fa['probabilities']}")
    tok = (r.memory or {}).get("tokenization")
    if tok and tok["differ"]:
        lines.append(f"tokens    the local tokenizer splits {tok['differ']} of the {tok['scored']} scored tokens "
                     f"differently (the first at token {tok['first']}); both sides score the server's ids")
    if r.memory and r.memory.get("windows_moved"):
        lines.append(f"windows   {r.memory['windows_moved']} started up to a few tokens late so that their text "
                     "tokenizes back to their tokens")
    reads = (r.memory or {}).get("cache_reads")
    if reads:
        from kvtool.eval.served_reads import line

        lines.append(line(reads))
    lines.append(f"ppl       {m['ppl']:.4f} ± {m['ppl_se']:.4f}")
    if r.baseline:
        lines.append(f"baseline  {m['baseline_ppl']:.4f} ± {m['baseline_ppl_se']:.4f}")
        lines.append(f"ratio     {m['ppl_ratio']:.5f} ± {m['ppl_ratio_se']:.5f}  (log {m['log_ppl_ratio']:+.5f})")
        how = "KL(baseline || model)"
        if r.memory and r.memory.get("mode") == "served":
            how += f"; top-{r.memory['top_logprobs']} estimate, biased low: docs/eval.md"
        lines.append(f"kld       {m['kld_mean']:.6f} ± {m['kld_se']:.6f} nats/token ({how})")
        lines.append(f"top-1     {m['top1_agreement']:.4f} ± {m['top1_se']:.4f}")
        lines.append(f"p(correct) change: mean {m['dp_mean']:+.5f} ± {m['dp_se']:.5f}, rms {m['dp_rms']:.5f}")
    rate = m["tokens"] / r.seconds if r.seconds > 0 else float("nan")
    lines.append(f"time      {r.seconds:.1f} s ({rate:,.0f} scored tokens/s, {r.forwards_per_window} model "
                 f"forward(s) per window)")
    for g in r.gates:
        lines.append(f"gate      {g.line()}")
    if r.gates:
        lines.append("result    " + ("passed" if r.passed else "FAILED"))
    return console.lines(lines)
