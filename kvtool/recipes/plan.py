"""Check a whole recipe against the source model before any work is done.

Each step kind has a planner that checks its options against the model *as the previous steps
leave it* (simulated on the config alone, no torch) and returns a one-line description of what
it will do. An impossible step (groups not dividing the heads, RoPE on an ALiBi model, missing
calibration text) is refused here, before the first tensor is read.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Callable

from kvtool.errors import KvtoolError, UsageError
from kvtool.io.inputfile import not_regular
from kvtool.recipes.load import Recipe, Step
from kvtool.model.spec import build_spec


@dataclass
class PlanState:
    config: dict  # the config as the steps so far leave it
    has_weights: bool
    notes: list[str] = field(default_factory=list)


def _fail(recipe: Recipe, step: Step, message: str, cause: KvtoolError | None = None) -> UsageError:
    """The step's error, naming the recipe key when `cause` names an options field (steps[0].rope.factor)."""
    where = f"steps[{step.index - 1}].{step.kind}"
    if cause is not None and cause.option and not cause.field:
        from kvtool.options.fields import OPERATIONS, field_named

        cls = OPERATIONS.get(step.kind)
        f = field_named(cls, cause.option) if cls is not None else None
        if f is not None and f.recipe_key:
            where += "." + f.recipe_key
    return UsageError(f"line {step.line}: step {step.index} ({step.kind}): {message}", file=str(recipe.path),
                      field=where)


def _text_paths(recipe: Recipe, step: Step, section: dict | None, *, required: bool) -> None:
    section = section or {}
    if section.get("text") is None:
        if required and not section.get("dataset"):
            raise _fail(recipe, step, "needs calibration text: set calibration.text (a file relative to the recipe)")
        return
    for t, path in recipe.text_files(section):
        why = not_regular(path)
        if why:
            raise _fail(recipe, step, f"text file {t!r} {why} (resolved to {path})")


def plan_convert(recipe: Recipe, step: Step, state: PlanState) -> str:
    spec = build_spec(state.config)
    arch = spec.arch
    if not arch.convert.get("supported"):
        alt = arch.convert.get("alternative")
        raise _fail(recipe, step, f"{spec.model_type or 'this model'} cannot be converted: {arch.convert.get('reason', 'unsupported')}"
                    + (f" (alternative: {alt})" if alt else ""))
    if not state.has_weights:
        raise _fail(recipe, step, "the source has no safetensors weights to convert")
    from kvtool.convert.config_edit import kv_field_is_boolean, rewrite_config
    from kvtool.convert.driver import resolve_target

    h, kv = spec.num_heads, spec.num_kv_heads
    if not h or not kv:
        raise _fail(recipe, step, "cannot read the query / KV head counts from the config")
    o = step.options
    try:
        g = resolve_target(o["to"], o.get("groups") if o["to"] == "gqa" else None, h, kv,
                           flag_field=kv_field_is_boolean(arch, spec.config))
        if o.get("method") == "aware":
            _text_paths(recipe, step, o.get("calibration"), required=True)
        new_inner = rewrite_config(spec.config, arch, num_heads=h, new_kv_heads=g)
    except UsageError as exc:
        raise _fail(recipe, step, exc.message) from None
    if spec.wrapper_key:
        state.config[spec.wrapper_key] = new_inner
    else:
        state.config = new_inner
    return f"{step.options['to']}: {kv} -> {g} KV heads ({step.options.get('method', 'mean')})"


def plan_rope(recipe: Recipe, step: Step, state: PlanState) -> str:
    spec = build_spec(state.config)
    if spec.position != "rope":
        raise _fail(recipe, step, f"the model uses {spec.position} positions, not RoPE")
    from kvtool.errors import InputError
    from kvtool.recipes.apply import rope_options
    from kvtool.rope.apply import plan_rope

    try:
        state.config = plan_rope(spec, rope_options(step.options, recipe), source=str(recipe.path)).config
    except (UsageError, InputError) as exc:
        raise _fail(recipe, step, exc.message, exc) from None
    o = step.options
    size = f"factor {o['factor']}" if "factor" in o else (f"target context {o['target_context']}" if "target_context" in o else "")
    return f"{o['type']} {size}".strip()


def plan_quantize_kv(recipe: Recipe, step: Step, state: PlanState) -> str:
    spec = build_spec(state.config)
    if not state.has_weights:
        raise _fail(recipe, step, "the source has no safetensors weights to calibrate")
    if spec.is_mla:
        raise _fail(recipe, step, "MLA models cache a latent, not per-head K/V; FP8 KV scales for MLA are not supported")
    _text_paths(recipe, step, step.options.get("calibration"), required=True)
    from kvtool.options.fields import from_recipe
    from kvtool.options.quantize_kv import QuantizeOptions

    o = from_recipe(QuantizeOptions, step.options, src="", dst="")
    return f"FP8 KV scales ({o.strategy}, observer {o.observer})"


def plan_lint(recipe: Recipe, step: Step, state: PlanState) -> str:
    return "lint" + (" --strict" if step.options.get("strict") else "")


def plan_eval(recipe: Recipe, step: Step, state: PlanState) -> str:
    o = step.options
    if not o.get("text") and not o.get("dataset"):
        raise _fail(recipe, step, "needs `text` (file(s) relative to the recipe) or `dataset`")
    _text_paths(recipe, step, o, required=False)
    thresholds = o.get("thresholds") or {}
    return "eval against the source" + (f" (gates: {', '.join(f'{k}={v}' for k, v in thresholds.items())})" if thresholds else "")


PLANNERS: dict[str, Callable[[Recipe, Step, PlanState], str]] = {
    "convert": plan_convert,
    "rope": plan_rope,
    "quantize-kv": plan_quantize_kv,
    "lint": plan_lint,
    "eval": plan_eval,
}


def plan_recipe(recipe: Recipe, config: dict, has_weights: bool) -> list[str]:
    """Descriptions of each step; raises UsageError naming the line of the first impossible step."""
    state = PlanState(config=copy.deepcopy(config), has_weights=has_weights)
    return [PLANNERS[step.kind](recipe, step, state) for step in recipe.steps]
