"""A small JSON Schema 2020-12 validator for the keywords kvtool's config schemas use.

`import jsonschema` costs ~70 ms of CPU at start-up (referencing, rpds, attrs, format checkers):
a quarter of a cold `kvtool lint`. The config schemas (schemas/<model_type>.json) use a dozen
keywords, implemented here with jsonschema's semantics; tests/rules/test_schema_validator.py checks
that both report the same errors on every real config and on randomly mutated ones. A schema with a
keyword outside SUPPORTED is refused when compiled, never silently half-checked.

Errors carry the attributes of jsonschema.ValidationError that kvtool reads: validator,
validator_value, instance, absolute_path, absolute_schema_path, context, message.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Iterator

ANNOTATIONS = {"$schema", "$id", "$defs", "$comment", "title", "description", "default", "examples"}
SUPPORTED = {"type", "enum", "const", "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "required",
             "properties", "additionalProperties", "items", "minItems", "minProperties", "maxProperties",
             "propertyNames", "anyOf", "allOf", "oneOf", "$ref", "if", "then", "else"}


class SchemaError(ValueError):
    """The schema uses something this validator does not implement."""


@dataclass
class Error:
    validator: str
    validator_value: Any
    instance: Any
    absolute_path: list = field(default_factory=list)
    absolute_schema_path: list = field(default_factory=list)
    context: list = field(default_factory=list)
    message: str = ""


def _is_type(value: Any, t: str) -> bool:
    if t == "null":
        return value is None
    if t == "boolean":
        return isinstance(value, bool)
    if t == "integer":
        if isinstance(value, bool):
            return False
        return isinstance(value, int) or (isinstance(value, float) and math.isfinite(value) and value.is_integer())
    if t == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if t == "string":
        return isinstance(value, str)
    if t == "array":
        return isinstance(value, list)
    if t == "object":
        return isinstance(value, dict)
    raise SchemaError(f"unknown type {t!r}")


def _equal(a: Any, b: Any) -> bool:
    """JSON equality: 1 == 1.0, but True is not 1."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    return a == b


class Validator:
    """Draft202012Validator's iter_errors for the SUPPORTED keywords."""

    def __init__(self, schema: dict):
        self.schema = schema
        self._check(schema, "#")

    def _check(self, node: Any, where: str) -> None:
        if isinstance(node, bool):
            return
        if not isinstance(node, dict):
            raise SchemaError(f"{where}: a schema must be an object or a boolean")
        unknown = set(node) - SUPPORTED - ANNOTATIONS
        if unknown:
            raise SchemaError(f"{where}: unsupported keyword(s) {sorted(unknown)}")
        for key in ("items", "additionalProperties", "propertyNames", "if", "then", "else"):
            if key in node and not isinstance(node[key], bool):
                self._check(node[key], f"{where}/{key}")
        for key in ("properties", "$defs"):
            for name, sub in node.get(key, {}).items():
                self._check(sub, f"{where}/{key}/{name}")
        for key in ("anyOf", "allOf", "oneOf"):
            for i, sub in enumerate(node.get(key, [])):
                self._check(sub, f"{where}/{key}/{i}")
        if "$ref" in node:
            self._resolve(node["$ref"])

    def _resolve(self, ref: str) -> dict:
        if not ref.startswith("#/"):
            raise SchemaError(f"only local references are supported, not {ref!r}")
        node: Any = self.schema
        for part in ref[2:].split("/"):
            if not isinstance(node, dict) or part not in node:
                raise SchemaError(f"unresolvable reference {ref!r}")
            node = node[part]
        return node

    def iter_errors(self, instance: Any) -> Iterator[Error]:
        yield from self._errors(instance, self.schema, [], [])

    def is_valid(self, instance: Any) -> bool:
        return next(self.iter_errors(instance), None) is None

    def _errors(self, inst: Any, schema: Any, path: list, spath: list) -> Iterator[Error]:
        if schema is True:
            return
        if schema is False:
            yield Error("false", False, inst, list(path), list(spath), message="False schema does not allow it")
            return

        def err(kw: str, msg: str, context: list | None = None) -> Error:
            return Error(kw, schema[kw], inst, list(path), [*spath, kw], context or [], msg)

        if "$ref" in schema:
            yield from self._errors(inst, self._resolve(schema["$ref"]), path, [*spath, "$ref"])
        if "type" in schema:
            types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
            if not any(_is_type(inst, t) for t in types):
                yield err("type", f"{inst!r} is not of type {', '.join(map(repr, types))}")
        if "enum" in schema and not any(_equal(inst, v) for v in schema["enum"]):
            yield err("enum", f"{inst!r} is not one of {schema['enum']!r}")
        if "const" in schema and not _equal(inst, schema["const"]):
            yield err("const", f"{schema['const']!r} was expected")
        if isinstance(inst, (int, float)) and not isinstance(inst, bool):
            for kw, bad in (("minimum", lambda v, b: v < b), ("maximum", lambda v, b: v > b),
                            ("exclusiveMinimum", lambda v, b: v <= b), ("exclusiveMaximum", lambda v, b: v >= b)):
                if kw in schema and bad(inst, schema[kw]):
                    yield err(kw, f"{inst!r} violates {kw} {schema[kw]!r}")
        if isinstance(inst, dict):
            yield from self._object(inst, schema, path, spath, err)
        if isinstance(inst, list):
            if "minItems" in schema and len(inst) < schema["minItems"]:
                yield err("minItems", f"{inst!r} should be non-empty" if schema["minItems"] == 1
                          else f"{inst!r} has fewer than {schema['minItems']} items")
            if "items" in schema:
                for i, item in enumerate(inst):
                    yield from self._errors(item, schema["items"], [*path, i], [*spath, "items"])
        for kw in ("allOf",):
            for i, sub in enumerate(schema.get(kw, [])):
                yield from self._errors(inst, sub, path, [*spath, kw, i])
        if "anyOf" in schema:
            ctx = []
            for i, sub in enumerate(schema["anyOf"]):
                errs = list(self._errors(inst, sub, path, [*spath, "anyOf", i]))
                if not errs:
                    ctx = None
                    break
                ctx += errs
            if ctx is not None:
                yield err("anyOf", f"{inst!r} is not valid under any of the given schemas", ctx)
        if "oneOf" in schema:
            ctx, passed = [], 0
            for i, sub in enumerate(schema["oneOf"]):
                errs = list(self._errors(inst, sub, path, [*spath, "oneOf", i]))
                passed += not errs
                ctx += errs
            if passed != 1:
                yield err("oneOf", f"{inst!r} is not valid under exactly one of the given schemas",
                          ctx if not passed else [])
        if "if" in schema:
            branch = "then" if not any(True for _ in self._errors(inst, schema["if"], path, spath)) else "else"
            if branch in schema:
                yield from self._errors(inst, schema[branch], path, [*spath, branch])

    def _object(self, inst: dict, schema: dict, path: list, spath: list, err) -> Iterator[Error]:
        for key in schema.get("required", []):
            if key not in inst:
                yield err("required", f"{key!r} is a required property")
        if "minProperties" in schema and len(inst) < schema["minProperties"]:
            yield err("minProperties", f"{inst!r} should be non-empty" if schema["minProperties"] == 1
                      else f"{inst!r} does not have enough properties")
        if "maxProperties" in schema and len(inst) > schema["maxProperties"]:
            yield err("maxProperties", f"{inst!r} has too many properties")
        props = schema.get("properties", {})
        for key, sub in props.items():
            if key in inst:
                yield from self._errors(inst[key], sub, [*path, key], [*spath, "properties", key])
        if "propertyNames" in schema:
            for key in inst:
                yield from self._errors(key, schema["propertyNames"], path, [*spath, "propertyNames"])
        extra = schema.get("additionalProperties", True)
        if extra is not True:
            for key in inst:
                if key not in props:
                    if extra is False:
                        yield err("additionalProperties", f"Additional properties are not allowed ({key!r})")
                    else:
                        yield from self._errors(inst[key], extra, [*path, key], [*spath, "additionalProperties"])
