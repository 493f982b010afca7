"""`--format github`: one GitHub Actions workflow command per finding, escaped as the runner expects."""

from __future__ import annotations

from pathlib import Path

from kvtool.rules.runner import ModelReport, lint_one
from kvtool.output import render
from kvtool.output.github import render_github
from kvtool.rules.registry import Finding, LintOptions

CONFIGS = Path(__file__).resolve().parents[1] / "data" / "configs"


def test_one_annotation_per_finding_with_file_line_title(monkeypatch):
    monkeypatch.chdir(CONFIGS.parents[2])  # the repository root: paths come out relative
    rep = lint_one("tests/data/configs/gpt-j-6b.json", LintOptions())
    lines = render([rep], "github").splitlines()
    assert len(lines) == len(rep.findings)
    err = next(line for line in lines if "title=KV201" in line)
    assert err.startswith("::error file=tests/data/configs/gpt-j-6b.json,line=28,title=KV201::KV201 ")
    assert "\n" not in err and "%0Ahint: " in err


def test_severities_map_to_error_warning_notice():
    def f(code, sev):
        return Finding(code, "n", sev, "msg", None, None, "")
    out = render_github([ModelReport("m", findings=[f("KV201", "error"), f("KV002", "warning"), f("KV001", "info")])])
    assert [line.split(" ")[0].split("::")[1] for line in out.splitlines()] == ["error", "warning", "notice"]


def test_escaping():
    f = Finding("KV201", "rope-type-unknown", "error", "50% off, a: b\r\nnext", "rope_scaling", "dir,a:b/config.json",
                "", line=3)
    line = render_github([ModelReport("m", findings=[f])]).rstrip("\n")
    assert "file=dir%2Ca%3Ab/config.json,line=3,title=KV201::" in line
    # a value's CR LF is shown (as in text output), never a line break, even inside the annotation
    assert line.endswith("50%25 off, a: b\\r\\nnext (rope_scaling)")


def test_input_error_is_an_error_annotation():
    out = render_github([ModelReport("no/such", error="no/such: no such file or folder")])
    assert out == "::error title=kvtool::no/such: no/such: no such file or folder\n"


def test_no_findings_no_output():
    assert render_github([ModelReport("m")]) == ""
