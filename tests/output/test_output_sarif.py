"""`--format sarif` validates against the official SARIF 2.1.0 schema (tests/data/sarif/, OASIS)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from jsonschema import Draft4Validator

from kvtool.rules.runner import lint_one
from kvtool.output import render
from kvtool.rules import load_all
from kvtool.rules.registry import RULES, LintOptions

DATA = Path(__file__).resolve().parents[1] / "data"
SCHEMA = json.loads((DATA / "sarif" / "sarif-schema-2.1.0.json").read_text())
CONFIGS = DATA / "configs"


def _reports(*names: str):
    return [lint_one(str(CONFIGS / n) if not n.startswith("/") else n, LintOptions()) for n in names]


def _sarif(reports) -> dict:
    doc = json.loads(render(reports, "sarif"))
    errors = sorted(Draft4Validator(SCHEMA).iter_errors(doc), key=lambda e: list(e.absolute_path))
    assert not errors, [f"{list(e.absolute_path)}: {e.message}" for e in errors[:5]]
    return doc


def test_schema_file_is_the_sarif_2_1_0_schema():
    Draft4Validator.check_schema(SCHEMA)
    assert SCHEMA["properties"]["version"]["enum"] == ["2.1.0"]


def test_findings_of_every_severity_validate():
    doc = _sarif(_reports("gpt-j-6b.json", "nemotron-h-56b-base-8k.json", "qwen3-vl-8b-instruct.json"))
    run = doc["runs"][0]
    levels = {r["level"] for r in run["results"]}
    assert levels == {"error", "warning", "note"}
    by_rule = {r["ruleId"]: r for r in run["results"]}
    kv201 = by_rule["KV201"]
    loc = kv201["locations"][0]
    assert loc["physicalLocation"]["artifactLocation"]["uri"].endswith("gpt-j-6b.json")
    assert loc["physicalLocation"]["region"]["startLine"] == 28  # the rope_scaling line
    assert loc["logicalLocations"][0]["fullyQualifiedName"].startswith("rope_scaling")
    rules = run["tool"]["driver"]["rules"]
    assert rules[kv201["ruleIndex"]]["id"] == "KV201"


def test_rules_list_is_the_whole_registry():
    load_all()
    doc = _sarif([])
    rules = doc["runs"][0]["tool"]["driver"]["rules"]
    assert [r["id"] for r in rules] == sorted(RULES)
    level = {"error": "error", "warning": "warning", "info": "note"}
    for r in rules:
        rule = RULES[r["id"]]
        assert r["name"] == rule.name
        assert r["shortDescription"]["text"] == rule.summary
        assert r["fullDescription"]["text"] and r["help"]["text"]
        assert r["defaultConfiguration"]["level"] == level[rule.severity.value]
    assert doc["runs"][0]["results"] == []


def test_unreadable_input_is_a_tool_notification(tmp_path):
    doc = _sarif(_reports(str(tmp_path / "missing")))
    inv = doc["runs"][0]["invocations"][0]
    assert inv["executionSuccessful"] is False
    assert "missing" in inv["toolExecutionNotifications"][0]["message"]["text"]


def test_paths_outside_the_working_directory_are_file_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    doc = _sarif(_reports("gpt-j-6b.json"))
    uri = doc["runs"][0]["results"][0]["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert uri.startswith("file:///")


@pytest.mark.parametrize("name", ["glm-5.2.json", "kimi-k2.5.json", "baichuan2-7b-chat.json"])
def test_more_real_configs_validate(name):
    _sarif(_reports(name))
