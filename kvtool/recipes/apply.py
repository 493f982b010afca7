"""`kvtool apply`: run a recipe's steps in order, gate on lint and eval, report, stage the output.

Each transforming step (convert, rope, quantize-kv) writes a new model folder into a work folder
next to DST; checking steps (lint, eval) read the current folder. Only when every step and gate
has passed is the last folder renamed to DST, with kvtool-report.json and kvtool-report.md
inside. A failed gate exits 1 and leaves no DST (the report goes to DST.kvtool-failed.json, or
DST.kvtool-failed.N.json when that name is taken: an earlier report is never overwritten).
`--keep-intermediate` moves the work folder to DST.intermediate; an existing one is replaced only
with --force.
"""

from __future__ import annotations

import json
import platform
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from kvtool import __version__, console
from kvtool.errors import GateFailed, InputError, KvtoolError, UsageError
from kvtool.io import outputfile
from kvtool.model.preflight import preflight
from kvtool.model.weight_shapes import require_weights_match_config
from kvtool.model.numbers import require_valid_numbers
from kvtool.recipes.load import Recipe, Step, load_recipe
from kvtool.recipes.plan import plan_recipe
from kvtool.model.spec import build_spec


@dataclass
class StepResult:
    index: int
    kind: str
    settings: dict
    output: str | None  # model folder after the step
    seconds: float = 0.0
    passed: bool = True
    details: dict = field(default_factory=dict)


@dataclass
class RunContext:
    recipe: Recipe
    src: Path  # the original model (eval baseline)
    current: Path  # the model as the steps so far leave it
    work: Path  # scratch folder next to DST
    device: str = "auto"
    progress: bool | None = None
    validated: dict = field(default_factory=dict)  # SRC's weight files as the recipe's plan checked them
    # the output check the last writing step published its output under (its source, the releases it was written
    # for): the final output, that output moved into DST beside the reports, must pass it again (_finish)
    check: Callable[[Path], None] | None = None

    def new_folder(self, step: Step) -> Path:
        return self.work / f"step{step.index}-{step.kind}"


def _texts(ctx: RunContext, section: dict, purpose: str) -> list[str]:
    """Text files for a step: explicit files (relative to the recipe) or a built-in dataset."""
    from kvtool.datasets import write_text_files

    files = ctx.recipe.text_files(section)
    if files:
        return [str(path) for _, path in files]
    dataset = section.get("dataset")
    if dataset == "pydoc":
        calib, ev = write_text_files(ctx.work / "text")
        return [str(calib if purpose == "calibration" else ev)]
    raise InputError(f"dataset {dataset!r} is not available offline in recipes; use `pydoc` or `text:` files",
                     file=str(ctx.recipe.path))


# --- step runners ---------------------------------------------------------------------------------
def run_convert_step(ctx: RunContext, step: Step) -> StepResult:
    from functools import partial

    from kvtool.convert.run import apply, plan
    from kvtool.recipes.plan import calibration, convert_options
    from kvtool.rules.output_check import verify_output

    out = ctx.new_folder(step)
    o = convert_options(step.options, src=str(ctx.current), dst=str(out))
    section = step.options.get("calibration") or {}
    cal = calibration(o)  # the target's answer: does it calibrate, does the step owe it text
    given = ctx.recipe.text_files(section) or section.get("dataset") is not None
    if cal and not ctx.recipe.text_files(section) and section.get("dataset") not in (None, "pydoc"):
        o.calib_text, o.calib_dataset = None, section["dataset"]  # a built-in mix (checked by the plan)
    elif cal and (given or cal.required):  # the recipe's text: its files (several: one text, read as far as used)
        files = _texts(ctx, section, "calibration")
        o.calib_text, o.calib_dataset = (files if len(files) > 1 else files[0]), None
    p = plan(o)  # `kvtool convert`'s plan and apply: the same refusals, now on the written model
    ctx.check = partial(verify_output, source=ctx.current, **p.check_kwargs())
    res = apply(p, out, progress=ctx.progress, device=_device(ctx), verify=ctx.check)
    return StepResult(step.index, step.kind, dict(step.options), str(out), details={**p.details(), "files": res.files})


def _check(**kwargs) -> Callable[[Path], None]:
    from functools import partial

    from kvtool.rules.output_check import verify_output

    return partial(verify_output, **kwargs)


def run_lint_step(ctx: RunContext, step: Step) -> StepResult:
    from kvtool.rules.run import apply, plan, recipe_settings, recipe_step_options

    o = step.options
    # `kvtool lint`'s plan on the recipe's input model, named as the recipe's source for per-file ignores
    lint = plan(recipe_step_options(o, str(ctx.current)), recipe_settings(), names=(str(ctx.src),))
    opts = lint.engine
    rep = apply(lint)[0]
    failing = rep.failing(opts.strict) if not rep.error else []
    details = {"error": rep.error, "findings": [f.as_dict() for f in rep.findings],
               "counts": {s: sum(1 for f in rep.findings if f.severity == s) for s in ("error", "warning", "info")}}
    return StepResult(step.index, step.kind, dict(o), str(ctx.current), passed=not failing and not rep.error,
                      details=details)


def run_rope_step(ctx: RunContext, step: Step) -> StepResult:
    from kvtool.recipes.plan import rope_options
    from kvtool.rope.command import plan_change, write

    # the command's own plan and write: the same refusals (a result lint would fail included), no stdout
    ckpt = preflight(ctx.current, read_side_files=False, require_weights=False)
    plan = plan_change(ckpt.config, str(ckpt.config_path), rope_options(step.options, ctx.recipe))
    out = ctx.new_folder(step)
    write(ckpt, plan, dst=out)
    ctx.check = _check(source=ctx.current)  # rope's write checks its output so (kvtool.rope.command.write)
    spec = plan.spec
    return StepResult(step.index, step.kind, dict(step.options), str(out),
                      details={"max_position_embeddings": spec.max_position,
                               "rope": {k: {"rope_type": v.rope_type, **v.params} for k, v in spec.rope.items()}})


def run_quantize_kv_step(ctx: RunContext, step: Step) -> StepResult:
    from kvtool.options.fields import from_recipe
    from kvtool.quantize.run import QuantizeOptions, quantize_kv

    out = ctx.new_folder(step)
    opts = from_recipe(QuantizeOptions, step.options, src=str(ctx.current), dst=str(out), device=_device(ctx),
                       no_eval=True)  # the recipe's own eval step judges quality
    opts.calib_text = _texts(ctx, step.options.get("calibration") or {}, "calibration")
    opts.calib_dataset = None  # a recipe's dataset became a text file above
    res = quantize_kv(opts.src, opts.dst, opts, log=lambda *a, **k: None)
    ctx.check = _check(source=ctx.current)  # quantize-kv's write checks its output so (kvtool.quantize.run)
    cal = res.calibration
    return StepResult(step.index, step.kind, dict(step.options), str(out),
                      details={"observer": getattr(cal, "observer", None), "scale_tensors": len(res.scale_tensors),
                               "tokens": getattr(cal, "tokens", None)})


def run_eval_step(ctx: RunContext, step: Step) -> StepResult:
    from kvtool.datasets import read_texts
    from kvtool.eval.run import apply
    from kvtool.io.urls import redact
    from kvtool.recipes.plan import eval_plan, eval_roles

    files = [str(path) for _, path in ctx.recipe.text_files(step.options)] or None
    texts, text_name = read_texts(files, step.options.get("dataset"))
    # `kvtool eval`'s plan and apply: the refusals plan_eval made, now on the written model (or the served one)
    model, baseline = eval_roles(ctx.recipe, step, current=str(ctx.current), src=str(ctx.src))
    p = eval_plan(ctx.recipe, step.options, model=model, baseline=baseline, texts=texts, text_name=text_name)
    report = apply(p, device=_device(ctx), progress=ctx.progress)
    d = report.as_dict()
    shown = {k: redact(v) if k in ("server", "baseline_server") and isinstance(v, str) else v
             for k, v in step.options.items()}  # a URL's password never reaches the report
    return StepResult(step.index, step.kind, shown, None, passed=report.passed,
                      details={"metrics": d, "gates": [g.line() for g in report.gates],
                               "failed": [g.line() for g in report.failed_gates]})


RUNNERS: dict[str, Callable[[RunContext, Step], StepResult]] = {
    "convert": run_convert_step,
    "rope": run_rope_step,
    "quantize-kv": run_quantize_kv_step,
    "lint": run_lint_step,
    "eval": run_eval_step,
}


def _device(ctx: RunContext) -> str:
    if ctx.device != "auto":
        return ctx.device
    try:
        import torch
    except ImportError:
        return "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- the run --------------------------------------------------------------------------------------
def _versions() -> dict:
    from kvtool.engines.installed import version

    out = {"kvtool": __version__, "python": platform.python_version()}
    for dist in ("torch", "transformers", "safetensors"):
        # from the installed metadata (a rope-only recipe never imports torch), never the working folder's
        out[dist] = version(dist)
    return out


def apply_recipe(recipe_path: str | Path, src: str | Path, dst: str | Path, *, dry_run: bool = False,
                 keep_intermediate: bool = False, force: bool = False, device: str = "auto",
                 progress: bool | None = None, echo: Callable[[str], None] = console.out) -> dict:
    """Validate the whole recipe, then run it. Returns the report; raises GateFailed on a failed gate."""
    recipe = load_recipe(recipe_path)
    src = Path(src)
    plan, validated = _plan(recipe, src)
    echo(f"recipe {recipe.name} ({recipe.path}): {len(recipe.steps)} step(s)")
    for step, desc in zip(recipe.steps, plan):
        echo(f"  {step.index}. {step.kind}: {desc}")
    if dry_run:
        return {"recipe": str(recipe.path), "plan": plan, "dry_run": True}
    from kvtool.io.staging import check_destination, scratch_outputs, staging_dir_for

    dst = Path(dst)
    check_destination(dst, force=force, protect=[src])
    kept = dst.parent / f"{dst.name}.intermediate"
    if keep_intermediate:
        _check_intermediate(kept, force=force, src=src)
    work = staging_dir_for(dst, "work")  # as staged_output makes the commands' (one line when refused)
    ctx = RunContext(recipe=recipe, src=src, current=src, work=work, device=device, progress=progress,
                     validated=validated)
    report = {"kvtool_report_version": 1, "recipe": {"path": str(recipe.path), "name": recipe.name,
              "description": recipe.description}, "source": str(src), "destination": str(dst),
              "versions": _versions(), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "plan": plan, "steps": [], "passed": False}
    failed: StepResult | None = None
    try:
        for step in recipe.steps:
            echo(f"[{step.index}/{len(recipe.steps)}] {step.kind} ...")
            t0 = time.perf_counter()
            try:
                if ctx.current == ctx.src:  # the steps so far only read SRC: still the weights the plan checked
                    outputfile.check_files_unchanged(src, ctx.validated)
                with scratch_outputs():  # a step's folder is scratch: an interrupted run has not written it
                    res = RUNNERS[step.kind](ctx, step)
            except KvtoolError as exc:  # name DST, not the hidden work folder the steps write into; an earlier
                for s in recipe.steps:  # step's output (this step's input) by what it is, never as DST or SRC
                    exc.relocate(str(ctx.new_folder(s)), str(dst) if s.index >= step.index else
                                 f"step {s.index}'s output")
                _name_step_key(exc, step)
                raise
            res.seconds = round(time.perf_counter() - t0, 3)
            report["steps"].append(res.__dict__)
            echo(f"[{step.index}/{len(recipe.steps)}] {step.kind}: {'ok' if res.passed else 'FAILED'} ({res.seconds:.1f} s)")
            if res.output:
                ctx.current = Path(res.output)
            if not res.passed:
                failed = res
                break
        report["passed"] = failed is None
        report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        if failed is not None:
            failed_report = _write_new(dst.parent, f"{dst.name}.kvtool-failed", ".json",
                                       json.dumps(report, indent=2, default=str) + "\n")
            raise GateFailed(f"step {failed.index} ({failed.kind}) failed: {_why(failed)}; no output was written "
                             f"(report: {failed_report})", file=str(recipe.path))
        _finish(ctx, dst, report, force=force)
    finally:
        _dispose_work(work, kept if keep_intermediate else None, dst, force=force, echo=echo)
    return report


def _plan(recipe: Recipe, src: Path) -> tuple[list[str], dict]:
    """The recipe's plan on SRC: every step's refusals, before any work; and SRC's weight files as checked
    (kvtool.io.outputfile.identities)."""
    if not src.is_dir():
        raise InputError("SRC must be a model folder", file=str(src))
    # steps that load the source with transformers refuse checkpoint code up front, as their commands do first
    # (a convert step's plan refuses it for a method that runs the model, where `kvtool convert` does)
    loads_model = any(s.kind in ("quantize-kv", "eval") for s in recipe.steps)
    ckpt = preflight(src, model_code=loads_model, require_weights=False)
    spec = build_spec(ckpt.config)
    # a recipe that only lints reports split heads as lint does (KV102, exit 1); any other step refuses them
    computes = any(s.kind != "lint" for s in recipe.steps)
    require_valid_numbers(spec, str(ckpt.config_path), heads=computes)
    if ckpt.has_weights and any(s.kind in ("convert", "quantize-kv", "eval") for s in recipe.steps):
        require_weights_match_config(ckpt, spec)  # what those commands' preflight refuses, before any step
    return plan_recipe(recipe, ckpt), outputfile.identities(ckpt.headers)


def _dispose_work(work: Path, kept: Path | None, dst: Path, *, force: bool, echo: Callable[[str], None]) -> None:
    """The work folder moves to `kept` (--keep-intermediate) or is removed."""
    if kept is None or not work.exists():
        shutil.rmtree(work, ignore_errors=True)
        return
    from kvtool.io.staging import MARKER

    (work / MARKER).unlink(missing_ok=True)
    if kept.exists() and force:  # checked up front: --force was given to replace it
        shutil.rmtree(kept)
    if kept.exists():  # appeared while we worked: keep both, never delete it
        kept = _unique(dst.parent, f"{dst.name}.intermediate", "")
    outputfile.move(work, kept)
    echo(f"intermediate folders kept in {kept}")


def _name_step_key(exc: KvtoolError, step: Step) -> None:
    """An error naming an options field the step spells names it as the recipe does: steps[0].eval.max_tokens.
    Any other field (apply's own --device) is left for the command line to spell."""
    from kvtool.options.fields import OPERATIONS, field_named

    cls = OPERATIONS.get(step.kind)
    f = field_named(cls, exc.option) if cls is not None and exc.option and not exc.field else None
    if f is not None and f.recipe_key:
        exc.name_option(f"steps[{step.index - 1}].{step.kind}.{f.recipe_key}")


def _check_intermediate(kept: Path, *, force: bool, src: Path) -> None:
    """DST.intermediate is the user's once it exists: replaced only with --force, never inside SRC."""
    from kvtool.io.staging import check_destination

    if kept.is_symlink() or (kept.exists() and not kept.is_dir()):
        raise UsageError("exists and is not a folder; --keep-intermediate will not replace it", file=str(kept))
    if kept.exists() and not force:
        raise UsageError("exists (an earlier --keep-intermediate run?); remove it or use --force to replace it",
                         file=str(kept), option="keep_intermediate")
    check_destination(kept, force=True, protect=[src])


def _unique(parent: Path, stem: str, suffix: str) -> Path:
    """parent/stem+suffix, or stem.N+suffix for the first N free: nothing existing is reused."""
    path, n = parent / f"{stem}{suffix}", 1
    while path.exists() or path.is_symlink():
        path, n = parent / f"{stem}.{n}{suffix}", n + 1
    return path


def _write_new(parent: Path, stem: str, suffix: str, text: str) -> Path:
    """Write text to a new file (never over an existing file or through a symlink); returns its path."""
    return outputfile.create_first_free(lambda n: parent / (f"{stem}.{n}{suffix}" if n else f"{stem}{suffix}"), text)


def _why(res: StepResult) -> str:
    d = res.details
    if res.kind == "lint":
        return d.get("error") or f"{d['counts']['error']} error(s), {d['counts']['warning']} warning(s)"
    if d.get("failed"):
        return ", ".join(d["failed"])
    return "gate failed"


def _finish(ctx: RunContext, dst: Path, report: dict, *, force: bool) -> None:
    """Move the final model into DST (copying the source when no step transformed it)."""
    from kvtool.io.staging import staged_output
    from kvtool.recipes.report import render_markdown

    final = ctx.current
    # no step wrote: SRC's copy is checked against SRC. Else the last writing step's own check runs again, on its
    # output as moved into DST beside the reports: its source, the releases it was written for (convert --to mla
    # --engine transformers accepts rows vLLM does not serve), so what is published is what that check passed
    verify = _check(source=ctx.src) if final == ctx.src or ctx.check is None else ctx.check
    with staged_output(dst, force=force, protect=[ctx.src], verify=verify) as tmp:
        if final == ctx.src:
            _copy_tree(final, tmp, ctx.validated)
        else:
            for item in final.iterdir():
                outputfile.move(item, tmp / item.name)
        outputfile.write_new(tmp / "kvtool-report.json", json.dumps(report, indent=2, default=str) + "\n")
        # a path from a file name that is not UTF-8 holds lone surrogates: written as \udcff, never an error
        outputfile.write_new(tmp / "kvtool-report.md", render_markdown(report).encode("utf-8", "backslashreplace"))


def _copy_tree(src: Path, dst: Path, validated: dict) -> None:
    """The source's top-level files, copied (never hard-linked: DST must not share an inode with SRC); the
    weight files only while they are the ones `validated` describes."""
    from kvtool.io.staging import check_inside

    for item in sorted(src.iterdir()):
        if item.is_file():
            check_inside(src, item)
            outputfile.copy_source(item, dst / item.name, expect=validated.get(item.name))
