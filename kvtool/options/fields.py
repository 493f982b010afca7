"""Declaring an operation's options once: a dataclass whose fields carry their CLI, recipe and docs facts.

Each operation (kvtool/options/<operation>.py) is one `@operation("cmd")` dataclass. A field is declared
with `option(...)` or `argument(...)`: its name, type (the annotation), default, choices and help, plus what
the generators need (flag spelling, short flag, recipe key, numeric bounds, repeatable, negatable). From
these declarations come the typer flags (kvtool/commands/options_cli.py), the recipe-step JSON schema
(kvtool/options/schema.py) and the option tables in the docs (kvtool/options/docs.py).

Library code raises errors that name fields (`UsageError(..., option="groups")`); the CLI shows the flag
(`--groups`) and a recipe the step key (`steps[2].convert.groups`). No typer, no torch here.
"""

from __future__ import annotations

import dataclasses
import math
import re
import types
import typing
from dataclasses import MISSING
from typing import Any, Callable, Sequence

_KEY = "kvtool"


@dataclasses.dataclass(frozen=True)
class Spec:
    """What a field declares beyond its name, type and default."""

    help: str = ""
    positional: bool = False  # SRC / DST: a CLI argument, never in a recipe
    flags: tuple[str, ...] = ()  # CLI spellings; default: --name-with-dashes
    short: str | None = None  # e.g. "-g"
    negatable: bool = False  # --eval/--no-eval
    repeatable: bool = False  # --text A --text B
    # choices and bounds: enforced by `check` (every options object checks itself when it is made), shown in
    # the help, the docs and the recipe schema. A function when a registry holds the choices (RoPE types,
    # merge methods): called only when a value is checked or the schema / docs are built, never at import
    choices: tuple[str, ...] | Callable[[], Sequence[str]] | None = None
    minimum: float | None = None
    exclusive_minimum: float | None = None
    maximum: float | None = None
    pattern: str | None = None  # a string value must match it whole; `choices` then only names the forms (cuda:N)
    # the parser a value that matches goes to (kvtool.units: raises ValueRefused), run by `check` too: what the
    # pattern lets through, the parser reads, or the one line names the field (sizes past 4 EiB, ...)
    parse: Callable[[str], Any] | None = None
    recipe: str | bool = True  # the recipe key ("calibration.tokens" nests), True: the name, False: not in recipes
    recipe_required: bool = False
    schema: dict | None = None  # the recipe value's JSON schema, when the type alone does not say it
    cli: bool = True  # False: no flag (a library-only setting, e.g. quantize-kv's layerwise)
    metavar: str | None = None
    show_default: bool = True
    # the choices of other options this one works with, as flags ("--to mla", "--method aware"): where --help lists
    # it ("With --to mla:") and what the docs table says before its help; () works with every choice
    applies: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Field:
    """One declared option, as the generators read it."""

    name: str
    type: Any  # the resolved annotation, e.g. int | None, list[str]
    default: Any  # MISSING when required
    spec: Spec

    @property
    def choices(self) -> tuple[str, ...] | None:
        c = self.spec.choices
        return tuple(c()) if callable(c) else c

    @property
    def registry_choices(self) -> bool:
        """The choices come from a registry: the committed schema leaves them to be filled in at load."""
        return callable(self.spec.choices)

    @property
    def applies_to(self) -> str | None:
        """"--method aware or --to mla", or None for an option of every target and method."""
        return " or ".join(self.spec.applies) or None

    @property
    def required(self) -> bool:
        return self.default is MISSING

    @property
    def flags(self) -> tuple[str, ...]:
        if self.spec.positional:
            return ()
        return self.spec.flags or ("--" + self.name.replace("_", "-"),)

    @property
    def flag(self) -> str:
        """How the CLI names this field in an error line: --groups, or SRC for an argument."""
        return self.name.upper() if self.spec.positional else self.flags[0]

    @property
    def recipe_key(self) -> str | None:
        if self.spec.positional or self.spec.recipe is False:
            return None
        return self.name if self.spec.recipe is True else self.spec.recipe

    @property
    def base_type(self) -> Any:
        """int for `int | None`, str for `list[str]`."""
        t = self.type
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if typing.get_origin(t) in (typing.Union, types.UnionType) and len(args) == 1:
            t = args[0]
        if typing.get_origin(t) in (list, tuple):
            t = typing.get_args(t)[0]
        return t

    @property
    def is_list(self) -> bool:
        t = self.type
        args = [a for a in typing.get_args(t) if a is not type(None)]
        if args and typing.get_origin(t) not in (list, tuple):
            t = args[0]
        return typing.get_origin(t) in (list, tuple)


def option(default: Any = MISSING, *, default_factory: Any = MISSING, **spec: Any):
    """A `--flag` field (and, unless recipe=False, a recipe key of the same name)."""
    return dataclasses.field(default=default, default_factory=default_factory, metadata={_KEY: Spec(**spec)})


ENGINE_HELP = ("Engine release kvtool answers for, as a requirement (e.g. vllm==0.28.0, transformers==4.44.2); "
               "repeatable, one meaning in every command (docs/lint.md#engine-versions): ")


def engine_option(purpose: str, *, recipe: Any = False):
    """`--engine REQ`, declared once for every command that takes it: a repeatable list of requirements.
    `purpose` ends the help: what this command does with them. A command that follows one release (kv-budget,
    rope --show) refuses two requirements for that engine by name (kvtool.engines.releases.one_release_of),
    never keeping the last silently."""
    return option(default_factory=list, repeatable=True, recipe=recipe, metavar="REQ",
                  schema={"type": "array", "items": {"type": "string", "minLength": 1}}, help=ENGINE_HELP + purpose)


def argument(default: Any = MISSING, **spec: Any):
    """A positional CLI argument (SRC, DST, MODEL): never a recipe key."""
    return dataclasses.field(default=default, metadata={_KEY: Spec(positional=True, recipe=False, **spec)})


OPERATIONS: dict[str, type] = {}  # command name -> its options class


def check_value(f: Field, value: Any) -> None:
    """`value` against field `f`'s declared type, choices and bounds (None, an unset optional, passes):
    UsageError naming the field, the one line the CLI, a recipe and the Python API all print."""
    from kvtool.errors import UsageError

    s = f.spec
    if value is None or f.is_list or (s.choices is None and s.minimum is None and s.exclusive_minimum is None
                                      and s.maximum is None and s.pattern is None and s.parse is None):
        return
    t = f.base_type
    ok = {int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
          str: lambda v: isinstance(v, str), bool: lambda v: isinstance(v, bool)}.get(t)
    if ok is not None and not ok(value):
        what = {int: "an integer", float: "a finite number", str: "a string", bool: "true or false"}[t]
        raise UsageError(f"must be {what}, got {value!r:.60}", option=f.name)
    choices = f.choices
    if s.pattern is not None and not re.fullmatch(s.pattern, value) or (
            s.pattern is None and choices is not None and value not in choices):
        forms = ", ".join(choices) if choices is not None else f"/{s.pattern}/"
        raise UsageError(f"must be one of {forms}, got {value!r:.60}", option=f.name)
    if s.parse is not None:
        from kvtool.units import ValueRefused

        try:
            s.parse(value)
        except ValueRefused as exc:
            raise UsageError(str(exc), option=f.name) from None
    for bound, fails, words in ((s.minimum, lambda b: value < b, "at least"),
                                (s.exclusive_minimum, lambda b: value <= b, "greater than"),
                                (s.maximum, lambda b: value > b, "at most")):
        if bound is not None and fails(bound):
            raise UsageError(f"must be {words} {_number(bound)}, got {_number(value)}", option=f.name)


def check_paths(cls, values: dict[str, Any]) -> None:
    """A command line's MODEL / SRC / DST: an empty or blank one is no path (Path("") is the working folder, which
    no one names this way: `kvtool lint ""` linted it, `kvtool rope m ""` staged a write into it). A recipe's
    planner fills these with "" itself, so the CLI asks this, not `check`."""
    from kvtool.errors import UsageError

    for f in fields_of(cls):
        value = values.get(f.name)
        if not f.spec.positional or value is None:
            continue
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, str) and not item.strip():
                raise UsageError(f"{item!r} is not a path or model id (an empty name)", option=f.name)


def check_fields(cls, **values: Any) -> None:
    """Values a library call takes as keywords (kvtool.eval.evaluate's max_length...) against the fields of the same
    name in `cls`'s declaration: the line the options object, the CLI and a recipe print."""
    for name, value in values.items():
        check_value(field_named(cls, name), value)


def _number(v: float) -> str:
    """1,024 / 0.5 / 1e+300; a huge integer by its size, not its 4,000 digits."""
    if isinstance(v, float):
        return f"{v:g}" if not v.is_integer() or abs(v) >= 1e16 else f"{int(v):,}"
    if abs(v) < 10**30:
        return f"{v:,}"
    digits = int(abs(v).bit_length() * 0.30103) + 1  # str() of a 5000-digit int is Python's ValueError
    return f"an integer of about {digits:,} digits"


def check(opts: Any) -> None:
    """Every declared field of an options object against its declaration (`check_value`). Each options
    class runs it when an object is made (`__post_init__`); a caller that changes a field checks again."""
    for f in fields_of(opts):
        check_value(f, getattr(opts, f.name))


def operation(command: str, *, recipe: bool = True):
    """Make the class a keyword-only dataclass of declared fields, registered as `command`'s options.
    recipe=False: the operation is no recipe step (its fields have no recipe keys)."""

    def wrap(cls):
        cls.check = cls.__post_init__ = check  # made, or changed and checked again: the declaration decides
        cls = dataclasses.dataclass(kw_only=True)(cls)
        cls.COMMAND = command
        cls.RECIPE_STEP = recipe
        OPERATIONS[command] = cls
        return cls

    return wrap


def fields_of(cls_or_obj) -> list[Field]:
    """The declared fields, in declaration order (the CLI's and the docs' order)."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    cached = cls.__dict__.get("_kvtool_fields")
    if cached is not None:
        return cached
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        spec = f.metadata.get(_KEY)
        if spec is None:
            continue
        if not getattr(cls, "RECIPE_STEP", True):
            spec = dataclasses.replace(spec, recipe=False)
        default = f.default if f.default is not MISSING else (
            f.default_factory() if f.default_factory is not MISSING else MISSING)
        out.append(Field(f.name, hints[f.name], default, spec))
    cls._kvtool_fields = out
    return out


def field_named(cls_or_obj, name: str) -> Field | None:
    return next((f for f in fields_of(cls_or_obj) if f.name == name), None)


def flag_of(cls_or_obj, name: str) -> str:
    """The CLI spelling of field `name` (itself when it is no declared field)."""
    f = field_named(cls_or_obj, name)
    return f.flag if f is not None else name


def recipe_key_of(cls_or_obj, name: str) -> str:
    """The recipe spelling of field `name` (itself when it is no recipe key)."""
    f = field_named(cls_or_obj, name)
    return (f.recipe_key or name) if f is not None else name


def from_recipe(cls, step: dict, **given: Any):
    """An options object from a recipe step's mapping (validated by the schema), plus `given` fields
    (SRC, DST and the like, which recipes do not spell)."""
    values: dict[str, Any] = {}
    for f in fields_of(cls):
        key = f.recipe_key
        if key is None:
            continue
        node: Any = step
        for part in key.split("."):
            node = node.get(part, MISSING) if isinstance(node, dict) else MISSING
        if node is not MISSING:
            values[f.name] = node
    values.update(given)
    return cls(**values)


def recipe_keys(cls) -> set[str]:
    """Top-level recipe keys of the operation's step."""
    return {f.recipe_key.split(".")[0] for f in fields_of(cls) if f.recipe_key}
