"""Check a whole recipe against the source model before any work is done.

Each step kind has a planner that calls the operation's own plan (the one its command calls, so a
recipe never accepts what the command refuses) on the model *as the previous steps leave it*:
the config they wrote and the tensors they planned, simulated without torch. It returns a
one-line description of what the step will do. An impossible step (groups not dividing the heads,
RoPE on an ALiBi model, missing calibration text) is refused here, before the first tensor is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from kvtool.errors import KvtoolError, UsageError

from kvtool.io.urls import redact
from kvtool.model.checkpoint import Checkpoint
from kvtool.recipes.load import FILE_KEYS, Recipe, Step

# Built-in datasets a recipe step may name: offline only, so a recipe never waits on the network midway.
RECIPE_DATASETS = ("pydoc",)


@dataclass
class PlanState:
    ckpt: Checkpoint  # the source
    config: dict  # the config as the steps so far leave it
    tensors: dict | None = None  # name -> dtype / shape as the steps so far leave them; None: the source's
    notes: list[str] = field(default_factory=list)
    written_by: int | None = None  # the last step that wrote the model the next step reads (None: SRC itself)

    def input_name(self, exc: KvtoolError) -> KvtoolError:
        """An error about the step's input names that input: SRC's files only while no step has written the
        model; after one has, `step N's output/config.json` (the model the step reads), never SRC's file."""
        root = str(self.ckpt.root if self.ckpt.root is not None else self.ckpt.config_path.parent)
        if self.written_by is not None and exc.file and (exc.file == root or exc.file.startswith(root + "/")):
            exc.file = f"step {self.written_by}'s output" + exc.file[len(root):]  # the file only: a short SRC
            exc.args = (exc.line(),)  # name ("t") also occurs inside words of the message
        return exc

    @property
    def has_weights(self) -> bool:
        return self.tensors is not None or self.ckpt.has_weights

class StepRefused(UsageError):
    """A recipe step the operation's plan refuses; `cause` is the operation's own error (its file, field and
    options field), so a caller compares refusals without reading the message."""

    def __init__(self, message: str, *, file: str, field: str, cause: KvtoolError | None = None):
        super().__init__(message, file=file, field=field)
        self.cause = cause


def _fail(recipe: Recipe, step: Step, message: str, cause: KvtoolError | None = None) -> StepRefused:
    """The step's error, naming the recipe key when `cause` names an options field (steps[0].rope.factor)."""
    where = f"steps[{step.index - 1}].{step.kind}"
    if cause is not None and cause.option and not cause.field:
        from kvtool.options.fields import OPERATIONS, field_named

        cls = OPERATIONS.get(step.kind)
        f = field_named(cls, cause.option) if cls is not None else None
        if f is not None and f.recipe_key:
            where += "." + f.recipe_key
    return StepRefused(f"line {step.line}: step {step.index} ({step.kind}): {message}", file=str(recipe.path),
                       field=where, cause=cause)


def _refused(recipe: Recipe, step: Step, exc: KvtoolError) -> StepRefused:
    """The operation's error at the step's line, still naming what the command names (a weights file, a
    tensor, a config key); an options field is named by the step's key instead (StepRefused.field)."""
    where = "".join(f"{part}: " for part in (exc.file, exc.field) if part)
    return _fail(recipe, step, where + exc.message, exc)


def _text_paths(recipe: Recipe, step: Step, section: dict | None, *, required: bool,
                datasets: tuple[str, ...] | None = RECIPE_DATASETS) -> None:
    """The step's `text` files (relative to the recipe, inside its folder) and `dataset`. required: the step needs
    one of them; datasets: the ones it may name (offline; None: left to the step's run)."""
    section = section or {}
    dataset = section.get("dataset")
    if datasets is not None and dataset is not None and section.get("text") is None and dataset not in datasets:
        raise _fail(recipe, step, f"dataset {dataset!r} is not available offline in recipes; use "
                                  f"{' / '.join(datasets)} or `text:` files")
    if section.get("text") is None:
        if required and not dataset:
            raise _fail(recipe, step, "needs calibration text: set calibration.text (a file relative to the recipe)")
        return
    for t, path in recipe.text_files(section):
        why = recipe.file_problem(t)
        if why:
            raise _fail(recipe, step, f"text file {t!r} {why} (resolved to {path})")


def convert_options(options: dict, **given):
    """ConvertOptions for a recipe's convert step (SRC / DST given by the caller)."""
    from kvtool.options.convert import ConvertOptions
    from kvtool.options.fields import from_recipe

    return from_recipe(ConvertOptions, options, **{"src": "", **given})


def calibration(o):
    """The step's target's answer (kvtool/convert/targets.py): a kvtool.convert.targets.Calibration when it
    calibrates on text (its `calibration.text` then resolves relative to the recipe), None when it reads none."""
    from kvtool.convert.targets import target_of

    return target_of(o).calibration(o)


def plan_convert(recipe: Recipe, step: Step, state: PlanState) -> str:
    from kvtool.convert.run import plan

    o = convert_options(step.options)
    cal = calibration(o)
    if cal is not None:
        from kvtool.datasets import OFFLINE_MIXES

        _text_paths(recipe, step, step.options.get("calibration"), required=cal.required, datasets=OFFLINE_MIXES)
        files = recipe.text_files(step.options.get("calibration"))
        if files:
            o.calib_text = str(files[0][1])  # the run reads several as one text
    try:  # `kvtool convert`'s plan, on the model as the previous steps leave it
        p = plan(o, ckpt=state.ckpt, config=state.config, tensors=state.tensors)
    except KvtoolError as exc:
        raise _refused(recipe, step, state.input_name(exc)) from None
    state.config = p.new_config
    state.tensors = {t.name: t for t in p.outputs}
    state.written_by = step.index
    return f"{o.to}: {p.headline}" + _estimate_note(p.estimate())


def rope_options(options: dict, recipe: Recipe, **given):
    """RopeOptions for a recipe's rope step (file options resolved relative to the recipe)."""
    from kvtool.options.fields import fields_of, from_recipe
    from kvtool.options.rope import RopeOptions

    o = from_recipe(RopeOptions, options, **{"src": "", **given})
    for f in fields_of(RopeOptions):
        v = getattr(o, f.name)
        if f.base_type is float and isinstance(v, int) and not isinstance(v, bool):
            setattr(o, f.name, float(v))  # as the command's typer option gives it: YAML `1` must write 1.0, not 1
    for name in FILE_KEYS:
        if getattr(o, name) is not None:
            why = recipe.file_problem(getattr(o, name))
            if why:
                raise UsageError(f"file {getattr(o, name)!r} {why}", option=name)
            setattr(o, name, str(recipe.resolve(getattr(o, name))))
    return o


def plan_rope(recipe: Recipe, step: Step, state: PlanState) -> str:
    from kvtool.rope.command import plan_change

    try:
        p = plan_change(state.config, str(state.ckpt.config_path), rope_options(step.options, recipe))
    except KvtoolError as exc:
        raise _refused(recipe, step, state.input_name(exc)) from None
    state.config = p.config
    state.written_by = step.index
    o = step.options
    size = f"factor {o['factor']}" if "factor" in o else (f"target context {o['target_context']}" if "target_context" in o else "")
    return f"{o['type']} {size}".strip()


def plan_quantize_kv(recipe: Recipe, step: Step, state: PlanState) -> str:
    from kvtool.options.fields import from_recipe
    from kvtool.options.quantize_kv import DEFAULT_OBSERVER, QuantizeOptions
    from kvtool.quantize.run import check_model  # no torch at import

    from kvtool.quantize.observer_specs import parse_spec  # the command's observer check, torch-free

    _text_paths(recipe, step, step.options.get("calibration"), required=True)
    try:  # in the command's order: the options, then the model
        parse_spec(step.options.get("observer") or DEFAULT_OBSERVER)
        check_model(state.ckpt, config=state.config, tensors=state.tensors)
    except KvtoolError as exc:
        raise _refused(recipe, step, state.input_name(exc)) from None
    o = from_recipe(QuantizeOptions, step.options, src="", dst="")
    from kvtool.model import costs

    # a recipe's quantize-kv step writes no quality report: its eval step measures
    est = costs.quantize_kv(_shape(state), o.calib_tokens)
    state.written_by = step.index
    from kvtool.quantize.run import observer_of

    kind = "NVFP4" if o.format == "nvfp4" else "FP8"
    return f"{kind} KV scales ({o.strategy}, observer {observer_of(o)})" + _estimate_note(est)


def plan_lint(recipe: Recipe, step: Step, state: PlanState) -> str:
    from kvtool.rules.run import plan, recipe_settings, recipe_step_options

    try:  # `kvtool lint`'s plan: a code that matches no rule is refused as the command refuses it
        plan(recipe_step_options(step.options), recipe_settings())
    except KvtoolError as exc:
        raise _refused(recipe, step, state.input_name(exc)) from None
    return "lint" + (" --strict" if step.options.get("strict") else "")


def eval_plan(recipe: Recipe, options: dict, *, model: str, baseline: str, **kw):
    """`kvtool eval`'s plan of an eval step. A recipe gates only on the thresholds it names (the command's 2%
    default is no recipe default)."""
    from kvtool.eval.run import plan
    from kvtool.options.eval import EvalOptions
    from kvtool.options.fields import from_recipe

    o = from_recipe(EvalOptions, options, model=model, baseline=baseline)
    return plan(model, o, gates=options.get("thresholds") or {}, **kw)  # the schema admits the gates' names only


WRITES_MODEL = ("convert", "rope", "quantize-kv")


def eval_roles(recipe: Recipe, step: Step, *, current: str, src: str) -> tuple[str, str | None]:
    """(candidate, baseline) of an eval step, as `kvtool eval` takes MODEL and --baseline:
    no server keys     the model as the earlier steps leave it (local) against SRC (local);
    baseline_server    that model (local) against `served_baseline` on the server (mixed): the output gated
                       against what is served today;
    server             `served_model` on the server against `served_baseline` on `baseline_server`, else against
                       SRC (local, mixed: the engine checked against transformers on the recipe's input). The
                       server does not serve the recipe's output, so `server` after a step that writes a model
                       would gate something else than that output under the step's name: refused."""
    o = step.options
    for name, url in (("served_model", "server"), ("served_baseline", "baseline_server")):
        if o.get(name) is not None and o.get(url) is None:
            raise _fail(recipe, step, f"{name} names the model on `{url}`; it goes with {url}")
    if o.get("server") is not None:
        if o.get("served_model") is None:
            raise _fail(recipe, step, "server: name the served candidate with served_model (its name on the server)")
        writer = next((s for s in reversed(recipe.steps[:step.index - 1]) if s.kind in WRITES_MODEL), None)
        if writer is not None:
            raise _fail(recipe, step, f"server scores the model the server serves, not the one step {writer.index} "
                                      f"({writer.kind}) writes (nothing serves the recipe's output yet); put this "
                                      f"step before step {writer.index}, or gate the output against the server "
                                      "with baseline_server")
        if o.get("baseline_server") is not None:
            return o["served_model"], o.get("served_baseline") or o["served_model"]
        return o["served_model"], src
    if o.get("baseline_server") is not None:
        if o.get("served_baseline") is None:
            raise _fail(recipe, step, "baseline_server: name the served baseline with served_baseline (its name on "
                                      "the server)")
        return current, o["served_baseline"]
    return current, src


def plan_eval(recipe: Recipe, step: Step, state: PlanState) -> str:
    o = step.options
    if not o.get("text") and not o.get("dataset"):
        raise _fail(recipe, step, "needs `text` (file(s) relative to the recipe) or `dataset`")
    _text_paths(recipe, step, o, required=False, datasets=None)  # its run refuses a dataset other than pydoc
    src = str(state.ckpt.config_path.parent)
    model, baseline = eval_roles(recipe, step, current="", src=src)
    try:  # the model is the one the earlier steps plan: its shape, not a folder; the text is read when run
        p = eval_plan(recipe, o, model=model, baseline=baseline, texts=None,
                      tokens=_eval_tokens(recipe, o), shape=_shape(state))
    except KvtoolError as exc:
        raise _refused(recipe, step, state.input_name(exc)) from None
    thresholds = o.get("thresholds") or {}
    gates = f" (gates: {', '.join(f'{k}={v}' for k, v in thresholds.items())})" if thresholds else ""
    if o.get("server") is not None:
        against = (f"{baseline} at {redact(o['baseline_server'])}" if o.get("baseline_server") is not None
                   else "the source (local)")
        return f"eval {model} served at {redact(o['server'])} against {against}" + gates
    if o.get("baseline_server") is not None:
        return (f"eval against {baseline} served at {redact(o['baseline_server'])}" + gates
                + _estimate_note(p.estimate()))
    return "eval against the source" + gates + _estimate_note(p.estimate())


def _eval_tokens(recipe: Recipe, options: dict) -> int:
    """Tokens the eval step scores: max_tokens, else its text's characters / 4 (no tokenizer is loaded for a
    plan), as `kvtool eval --dry-run` counts them; a hub dataset without max_tokens counts as 4096."""
    files = recipe.text_files(options)
    if files:
        chars = sum(path.stat().st_size for _, path in files if path.is_file())
    elif not options.get("dataset") or options.get("dataset") == "pydoc":
        from kvtool.datasets import evaluation_text

        chars = len(evaluation_text())
    else:
        chars = 4 * 4096
    from kvtool.eval.run import planned_tokens

    return planned_tokens(chars, options.get("max_tokens"))[0]


def _shape(state: PlanState):
    """The cost model's view of the model as the previous steps leave it (config and planned tensors)."""
    from kvtool.model import costs
    from kvtool.model.spec import build_spec

    return costs.shape_of(build_spec(state.config), state.tensors or state.ckpt.tensors)


def _estimate_note(est) -> str:
    return f"; estimate {est.line()}" if est is not None else ""


PLANNERS: dict[str, Callable[[Recipe, Step, PlanState], str]] = {
    "convert": plan_convert,
    "rope": plan_rope,
    "quantize-kv": plan_quantize_kv,
    "lint": plan_lint,
    "eval": plan_eval,
}


def plan_recipe(recipe: Recipe, ckpt: Checkpoint) -> list[str]:
    """Descriptions of each step; raises StepRefused (a UsageError) naming the line of the first impossible step."""
    return plan_steps(recipe, ckpt)[0]


def plan_steps(recipe: Recipe, ckpt: Checkpoint) -> tuple[list[str], PlanState]:
    """(descriptions, the model as the last step leaves it: config and tensors)."""
    state = PlanState(ckpt=ckpt, config=copy.deepcopy(ckpt.config))
    return [PLANNERS[step.kind](recipe, step, state) for step in recipe.steps], state
