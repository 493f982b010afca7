"""KV2xx: every RoPE rule has a failing and a passing fixture; real configs lint without RoPE errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtool.rules.runner import lint_one
from kvtool.rules import load_all
from kvtool.rules.registry import RULES, LintOptions, Selection

DATA = Path(__file__).resolve().parents[1] / "data" / "rope"
RULE_FIXTURES = Path(__file__).resolve().parents[1] / "data" / "rules"  # <CODE>/fail*/ and pass*/ (build_rope.py)
OPTS = LintOptions(selection=Selection(select=("KV2",)))


def real(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def findings(tmp_path: Path, config: dict) -> list:
    p = tmp_path / "config.json"
    p.write_text(json.dumps(config, indent=2))
    rep = lint_one(str(p), OPTS)
    assert rep.error is None, rep.error
    return rep.findings


def codes(tmp_path: Path, config: dict) -> set[str]:
    return {f.code for f in findings(tmp_path, config)}


def llama(**kw) -> dict:
    cfg = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rope_theta": 10000.0}
    cfg.update(kw)
    return cfg


def _cases() -> list[tuple[str, str]]:
    return [(d.parent.name, d.name) for d in sorted(RULE_FIXTURES.glob("KV2*/*")) if d.is_dir()]


def test_every_rope_rule_has_fail_and_pass_fixtures():
    load_all()
    kinds: dict[str, set] = {}
    for code, case in _cases():
        kinds.setdefault(code, set()).add(case[:4])
    want = {c for c, r in RULES.items() if r.topic == "rope"}
    assert want == {c for c in RULES if c.startswith("KV2")}
    assert {c: k for c, k in kinds.items() if k != {"fail", "pass"}} == {}
    assert set(kinds) == want


@pytest.mark.parametrize("code,case", _cases(), ids=[f"{c}/{n}" for c, n in _cases()])
def test_rule_fixture(code, case):
    from dataclasses import replace

    from kvtool.engines.releases import resolve

    extra = RULE_FIXTURES / code / case / "kvtool-lint.json"  # the engine releases a fixture is about (KV213)
    engines = json.loads(extra.read_text()).get("engine", []) if extra.is_file() else []
    rep = lint_one(str(RULE_FIXTURES / code / case),
                   replace(OPTS, engines=resolve(engines, source="--engine")) if engines else OPTS)
    assert rep.error is None, rep.error
    hits = [f for f in rep.findings if f.code == code]
    assert "KV000" not in {f.code for f in rep.findings}
    if case.startswith("pass"):
        assert hits == [], [f.message for f in hits]
        return
    assert hits, (code, [(f.code, f.message) for f in rep.findings])
    for f in hits:  # a finding names the field and the values, and says how to fix it
        assert f.path and f.hint and f.severity == RULES[code].severity.value
        assert f.path.split(".")[-1].split("|")[0] in f.message or f.path.split(".")[0] in f.message


def test_gptj_error_names_the_field(tmp_path):
    (f,) = [f for f in findings(tmp_path, real("gpt-j-6b")) if f.severity == "error"]
    assert f.code == "KV201" and f.path == "rope_scaling.rope_type" and "'gptj'" in f.message


def test_wrapped_config_paths_are_prefixed(tmp_path):
    cfg = {"model_type": "llava", "text_config": llama(rope_scaling={"rope_type": "linear", "factor": 0.5})}
    (f,) = [f for f in findings(tmp_path, cfg) if f.code == "KV204"]
    assert f.path == "text_config.rope_scaling.factor"


def test_nested_rope_parameters_checked_per_layer_type(tmp_path):
    cfg = real("gemma-3-1b-it")
    cfg["rope_parameters"] = {"full_attention": {"rope_type": "linear", "factor": 0.5, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}
    cfg["rope_scaling"] = {"rope_type": "linear", "factor": 0.5}
    paths = {f.path for f in findings(tmp_path, cfg) if f.code == "KV204"}
    assert "rope_parameters.full_attention.factor" in paths
    assert not any(p.startswith("rope_parameters.sliding_attention") for p in paths)


@pytest.mark.parametrize("path", sorted(DATA.glob("*.json")), ids=lambda p: p.stem)
def test_real_configs_have_no_rope_errors_except_gptj(path, tmp_path):
    errs = [f for f in findings(tmp_path, json.loads(path.read_text())) if f.severity == "error"]
    if path.stem == "gpt-j-6b":
        assert [f.code for f in errs] == ["KV201"]
    else:
        assert errs == [], [(f.code, f.message) for f in errs]


def test_rope_rules_do_not_load_numpy():
    # lint's cold start matters (bench target < 0.3 s); the RoPE math is imported only by `kvtool rope`
    import subprocess
    import sys

    code = "import sys, kvtool.rules.rope; assert 'numpy' not in sys.modules, 'numpy loaded'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
