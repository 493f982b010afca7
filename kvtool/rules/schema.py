"""config.json against its JSON Schema (KV9xx), and notes on how the config was read (KV001-KV003).

Schemas live in schemas/<model_type>.json (JSON Schema 2020-12, built by schemas/build_schemas.py);
a model type without one is checked against schemas/generic.json. Validation uses
kvtool.rules.jsonschema_subset (jsonschema's semantics for the keywords these schemas use, without its
~70 ms import); each compiled validator is cached for the run.
"""

from __future__ import annotations

import json
import math
from functools import lru_cache
from typing import Any

from kvtool.model.architectures import schemas_dir
from kvtool.rules.registry import checker, define

define("KV001", "unknown-model-type", "info",
       "model_type is missing or has no kvtool table; the generic field names were used",
       """
       What it does: notes that config.json has no model_type, or one kvtool has no architecture
       table and schema for, so heads, head_dim and layer types were read with the common
       transformers field names (schemas/architectures/generic.json, schemas/generic.json).
       Why it matters: architecture-specific checks (weight names, fused layouts, sliding-window
       patterns, field aliases) did not run; a remote-code model may use names the generic table
       does not know.
       Example: {"model_type": "baichuan", ...}
       Fix: nothing to fix in the model; add a table under schemas/architectures/ to check it fully.
       """, hint="add schemas/architectures/<model_type>.json to check this architecture fully", topic="schema")

define("KV002", "nonstandard-json", "warning",
       "config.json contains Infinity or NaN, which strict JSON parsers reject",
       """
       What it does: flags the tokens Infinity, -Infinity and NaN, which Python's json module
       accepts but the JSON standard (RFC 8259) does not.
       Why it matters: Rust, Go and JavaScript loaders (serving routers, hub tooling, the
       tokenizers / safetensors ecosystems) fail to parse the file.
       Example: "time_step_limit": [0.0, Infinity]
       Fix: replace the value with a large finite number or null, if the model code accepts it.
       """, hint="replace Infinity / NaN with a finite number or null", topic="schema")

define("KV003", "multimodal-wrapper", "info",
       "A multimodal wrapper config was linted as its text model",
       """
       What it does: notes that config.json wraps the language model in text_config (or
       language_config / llm_config / thinker_config) and that the checks ran on that inner config.
       Why it matters: the KV cache and attention layout are the text model's; vision or audio
       towers are not checked.
       Example: {"model_type": "qwen3_vl", "text_config": {"model_type": "qwen3_vl_text", ...}}
       Fix: nothing; it tells you which part of the file the findings refer to.
       """, topic="schema")

_SCHEMA_DOC = """
       What it does: validates config.json (the text model's config for multimodal wrappers)
       against schemas/<model_type>.json: the JSON type of every key transformers' config class
       declares, value ranges and enums (hidden_act, dtype), the legacy rope_scaling and v5
       rope_parameters shapes, and the core dimensions. Unknown keys are allowed.
       Why it matters: transformers v5 rejects or silently coerces wrongly typed values at load;
       vLLM and SGLang read the raw JSON and fail later, far from the cause.
       Example: {message_example}
       Fix: {fix}
       """
define("KV901", "schema-type", "error", "A config value has the wrong JSON type",
       _SCHEMA_DOC.format(message_example='"num_attention_heads": "32" (a string, not an integer)',
                          fix="write the value with the type the schema names"),
       hint="use the JSON type the schema names", topic="schema")
define("KV902", "schema-range", "error", "A config value is outside its allowed range",
       _SCHEMA_DOC.format(message_example='"rms_norm_eps": -1e-06 or "num_hidden_layers": 0',
                          fix="use a value inside the range the message names"),
       hint="use a value inside the allowed range", topic="schema")
define("KV903", "schema-enum", "error", "A config value is not one of the allowed values",
       _SCHEMA_DOC.format(message_example='"hidden_act": "swiglu" (transformers knows silu, gelu, ...)',
                          fix="use one of the values the message lists"),
       hint="use one of the allowed values", topic="schema")
define("KV904", "schema-required", "error", "A core dimension key is missing from config.json",
       _SCHEMA_DOC.format(message_example="a llama config without num_attention_heads",
                          fix="write the key; without it loaders fall back to a class default that "
                              "almost never matches the weights"),
       hint="write the key explicitly", topic="schema")
define("KV905", "schema-shape", "error", "A config value does not have the structure its schema requires",
       _SCHEMA_DOC.format(message_example='"rope_parameters": {"global": {...}} (nested keys must be layer types)',
                          fix="restructure the value as the message describes"),
       hint="restructure the value as the schema requires", topic="schema")

SCHEMA_CODES = ("KV901", "KV902", "KV903", "KV904", "KV905")
_RANGE = {"minimum": ">=", "maximum": "<=", "exclusiveMinimum": ">", "exclusiveMaximum": "<"}
_MAX_REPORTED = 25  # per model: a config of the wrong model type would otherwise flood the output


@lru_cache(maxsize=None)
def schema_for(model_type: str) -> tuple[str, dict]:
    """(schema file name, schema) for a model type; generic.json when there is none."""
    base = schemas_dir()
    for name in (model_type, "generic"):
        path = base / f"{name}.json"
        if name and path.is_file():
            return path.name, json.loads(path.read_text(encoding="utf-8"))
    raise FileNotFoundError(base / "generic.json")


@lru_cache(maxsize=None)
def validator_for(model_type: str):
    from kvtool.rules.jsonschema_subset import Validator

    _name, schema = schema_for(model_type)
    return Validator(schema)


def dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _short(v: Any) -> str:
    text = json.dumps(v) if not isinstance(v, float) or math.isfinite(v) else repr(v)
    return text if len(text) <= 60 else text[:57] + "..."


def _leaf(err):
    """The most telling error inside anyOf / oneOf branches: the deepest one, else a non-type one."""
    while err.validator in ("anyOf", "oneOf") and err.context:
        ctx = list(err.context)
        if _all_required(err):
            return err
        depth = max(len(e.absolute_path) for e in ctx)
        if depth > len(err.absolute_path):
            err = next(e for e in ctx if len(e.absolute_path) == depth)
            continue
        if all(e.validator == "type" for e in ctx):
            return err  # described as "expected <every branch's type>"
        plain = [e for e in ctx if e.validator not in ("type", "anyOf", "oneOf", "required")]
        needs = [e for e in ctx if _all_required(e)]
        if plain:
            err = plain[0]
        elif needs:
            return needs[0]
        else:
            err = next((e for e in ctx if e.validator != "type"), ctx[0])
    return err


def _all_required(err) -> bool:
    return err.validator in ("anyOf", "oneOf") and bool(err.context) and all(
        e.validator == "required" for e in err.context)


def _branch_types(err) -> list[str]:
    out: list[str] = []
    for e in err.context:
        for t in (e.validator_value if isinstance(e.validator_value, list) else [e.validator_value]):
            if t not in out:
                out.append(t)
    return out


def describe(err) -> tuple[str, str, str]:
    """(code, dotted path, message) for one validation error (kvtool.rules.jsonschema_subset or jsonschema)."""
    err = _leaf(err)
    path = dotted(err.absolute_path)
    if _all_required(err):
        keys = [k for e in err.context for k in e.validator_value]
        if path:
            return "KV904", path, f"{path} has none of {' / '.join(keys)}"
        return "KV904", keys[0], f"none of {' / '.join(keys)} is set"
    kw, want = err.validator, err.validator_value
    if "propertyNames" in err.absolute_schema_path:
        allowed = ", ".join(map(str, want)) if kw == "enum" else err.message
        return "KV905", path, f"{path}: key {_short(err.instance)} is not allowed here (expected {allowed})"
    shown = f"{path} = {_short(err.instance)}" if path else "config"
    if kw == "required":
        missing = [k for k in want if not isinstance(err.instance, dict) or k not in err.instance]
        key = f"{path}.{missing[0]}" if path else missing[0]
        return "KV904", key, f"{key} is missing"
    if kw in ("anyOf", "oneOf") and err.context:
        return "KV901", path, f"{shown}: expected {' or '.join(_branch_types(err))}, found {_json_type(err.instance)}"
    if kw == "type":
        kinds = " or ".join(want) if isinstance(want, list) else want
        return "KV901", path, f"{shown}: expected {kinds}, found {_json_type(err.instance)}"
    if kw in _RANGE:
        return "KV902", path, f"{shown}: must be {_RANGE[kw]} {want}"
    if kw in ("enum", "const"):
        allowed = [want] if kw == "const" else list(want)
        allowed = [a for a in allowed if a is not None]
        listed = ", ".join(map(str, allowed[:12])) + (f", ... ({len(allowed)} values)" if len(allowed) > 12 else "")
        return "KV903", path, f"{shown}: not one of {listed}"
    return "KV905", path, f"{shown}: {err.message}"


def _json_type(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, int):
        return "integer"
    if isinstance(v, float):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, list):
        return "array"
    return "object"


def nonfinite_paths(value: Any, path: str = "") -> list[str]:
    """Dotted paths of Infinity / NaN values (what JsonDocument.nonstandard recorded)."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path]
    out: list[str] = []
    if isinstance(value, dict):
        for k, v in value.items():
            out += nonfinite_paths(v, f"{path}.{k}" if path else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += nonfinite_paths(v, f"{path}[{i}]")
    return out


@checker("schema")
def check_model_type(ctx) -> None:
    spec = ctx.spec
    if spec.wrapper_key:
        outer = ctx.checkpoint.config.get("model_type")
        ctx.report("KV003", f"linted as its text model: {spec.wrapper_key} (model_type {spec.model_type!r}) "
                            f"inside the {outer!r} wrapper", path=spec.wrapper_key)
    if spec.arch.generic:
        key = spec.prefixed("model_type")
        if spec.model_type is None:
            msg = f"{key} is missing; checked with the generic field names"
        else:
            msg = f"{key} {spec.model_type!r} has no kvtool table; checked with the generic field names"
        ctx.report("KV001", msg, path=key)


@checker("schema")
def check_nonstandard_json(ctx) -> None:
    doc = ctx.checkpoint.config_doc
    if not doc.nonstandard:
        return
    tokens = ", ".join(sorted(set(doc.nonstandard)))
    paths = nonfinite_paths(doc.data)
    where = f" at {', '.join(paths[:5])}" if paths else ""
    ctx.report("KV002", f"non-standard JSON token(s) {tokens}{where}: strict JSON parsers reject this file",
               path=paths[0] if paths else None)


@checker("schema")
def check_schema(ctx) -> None:
    spec = ctx.spec
    mt = spec.arch.model_type
    validator = validator_for(mt)
    seen: set[tuple[str, str]] = set()
    errors = sorted(validator.iter_errors(spec.config), key=lambda e: (dotted(e.absolute_path), e.validator))
    for err in errors:
        code, path, message = describe(err)
        if (code, path) in seen:
            continue
        seen.add((code, path))
        if len(seen) > _MAX_REPORTED:
            break
        full = spec.prefixed(path) if path else None
        if spec.wrapper_key and path:
            message = f"{spec.wrapper_key}.{message}"
        ctx.report(code, f"{message} (schemas/{schema_for(mt)[0]})", path=full)
