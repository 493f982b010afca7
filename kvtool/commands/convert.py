"""`kvtool convert`: MHA -> GQA / MQA (and back) by a merge method, streaming shard by shard."""

from __future__ import annotations

import json
from typing import List, Optional

import typer

from kvtool import progress as kv_progress
from kvtool.deps import require_torch
from kvtool.errors import EXIT_OK, UsageError


def register(app: typer.Typer) -> None:
    @app.command("convert", cls=_DstRequiredCommand, help="Convert attention heads: --to gqa --groups G | --to mqa | --to mha (exact expansion).")
    def convert(
        src: str = typer.Argument(..., help="Source model folder (config.json + safetensors)."),
        dst: Optional[str] = typer.Argument(None, help="Output folder; required, except with --dry-run."),
        to: str = typer.Option(..., "--to", help="gqa | mqa | mha"),
        groups: Optional[int] = typer.Option(None, "--groups", "-g", help="KV heads after conversion (with --to gqa)."),
        dry_run: bool = typer.Option(False, "--dry-run", help="Print the plan and write nothing."),
        force: bool = typer.Option(False, "--force", help="Replace a non-empty DST."),
        dtype: str = typer.Option("keep", "--dtype", help="keep | bf16 | fp16 | fp32 (floating tensors only)."),
        max_shard_size: str = typer.Option("5GB", "--max-shard-size", help="Largest output shard, e.g. 5GB, 500MB."),
        method: str = typer.Option("mean", "--method", help="Merge method (registry: kvtool/convert/methods.py)."),
        method_opt: List[str] = typer.Option([], "--method-opt", help="KEY=VALUE option for the merge method (repeatable)."),
        eval_: Optional[bool] = typer.Option(None, "--eval/--no-eval",
                                             help="Run the perplexity check on the result (default: on with a CUDA GPU)."),
        eval_tokens: int = typer.Option(4096, "--eval-tokens", help="Tokens of the built-in evaluation text for --eval."),
        max_ppl_increase: Optional[str] = typer.Option(None, "--max-ppl-increase",
                                                       help="--eval gate: fail (exit 1) above this perplexity rise, e.g. 5%."),
        max_kld: Optional[float] = typer.Option(None, "--max-kld", help="--eval gate: fail above this mean KL divergence."),
        progress: Optional[bool] = typer.Option(None, "--progress/--no-progress", help=kv_progress.FLAG_HELP),
        calib_dataset: Optional[str] = typer.Option(None, "--calib-dataset",
                                                    help="--method aware: pydoc (built-in, offline; the default) | "
                                                         "wikitext2 | wikitext103 (train split; need `datasets`)."),
        calib_text: Optional[str] = typer.Option(None, "--calib-text",
                                                 help="--method aware: calibration text file (instead of --calib-dataset)."),
        calib_tokens: Optional[int] = typer.Option(None, "--calib-tokens", help="--method aware: calibration tokens (4096)."),
        refine_steps: Optional[int] = typer.Option(None, "--refine-steps",
                                                   help="--method aware: optimizer steps per layer after the merge (0)."),
        seq_len: Optional[int] = typer.Option(None, "--seq-len",
                                              help="--method aware: tokens per calibration sequence (256; 1024 with --refine-steps)."),
        grouping: Optional[str] = typer.Option(None, "--grouping",
                                               help="--method aware: contiguous | similarity (which KV heads share a group)."),
    ) -> int:
        from kvtool.convert.methods import get_method
        from kvtool.convert.report import render_plan, render_result
        from kvtool.units import parse_size

        try:
            shard_bytes = parse_size(max_shard_size)
        except ValueError as exc:
            raise UsageError(str(exc), field="--max-shard-size") from None
        if shard_bytes <= 0:
            raise UsageError("must be positive", field="--max-shard-size")
        if eval_tokens < 2:
            raise UsageError(f"must be at least 2, got {eval_tokens}", field="--eval-tokens")
        _gates(max_ppl_increase, max_kld)  # refuse a bad gate before any work, --dry-run too
        options = _parse_options(method_opt)
        # the calibrated method's own flags; any other method refuses them by name
        options.update({k: v for k, v in (("calib_text", calib_text), ("calib_dataset", calib_dataset),
                                          ("calib_tokens", calib_tokens),
                                          ("refine_steps", refine_steps), ("seq_len", seq_len),
                                          ("grouping", grouping)) if v is not None})
        method_obj = get_method(method, **options)  # unknown method / option: exit 2 before any work
        if not dry_run and not dst:
            raise UsageError("missing required argument (only --dry-run goes without one)", field="DST")

        from kvtool.convert.driver import make_plan, run_convert

        plan = make_plan(src, to=to, groups=groups, method=method, dtype=dtype, max_shard_size=shard_bytes)
        for w in plan.warnings:
            typer.echo(f"kvtool: warning: {w}", err=True)
        if dry_run:
            typer.echo(render_plan(plan, dst), nl=False)
            return EXIT_OK
        if method_obj.array_api == "torch" or eval_:
            require_torch(f"kvtool convert {'--eval' if eval_ else '--method ' + method}")
        device, want_eval = _device_and_eval(eval_, method_obj.array_api == "torch")
        gates = _gates(max_ppl_increase, max_kld)
        if gates and not want_eval:
            raise UsageError("quality gates need --eval", field="--max-ppl-increase" if max_ppl_increase else "--max-kld")
        if want_eval:
            _eval_api()  # fail before converting when the eval API is missing
        if want_eval:  # transformers will load SRC: no checkpoint code (the plan refused it for a torch method)
            from pathlib import Path

            from kvtool.io.preflight import refuse_auto_map

            refuse_auto_map(Path(src))
        with kv_progress.session(progress):
            result = run_convert(plan, dst, method_obj=method_obj, force=force, device=device)
            typer.echo(render_result(result), nl=False)
            if want_eval:
                return _run_eval(src, dst, device, eval_tokens, gates)
        return EXIT_OK


class _DstRequiredCommand(typer.core.TyperCommand):
    """Usage `kvtool convert [OPTIONS] SRC DST`: DST is optional to click only so --dry-run can go without it."""

    def collect_usage_pieces(self, ctx):
        return ["DST" if piece == "[DST]" else piece for piece in super().collect_usage_pieces(ctx)]


def _parse_options(items: list[str]) -> dict:
    out: dict = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"expected KEY=VALUE, got {item!r}", field="--method-opt")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    return out


def _device_and_eval(eval_flag: bool | None, method_uses_torch: bool) -> tuple[str, bool]:
    """("cuda" | "cpu", whether to evaluate). The device serves the method's calibration as well as the
    evaluation, so `--no-eval` does not move a calibrated merge to the CPU. torch is imported only when
    an NVIDIA driver is present and something will use it: the mean method alone never needs it."""
    if eval_flag is False and not method_uses_torch:
        return "cpu", False
    if not eval_flag and not _nvidia_driver():
        return "cpu", False
    import torch

    cuda = torch.cuda.is_available()
    return ("cuda" if cuda else "cpu"), (cuda if eval_flag is None else eval_flag)


def _nvidia_driver() -> bool:
    import os

    return os.path.exists("/proc/driver/nvidia/version") or os.path.exists("/dev/nvidia0")


def _eval_api():
    try:
        from kvtool.eval.api import evaluate
    except ImportError as exc:
        if exc.name and exc.name.split(".")[0] != "kvtool":
            raise  # torch or transformers missing: kvtool.cli says what to install
        raise UsageError("--eval needs kvtool's eval module (kvtool/eval/api.py: evaluate), which this installation "
                         "lacks; rerun with --no-eval", field="--eval") from None
    return evaluate


def _gates(max_ppl_increase: str | None, max_kld: float | None) -> dict:
    from kvtool.units import gate_threshold, parse_percent

    gates: dict = {}
    if max_ppl_increase is not None:
        try:
            gates["--max-ppl-increase"] = parse_percent(max_ppl_increase)
        except ValueError as exc:
            raise UsageError(str(exc), field="--max-ppl-increase") from None
    if max_kld is not None:
        try:
            gates["--max-kld"] = gate_threshold(float(max_kld))
        except ValueError as exc:
            raise UsageError(str(exc), field="--max-kld") from None
    return gates


def _run_eval(src: str, dst: str, device: str, max_tokens: int, gates: dict) -> int:
    """Perplexity / KLD of the converted model against the source, on the same token stream."""
    from kvtool.errors import GateFailed

    evaluate = _eval_api()
    r = evaluate(dst, baseline=src, device=device, max_tokens=max_tokens, gates=gates or None)
    # every figure with its standard error (tokens treated as independent: a lower bound, see kvtool eval)
    typer.echo(f"eval ({r.tokens} tokens of {r.text}, {r.device}): perplexity {r.baseline_ppl:.3f} -> {r.ppl:.3f} "
               f"({(r.ppl_ratio - 1) * 100:+.1f}% ± {r.ppl_ratio_se * 100:.1f}%), mean KLD {r.kld_mean:.4f} "
               f"± {r.kld_se:.4f}, top-1 agreement {r.top1_agreement:.3f} ± {r.top1_se:.3f}")
    for g in r.gates:
        typer.echo(f"  gate {g.line()}")
    if not r.passed:
        raise GateFailed(f"quality gate failed ({', '.join(g.option for g in r.failed_gates)}); the converted "
                         f"checkpoint was kept for inspection", file=str(dst))
    return EXIT_OK
