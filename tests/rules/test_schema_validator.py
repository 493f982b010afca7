"""kvtool.rules.jsonschema_subset agrees with jsonschema (the reference implementation) on kvtool's schemas."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from jsonschema import Draft202012Validator

from kvtool.model.architectures import schemas_dir
from kvtool.rules.jsonschema_subset import SchemaError, Validator

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_lint_property import mutated  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"
SCHEMAS = sorted(p for p in schemas_dir().glob("*.json") if p.name not in ("wrappers.json", "recipe.schema.json"))


def _key(e) -> tuple:
    return (tuple(e.absolute_path), e.validator, tuple(str(x) for x in e.absolute_schema_path))


def _both(schema: dict, instance) -> tuple[set, set]:
    ours = {_key(e) for e in Validator(schema).iter_errors(instance)}
    ref = {_key(e) for e in Draft202012Validator(schema).iter_errors(instance)}
    return ours, ref


@pytest.mark.parametrize("path", SCHEMAS, ids=lambda p: p.name)
def test_every_schema_compiles_with_supported_keywords_only(path):
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    Validator(schema)  # raises SchemaError on anything it does not implement


def test_unsupported_keywords_are_refused():
    with pytest.raises(SchemaError, match="pattern"):
        Validator({"properties": {"x": {"type": "string", "pattern": "^a"}}})
    with pytest.raises(SchemaError, match="reference"):
        Validator({"$ref": "https://example.org/other.json"})


def _schema_of(config: dict) -> dict:
    inner = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    mt = inner.get("model_type") if isinstance(inner.get("model_type"), str) else "generic"
    path = schemas_dir() / f"{mt}.json"
    return json.loads((path if path.is_file() else schemas_dir() / "generic.json").read_text())


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.json")), ids=lambda p: p.name)
def test_same_errors_on_real_configs(path):
    config = json.loads(path.read_text(), parse_constant=float)
    # its own schema (no errors) and gpt2's (a wrong model type for most: many errors)
    for schema in (_schema_of(config), json.loads((schemas_dir() / "gpt2.json").read_text())):
        ours, ref = _both(schema, config)
        assert ours == ref


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated())
def test_same_errors_on_mutated_configs(config):
    ours, ref = _both(_schema_of(config), config)
    assert ours == ref


@pytest.mark.parametrize("instance", [1, 1.0, True, None, "x", [], {}, float("inf"), float("nan"), -0.0, 2**70])
def test_type_semantics(instance):
    for t in ("integer", "number", "boolean", "null", "string", "array", "object"):
        schema = {"type": t, "minimum": 0}
        assert _both(schema, instance)[0] == _both(schema, instance)[1], (t, instance)
