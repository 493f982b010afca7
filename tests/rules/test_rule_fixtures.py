"""Every rule has a failing and a passing fixture: tests/data/rules/<CODE>/fail*/ and pass*/.

A fail fixture must produce its code; a pass fixture must not. A folder may hold kvtool-lint.json
with lint options (e.g. {"tensor_parallel_size": 4}, {"engine": ["transformers==4.42.4"]}: the engine releases
checked, as `--engine` gives them; without it, the newest releases kvtool knows, whatever is installed). Fixtures of the KV1xx, KV3xx-KV8xx rules are
written by tests/data/rules/build.py; the other rule owners add theirs in the same layout.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.engines.releases import ENGINES, newest, resolve
from kvtool.rules.runner import lint_one
from kvtool.rules import load_all
from kvtool.rules.registry import RULES, LintOptions

FIXTURES = Path(__file__).resolve().parents[1] / "data" / "rules"
# Rules without model-folder fixtures, and why: KV000 reports a kvtool bug (no input should trigger it);
# recipe rules (KV96x) lint recipe YAML files, not model folders, so this layout does not fit them.
EXEMPT_TOPICS = {"internal", "recipe"}


def _cases() -> list[tuple[str, str]]:
    out = []
    for code_dir in sorted(p for p in FIXTURES.iterdir() if p.is_dir() and p.name.startswith("KV")):
        for case in sorted(p for p in code_dir.iterdir() if p.is_dir()):
            if case.name.startswith(("fail", "pass")):
                out.append((code_dir.name, case.name))
    return out


def _lint(folder: Path):
    opts_file = folder / "kvtool-lint.json"
    opts = json.loads(opts_file.read_text()) if opts_file.is_file() else {}
    opts["engines"] = resolve(opts.pop("engine", []) or [f"{e}=={newest(e)}" for e in ENGINES], source="--engine")
    return lint_one(str(folder), LintOptions(**opts))


@pytest.mark.parametrize("code,case", _cases(), ids=[f"{c}/{n}" for c, n in _cases()])
def test_fixture(code: str, case: str) -> None:
    report = _lint(FIXTURES / code / case)
    assert report.error is None, report.error
    codes = [f.code for f in report.findings]
    assert "KV000" not in codes, [f.message for f in report.findings if f.code == "KV000"]
    if case.startswith("fail"):
        assert code in codes, f"{code}/{case} should report {code}; got {codes}"
    else:
        assert code not in codes, [f.message for f in report.findings if f.code == code]


def test_every_rule_has_fail_and_pass_fixtures() -> None:
    load_all()
    cases = _cases()
    missing = []
    for code, rule in sorted(RULES.items()):
        if rule.topic in EXEMPT_TOPICS:
            continue
        kinds = {n[:4] for c, n in cases if c == code}
        if kinds != {"fail", "pass"}:
            missing.append(f"{code} has {sorted(kinds) or 'no fixtures'}")
    assert not missing, missing


def test_fixture_folders_name_defined_rules() -> None:
    load_all()
    unknown = sorted({c for c, _ in _cases()} - set(RULES))
    assert not unknown, f"fixture folders for undefined codes: {unknown}"
