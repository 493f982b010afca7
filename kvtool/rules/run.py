"""`kvtool lint` as a library: `plan` resolves the options and [tool.kvtool] into the engine's options, `apply`
lints. The command and a recipe's lint step both call them, so a code that matches no rule is refused once."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvtool.errors import UsageError
from kvtool.options.lint import LintOptions
from kvtool.rules.config_file import LintSettings
from kvtool.rules.registry import LintOptions as EngineOptions


@dataclass(frozen=True)
class LintPlan:
    paths: tuple[str, ...]
    engine: EngineOptions
    format: str
    names: tuple[str, ...] = field(default=())  # what the caller calls each model too (per-file ignores match it)
    compat: bool = False  # --compat: the engine-release table instead of the findings


def settings_for(o: LintOptions, *, formats: tuple[str, ...] | None = None) -> LintSettings:
    """[tool.kvtool] as the command finds it: --config, else the nearest pyproject.toml, none with --isolated."""
    from kvtool.io.inputfile import not_regular
    from kvtool.rules.config_file import find_pyproject, load_settings

    if o.config is not None and o.isolated:
        raise UsageError("--config and --isolated exclude each other")
    why = not_regular(o.config) if o.config is not None else None
    if why:  # "not found", or what it is instead of a file (a folder, a FIFO)
        raise UsageError(why, file=str(o.config), option="config")
    return load_settings(None if o.isolated else (o.config or find_pyproject()), formats=formats)


def plan(o: LintOptions, settings: LintSettings | None = None, *, formats: tuple[str, ...] | None = None,
         names: tuple[str, ...] = ()) -> LintPlan:
    """Options over settings (found as the command does when None); exit-2 errors for bad ones. `formats`: the
    output formats the caller renders (the engine imports no renderer); None: no format is checked."""
    from kvtool.rules.runner import check_selectors
    from kvtool.rules.registry import Selection

    if settings is None:
        settings = settings_for(o, formats=formats)
    fmt = o.format or settings.format or "text"
    if formats is not None and fmt not in formats:
        raise UsageError(f"unknown format {fmt!r}; choose from {', '.join(formats)}", option="format")
    tp = o.tensor_parallel_size if o.tensor_parallel_size is not None else settings.tensor_parallel_size
    if tp is not None and tp < 1:
        raise UsageError(f"must be a positive integer, got {tp}", option="tensor_parallel_size")
    given = {key: tuple(c.upper() for c in _split(getattr(o, key))) for key in ("select", "ignore")}
    for key, codes in given.items():  # a code that matches no rule is a typo, named where it was written
        check_selectors(codes, option=key)
    where = str(settings.source) if settings.source else None
    for key, codes in (("select", settings.select), ("ignore", settings.ignore),
                       *((f"per-file-ignores.{pattern}", cs) for pattern, cs in settings.per_file_ignores.items())):
        check_selectors(codes or (), file=where, field=f"tool.kvtool.{key}")
    chosen = given["select"] or settings.select or ("KV",)
    dropped = given["ignore"] if o.ignore is not None else (settings.ignore or ())
    strict = o.strict if o.strict is not None else bool(settings.strict)
    engine = EngineOptions(tensor_parallel_size=tp, selection=Selection(select=chosen, ignore=dropped),
                           strict=strict, require_weights=o.require_weights,
                           per_file_ignores=settings.per_file_ignores, engines=engines_for(o, settings))
    if o.compat and fmt not in ("text", "json"):
        raise UsageError(f"--compat prints text or json, not {fmt}", option="format")
    return LintPlan(paths=tuple(o.paths), engine=engine, format=fmt, names=tuple(names), compat=bool(o.compat))


def engines_for(o: LintOptions, settings: LintSettings, *, source: str = "--engine") -> tuple:
    """The engine releases to check: --engine (or a recipe's engines), else [tool.kvtool] engines, else the
    installed releases / the newest known (kvtool.engines.releases)."""
    from kvtool.engines.releases import checked_default, resolve

    if o.engine:
        return resolve(o.engine, source=source, option="engine")
    if settings.engines:
        return resolve(settings.engines, source="pyproject.toml", file=str(settings.source),
                       field="tool.kvtool.engines")
    return checked_default()


def apply(p: LintPlan, *, by_suffix: dict[str, Callable] | None = None) -> list:
    """One kvtool.rules.context.ModelReport per path. `by_suffix`: linters for other files, {".yaml": f} with
    f(path, engine options) (the command lints recipe files so; the recipe loader sits above the engine)."""
    from kvtool.rules.runner import lint_one

    out = []
    for path in p.paths:
        other = next((f for suffix, f in (by_suffix or {}).items() if path.endswith(suffix)), None)
        out.append(other(path, p.engine) if other else lint_one(path, p.engine, names=p.names))
    return out


def apply_compat(p: LintPlan) -> list[tuple[str, list | None, str | None]]:
    """--compat: (path, kvtool.engines.compat rows, None) per model, or (path, None, the one-line error)."""
    from kvtool.engines.compat import rows
    from kvtool.errors import InputError
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.spec import build_spec

    out = []
    for path in p.paths:
        try:
            ckpt = open_checkpoint(path)
        except InputError as exc:
            out.append((path, None, exc.line()))
            continue
        out.append((path, rows(build_spec(ckpt.config)), None))
    return out


def recipe_step_options(step_options: dict, path: str = "") -> LintOptions:
    """A recipe's lint step as `kvtool lint` options (codes as the command's comma-separated flags)."""
    def codes(key: str) -> str | None:
        value = step_options.get(key)
        return None if value is None else ",".join(value)

    return LintOptions(paths=[path] if path else [], select=codes("select"), ignore=codes("ignore"),
                       strict=bool(step_options.get("strict")), engine=list(step_options.get("engines") or []))


def recipe_settings() -> LintSettings:
    """What a recipe's lint step reads of [tool.kvtool]: the per-file ignores of the nearest pyproject.toml only
    (the step's own select / ignore / strict stand in for the rest, so a recipe means the same everywhere)."""
    from kvtool.rules.config_file import find_pyproject, load_settings

    s = load_settings(find_pyproject())
    return LintSettings(per_file_ignores=s.per_file_ignores, source=s.source)


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]
