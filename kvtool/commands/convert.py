"""`kvtool convert`: MHA -> GQA / MQA (and back) by a merge method, streaming shard by shard."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtool import console
from kvtool import progress as kv_progress
from kvtool.commands.options_cli import command
from kvtool.deps import require_torch
from kvtool.errors import EXIT_OK, UsageError
from kvtool.options.convert import ConvertOptions

if TYPE_CHECKING:  # typer is imported by the typer CLI only (kvtool/commands/argv.py runs convert without it)
    import typer


def register(app: typer.Typer) -> None:
    # the usage line's DST, for the typer CLI alone (kvtool/commands/argv.py's Direct takes no click class)
    typer_settings = {} if getattr(app, "direct", False) else {"cls": _dst_required_command()}

    @command(app, ConvertOptions, **typer_settings,
             help="Convert attention heads: --to gqa --groups G | --to mqa | --to mha (exact expansion) | --to mla "
                  "--kv-rank R (multi-head latent attention, DeepSeek layout).")
    def convert(o: ConvertOptions) -> int:
        from kvtool.convert.run import apply, plan

        _gates(o.max_ppl_increase, o.max_kld)  # refuse a bad gate before any work, --dry-run too
        if not o.dry_run and not o.dst:
            raise UsageError("missing required argument (only --dry-run goes without one)", option="dst")
        p = plan(o)  # the options, the target's own, then the model: what a recipe's convert step plans
        for w in p.warnings:
            console.out(f"kvtool: warning: {w}", err=True)
        if o.dry_run:
            console.out(p.render(o.dst, o.eval_tokens if o.eval else None))
            return EXIT_OK
        uses_torch = p.needs_torch is not None  # what runs the model: a calibrated merge, --to mla's solve
        if uses_torch or o.eval:
            require_torch(f"kvtool convert {'--eval' if o.eval else p.needs_torch}")
        device, want_eval = _device_and_eval(o.eval, uses_torch)
        gates = _gates(o.max_ppl_increase, o.max_kld)
        if gates and not want_eval:
            raise UsageError("quality gates need --eval", option="max_ppl_increase" if o.max_ppl_increase else "max_kld")
        if want_eval:
            _eval_api()  # fail before converting when the eval API is missing
        if want_eval:  # transformers will load SRC: no checkpoint code (the plan refused it for a torch method)
            from pathlib import Path

            from kvtool.model.preflight import refuse_auto_map

            refuse_auto_map(Path(o.src))
        with kv_progress.session(o.progress):
            from functools import partial

            from kvtool.rules.output_check import verify_output

            result = apply(p, o.dst, force=o.force, device=device, verify=partial(verify_output, source=p.src, **p.check_kwargs()))
            console.out(result.render())
            if want_eval:
                return _run_eval(o.src, o.dst, device, o.eval_tokens, gates)
        return EXIT_OK


def _dst_required_command():
    """Usage `kvtool convert [OPTIONS] SRC DST`: DST is optional to click only so --dry-run can go without it."""
    import typer

    class DstRequiredCommand(typer.core.TyperCommand):
        def collect_usage_pieces(self, ctx):
            return ["DST" if piece == "[DST]" else piece for piece in super().collect_usage_pieces(ctx)]

    return DstRequiredCommand


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
                         "lacks; rerun with --no-eval", option="eval") from None
    return evaluate


def _gates(max_ppl_increase: str | None, max_kld: float | None) -> dict:
    from kvtool.eval.gate import parse_limits  # torch-free: --dry-run refuses a bad gate without torch

    return parse_limits(max_ppl_increase, max_kld)


def _run_eval(src: str, dst: str, device: str, max_tokens: int, gates: dict) -> int:
    """Perplexity / KLD of the converted model against the source, on the same token stream."""
    from kvtool.errors import GateFailed

    evaluate = _eval_api()
    r = evaluate(dst, baseline=src, device=device, max_tokens=max_tokens, gates=gates or None)
    # every figure with its standard error (tokens treated as independent: a lower bound, see kvtool eval)
    console.out(f"eval ({r.tokens} tokens of {r.text}, {r.device}): perplexity {r.baseline_ppl:.3f} -> {r.ppl:.3f} "
               f"({(r.ppl_ratio - 1) * 100:+.1f}% ± {r.ppl_ratio_se * 100:.1f}%), mean KLD {r.kld_mean:.4f} "
               f"± {r.kld_se:.4f}, top-1 agreement {r.top1_agreement:.3f} ± {r.top1_se:.3f}")
    for g in r.gates:
        console.out(f"  gate {g.line()}")
    if not r.passed:
        raise GateFailed(f"quality gate failed ({', '.join(g.flag for g in r.failed_gates)}); the converted "
                         f"checkpoint was kept for inspection", file=str(dst))
    return EXIT_OK
