"""`--format json`: one object {"models": [...]}, every finding with the documented keys."""

from __future__ import annotations

import json
from pathlib import Path

from kvtool.rules.runner import lint_one
from kvtool.output import render
from kvtool.rules.registry import LintOptions

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def test_json_shape():
    reps = [lint_one(str(CONFIGS / n), LintOptions()) for n in ("gpt-j-6b.json", "qwen3.5-27b.json")]
    doc = json.loads(render(reps, "json"))
    assert list(doc) == ["models"] and len(doc["models"]) == 2
    for m in doc["models"]:
        assert {"model", "findings", "kv_cache", "model_type"} <= set(m)
        for f in m["findings"]:
            assert {"code", "name", "severity", "message", "path", "file", "hint"} <= set(f)
    wrapped = doc["models"][1]
    assert any(f["path"] and f["path"].startswith("text_config.") for f in wrapped["findings"])
