"""Load a recipe: YAML -> validated, typed steps, with errors that name the line and key.

Strict by design: unknown keys, duplicate keys and wrong types are errors (the schema is
schemas/recipe.schema.json). Paths in a recipe are relative to the recipe file.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml

from kvtool.model.architectures import schemas_dir
from kvtool.errors import InputError, KvtoolError
from kvtool.io.inputfile import RECIPE_LIMIT, not_regular, read_text
from kvtool.io.jsonfile import lone_surrogate

RECIPE_SUFFIXES = (".yaml", ".yml")
# A recipe is a few dozen nodes. Anchors and aliases are allowed, but the document they expand to is
# bounded, so an alias bomb ("billion laughs") is refused after composing a few hundred nodes.
MAX_YAML_NODES = 10_000  # nodes after expanding aliases
MAX_YAML_DEPTH = 32
MAX_YAML_ALIASES = 100
MAX_INT_CHARS = 100  # far past any count a recipe holds; well under Python's 4300-digit int() limit


class RecipeError(InputError):
    """A recipe that does not parse or validate (exit 2). `lineno` / `column` and `detail` are kept apart, so
    recipe lint reports a finding from the fields instead of parsing the one-line message."""

    def __init__(self, detail: str, *, file: str, field: str | None = None, lineno: int | None = None,
                 column: int | None = None, cause: KvtoolError | None = None):
        self.detail, self.lineno, self.column = detail, lineno, column
        self.cause = cause  # a declared option's refusal: the options object's own error (its options field)
        where = f"line {lineno}" + (f" column {column}" if column else "") + ": " if lineno else ""
        super().__init__(where + detail, file=file, field=field)


FILE_KEYS = ("short_factor_file", "long_factor_file")  # the rope step's files, beside the steps' `text`


@dataclass(frozen=True)
class Step:
    kind: str  # convert | rope | quantize-kv | lint | eval
    options: dict
    index: int  # 1-based position in the recipe
    line: int


@dataclass
class Recipe:
    path: Path
    version: int
    name: str
    description: str
    steps: list[Step] = field(default_factory=list)

    def resolve(self, rel: str) -> Path:
        """A path the recipe names, relative to the recipe's folder (`~` is not expanded: see `file_problem`)."""
        return self.path.parent / rel

    def file_problem(self, rel: str) -> str | None:
        """Why the file the recipe names as `rel` cannot be read, or None: it must be a regular file inside the
        recipe's folder, links resolved, so a recipe from a pull request cannot make kvtool read (and hash into
        kvtool.json, or calibrate on) a file of the machine's: /proc/self/environ, ~/.ssh/..., ../secret."""
        if Path(rel).is_absolute() or str(rel).startswith("~"):
            return "is not a path relative to the recipe's folder (paths in a recipe stay inside its folder)"
        base = os.path.realpath(self.path.parent)
        if os.path.commonpath([base, os.path.realpath(self.resolve(rel))]) != base:
            return "leads outside the recipe's folder (paths in a recipe stay inside its folder)"
        return not_regular(self.resolve(rel))

    def text_files(self, section: dict | None) -> list[tuple[str, Path]]:
        """(as written, resolved path) for a section's `text` (one path or a list), relative to the recipe."""
        texts = (section or {}).get("text") or []
        return [(t, self.resolve(t)) for t in ([texts] if isinstance(texts, str) else texts)]


class _LineMap:
    """Line number (1-based) of every mapping key / sequence item, by path."""

    def __init__(self, root: yaml.Node):
        self.lines: dict[tuple, int] = {}
        self.duplicates: list[tuple[tuple, int]] = []
        self._walk(root, ())

    def _walk(self, node: yaml.Node, path: tuple) -> None:
        self.lines.setdefault(path, node.start_mark.line + 1)
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for k, v in node.value:
                key = k.value
                if key in seen:
                    self.duplicates.append((path + (key,), k.start_mark.line + 1))
                seen.add(key)
                self.lines[path + (key,)] = k.start_mark.line + 1
                self._walk(v, path + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                self._walk(item, path + (i,))

    def line(self, path: tuple) -> int:
        while path and path not in self.lines:
            path = path[:-1]
        return self.lines.get(path, 1)


@lru_cache(maxsize=1)
def _validator():
    import jsonschema

    from kvtool.options.schema import fill_choices

    schema = fill_choices(json.loads((schemas_dir() / "recipe.schema.json").read_text(encoding="utf-8")))
    # JSON Schema counts 1.0 as an integer; a recipe's counts go to range() and reshape, so only ints are
    checker = jsonschema.Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _c, v: isinstance(v, int) and not isinstance(v, bool))
    return jsonschema.validators.extend(jsonschema.Draft202012Validator, type_checker=checker)(schema)


def _dotted(path: tuple) -> str:
    out = ""
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or "(top level)"


def _schema_error(err, lines: _LineMap, file: str) -> InputError:
    path = tuple(err.absolute_path)
    msg = err.message
    if err.validator == "additionalProperties":
        extra = sorted(set(err.instance) - set(err.schema.get("properties", {})))
        if extra:
            key_path = path + (extra[0],)
            allowed = ", ".join(sorted(err.schema.get("properties", {})))
            return RecipeError(f"unknown key {extra[0]!r} (allowed: {allowed})", lineno=lines.line(key_path),
                               file=file, field=_dotted(key_path))
    if err.validator in ("oneOf", "anyOf") and err.context:
        msg = min(err.context, key=lambda e: len(e.message)).message
    if err.validator == "not" and path and isinstance(err.instance, dict):
        msg = "give either factor or target_context, not both"
    if err.validator in ("minProperties", "maxProperties") and len(path) == 2 and path[0] == "steps":
        msg = "each step is a mapping with exactly one key: convert, rope, quantize-kv, lint or eval"
    return RecipeError(msg, lineno=lines.line(path), file=file, field=_dotted(path))


def load_recipe(path: str | Path) -> Recipe:
    """Parse and validate a recipe; InputError (exit 2) with file, key and line on any problem."""
    p = Path(path)
    text = read_text(p, what="recipe", limit=RECIPE_LIMIT)
    try:
        node, data = _load_bounded(text, str(p))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise RecipeError(f"invalid YAML: {problem}", file=str(p), lineno=mark.line + 1 if mark else None,
                          column=mark.column + 1 if mark else None) from None
    if node is None or not isinstance(data, dict):
        raise RecipeError("a recipe must be a YAML mapping with `version` and `steps`", file=str(p))
    lines = _LineMap(node)
    if lines.duplicates:
        dpath, line = lines.duplicates[0]
        raise RecipeError(f"duplicate key {dpath[-1]!r}", lineno=line, file=str(p), field=_dotted(dpath))
    bad = _nonfinite(data, ())
    if bad is not None:
        raise RecipeError(".nan / .inf is not a usable number here", lineno=lines.line(bad), file=str(p),
                         field=_dotted(bad))
    errors = sorted((e for e in _validator().iter_errors(data) if not _declared_bound(e)),
                    key=lambda e: (lines.line(tuple(e.absolute_path)), list(e.absolute_path)))
    if errors:
        raise _schema_error(_most_specific(errors), lines, str(p))
    recipe = Recipe(path=p, version=data["version"], name=data.get("name", p.stem), description=data.get("description", ""))
    for i, item in enumerate(data["steps"]):
        (kind, options), = item.items()
        step = Step(kind=kind, options=dict(options or {}), index=i + 1, line=lines.line(("steps", i, kind)))
        _check_declared(step, lines, str(p))
        recipe.steps.append(step)
    return recipe


_BOUNDS = ("enum", "minimum", "maximum", "exclusiveMinimum", "pattern")


def _declared_field(kind: str, key: tuple):
    """The declared field a step key holds (steps[0].convert.calibration.seq_len -> seq_len), or None."""
    from kvtool.options.fields import OPERATIONS, fields_of

    cls = OPERATIONS.get(kind)
    dotted = ".".join(map(str, key))
    return next((f for f in fields_of(cls) if f.recipe_key == dotted), None) if cls is not None else None


def _declared_bound(err) -> bool:
    """A schema bound (enum, minimum, ...) on a declared field: left to the declaration's own check, so a recipe
    says what the command line and the Python API say (kvtool.options.fields.check_value)."""
    path = list(err.absolute_path)
    if err.validator not in _BOUNDS or len(path) < 4 or path[0] != "steps":
        return False
    f = _declared_field(path[2], tuple(path[3:]))
    s = f.spec if f is not None else None
    return s is not None and any(x is not None for x in (s.choices, s.minimum, s.maximum, s.exclusive_minimum,
                                                         s.pattern))


def _check_declared(step: Step, lines: _LineMap, file: str) -> None:
    """The step's options object, made as the command makes its own: the declaration checks every value."""
    from kvtool.errors import UsageError
    from kvtool.options.fields import OPERATIONS, fields_of, from_recipe

    cls = OPERATIONS[step.kind]
    try:
        from_recipe(cls, step.options, **{f.name: "" for f in fields_of(cls) if f.recipe_key is None and f.required})
    except UsageError as exc:
        f = next(f for f in fields_of(cls) if f.name == exc.option)
        key = ("steps", step.index - 1, step.kind, *f.recipe_key.split("."))
        raise RecipeError(exc.message, lineno=lines.line(key), file=file, field=_dotted(key), cause=exc) from None


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader that counts aliases and nesting while composing (before anything is expanded)."""

    def __init__(self, stream: str, file: str):
        super().__init__(stream)
        self._file, self._aliases, self._depth = file, 0, 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            self._aliases += 1
            if self._aliases > MAX_YAML_ALIASES:
                raise RecipeError(f"more than {MAX_YAML_ALIASES} YAML aliases", file=self._file)
        self._depth += 1
        if self._depth > MAX_YAML_DEPTH:
            raise RecipeError(f"YAML nested more than {MAX_YAML_DEPTH} levels deep", file=self._file)
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def _load_bounded(text: str, file: str) -> tuple[yaml.Node | None, object]:
    """(root node, data) with aliases, nesting and the alias-expanded size bounded; one parse."""
    loader = _BoundedLoader(text, file)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        if _expanded_size(node) > MAX_YAML_NODES:
            raise RecipeError(f"YAML expands to more than {MAX_YAML_NODES} nodes (aliases repeat anchored "
                             f"content)", file=file)
        too_long = _first_long_integer(node)
        if too_long is not None:
            raise RecipeError(f"an integer with {len(too_long.value)} characters; recipe numbers have at most "
                              f"{MAX_INT_CHARS}", lineno=too_long.start_mark.line + 1, file=file)
        _check_nodes(loader, node, file)
        return node, loader.construct_document(node)
    finally:
        loader.dispose()


_STR_TAG = "tag:yaml.org,2002:str"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def _check_nodes(loader: yaml.SafeLoader, root: yaml.Node, file: str) -> None:
    """Before constructing: every mapping key a string (recipe keys are names; an int beside a str key
    cannot even be sorted), and every scalar constructible as its tag says (`!!int "x"`, `!!bool maybe`,
    `!!timestamp x` raise ValueError / KeyError / AttributeError inside PyYAML), each named by line and key."""
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    seen: set[int] = set()
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if problem := lone_surrogate(node.value):
                raise RecipeError(problem, file=file, field=_dotted(path) if path else None,
                                  lineno=node.start_mark.line + 1, column=node.start_mark.column + 1)
            try:
                loader.construct_object(node)  # cached: construct_document reuses it
            except yaml.YAMLError:
                raise
            except Exception as exc:  # noqa: BLE001 - PyYAML's scalar constructors raise anything
                tag = node.tag.rsplit(":", 1)[-1]
                raise RecipeError(f"invalid YAML: {node.value[:60]!r} is not a valid !!{tag} "
                                  f"({type(exc).__name__})", file=file, field=_dotted(path) if path else None,
                                  lineno=node.start_mark.line + 1, column=node.start_mark.column + 1) from None
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.tag == _MERGE_TAG:
                    stack.append((v, path))
                    continue
                if not isinstance(k, yaml.ScalarNode) or k.tag != _STR_TAG:
                    shown = k.value[:60] if isinstance(k, yaml.ScalarNode) else f"a {k.id}"
                    raise RecipeError(f"keys are names (strings); {shown!r} is read as !!{k.tag.rsplit(':', 1)[-1]} "
                                      f"(quote it if it is meant as a name)", file=file, field=_dotted(path) if path
                                      else None, lineno=k.start_mark.line + 1, column=k.start_mark.column + 1)
                if problem := lone_surrogate(k.value):
                    raise RecipeError(problem, file=file, field=_dotted(path) if path else None,
                                      lineno=k.start_mark.line + 1, column=k.start_mark.column + 1)
                stack.append((v, path + (k.value,)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + (i,)) for i, item in enumerate(node.value))


def _first_long_integer(root: yaml.Node) -> yaml.ScalarNode | None:
    """An int scalar too long for int() (Python refuses past 4300 digits), found before constructing."""
    stack, seen = [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            if node.tag == "tag:yaml.org,2002:int" and len(node.value) > MAX_INT_CHARS:
                return node
        elif isinstance(node, yaml.MappingNode):
            stack.extend(x for kv in node.value for x in kv)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
    return None


def _expanded_size(root: yaml.Node) -> int:
    """Nodes the document has once every alias is expanded, computed per distinct node (memoised)."""
    sizes: dict[int, int] = {}

    def size(node: yaml.Node, depth: int) -> int:
        if id(node) in sizes:
            return sizes[id(node)]
        if depth > MAX_YAML_DEPTH + 1:  # a recursive alias (&a [*a]) never ends
            return MAX_YAML_NODES + 1
        total = 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                total += size(k, depth + 1) + size(v, depth + 1)
        elif isinstance(node, yaml.SequenceNode):
            for item in node.value:
                total += size(item, depth + 1)
        sizes[id(node)] = total = min(total, MAX_YAML_NODES + 1)
        return total

    return size(root, 0)


def _nonfinite(value, path: tuple) -> tuple | None:
    """Path of the first NaN / infinite float (YAML's .nan, .inf): JSON Schema bounds let them through."""
    if isinstance(value, float) and not math.isfinite(value):
        return path
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for k, v in items:
        found = _nonfinite(v, path + (k,))
        if found is not None:
            return found
    return None


def _most_specific(errors):
    """The first error by line, preferring the deepest path at that line."""
    first_line = errors[0]
    return max((e for e in errors if list(e.absolute_path)[:2] == list(first_line.absolute_path)[:2]),
               key=lambda e: len(e.absolute_path))
