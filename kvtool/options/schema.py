"""The recipe-step JSON schema, generated from the declared options (schemas/recipe.schema.json's step $defs)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvtool.options.fields import Field, fields_of

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}
# recipe step key -> the $defs entry that holds its schema
STEP_DEFS = {"convert": "convert", "rope": "rope", "quantize-kv": "quantize_kv", "lint": "lint", "eval": "eval"}


def value_schema(f: Field) -> dict:
    """The JSON schema of one field's recipe value."""
    s = f.spec
    if s.schema is not None:
        return dict(s.schema)
    if f.registry_choices:  # filled in by fill_choices when a recipe is loaded: a new type needs no schema edit
        fn = s.choices
        out: dict[str, Any] = {"type": "string", "description": f"one of {fn.__module__}.{fn.__qualname__}() "
                                                                "(filled in when a recipe is loaded)"}
    elif s.pattern is not None:
        out = {"type": "string", "pattern": f"^(?:{s.pattern})$"}
    elif s.choices is not None:
        out = {"enum": list(s.choices)}
    else:
        out = {"type": _JSON_TYPES[f.base_type]}
    for key, bound in (("minimum", s.minimum), ("exclusiveMinimum", s.exclusive_minimum), ("maximum", s.maximum)):
        if bound is not None:
            out[key] = bound
    if f.is_list:
        out = {"type": "array", "items": out}
    return out


def step_schema(cls) -> dict:
    """The strict object schema of an operation's recipe step (nested keys as nested strict objects)."""
    root: dict = {"type": "object", "additionalProperties": False}
    required = [f.recipe_key for f in fields_of(cls) if f.recipe_key and f.spec.recipe_required]
    if required:
        root["required"] = required
    root["properties"] = {}
    for f in fields_of(cls):
        key = f.recipe_key
        if key is None:
            continue
        node = root
        *parents, leaf = key.split(".")
        for p in parents:
            node = node["properties"].setdefault(p, {"type": "object", "additionalProperties": False,
                                                     "properties": {}})
        node["properties"][leaf] = value_schema(f)
    root.update(getattr(cls, "RECIPE_SCHEMA", {}))
    return root


def fill_choices(schema: dict) -> dict:
    """`schema` (the committed file, loaded) with every registry's choices as the enum of its step key."""
    from kvtool.options import load_all

    for cmd, cls in load_all().items():
        if cmd not in STEP_DEFS:
            continue
        for f in fields_of(cls):
            if f.recipe_key and f.registry_choices:
                node = schema["$defs"][STEP_DEFS[cmd]]
                for part in f.recipe_key.split("."):
                    node = node["properties"][part]
                node.clear()
                node["enum"] = list(f.choices)
    return schema


def recipe_schema(committed: dict) -> dict:
    """`committed` with every declared operation's step $def generated."""
    from kvtool.options import load_all

    out = json.loads(json.dumps(committed))
    for cmd, cls in load_all().items():
        if cmd in STEP_DEFS:
            out["$defs"][STEP_DEFS[cmd]] = step_schema(cls)
    return out


def schema_path() -> Path:
    from kvtool.model.architectures import schemas_dir

    return schemas_dir() / "recipe.schema.json"


def dumps(obj: Any, indent: int = 0) -> str:
    """JSON, one key per line, with any value that fits in a 110-column line kept on one line."""
    flat = json.dumps(obj, ensure_ascii=False)
    if len(flat) + 2 * indent <= 110 or not isinstance(obj, (dict, list)) or not obj:
        return flat
    pad = "  " * (indent + 1)
    if isinstance(obj, dict):
        items = [f"{pad}{json.dumps(k)}: {dumps(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + "  " * indent + "}"
    items = [f"{pad}{dumps(v, indent + 1)}" for v in obj]
    return "[\n" + ",\n".join(items) + "\n" + "  " * indent + "]"
