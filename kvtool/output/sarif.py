"""`--format sarif`: SARIF 2.1.0, with the rule catalogue in tool.driver.rules (GitHub code scanning)."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote

from kvtool import console
from kvtool.io.locations import display_path

SARIF_SCHEMA = "https://json.schemastore.org/sarif-2.1.0.json"
LEVELS = {"error": "error", "warning": "warning", "info": "note"}
SRCROOT = "%SRCROOT%"


def _artifact(file: str) -> dict:
    shown = display_path(file) or file
    p = Path(shown)
    if p.is_absolute():
        return {"uri": p.as_uri()}
    return {"uri": quote(p.as_posix()), "uriBaseId": SRCROOT}


def _rules() -> list[dict]:
    from kvtool.rules import load_all
    from kvtool.rules.registry import RULES

    load_all()
    out = []
    for code in sorted(RULES):
        r = RULES[code]
        what = " ".join(r.doc.split()).split("Why it matters:")[0].replace("What it does:", "").strip()
        out.append({
            "id": r.code,
            "name": r.name,
            "shortDescription": {"text": r.summary},
            "fullDescription": {"text": what or r.summary},
            "help": {"text": r.doc or r.summary},
            "defaultConfiguration": {"level": LEVELS[r.severity.value]},
            "properties": {"tags": [r.topic] if r.topic else []},
        })
    return out


def _location(f) -> list[dict]:
    locs: list[dict] = []
    phys: dict = {}
    if f.file:
        phys["artifactLocation"] = _artifact(f.file)
        if f.line:
            phys["region"] = {"startLine": int(f.line)}
    loc: dict = {}
    if phys:
        loc["physicalLocation"] = phys
    if f.path:
        loc["logicalLocations"] = [{"fullyQualifiedName": f.path, "kind": "member"}]
    if loc:
        locs.append(loc)
    return locs


def render_sarif(reports) -> console.Text:
    from kvtool import __version__

    rules = _rules()
    index = {r["id"]: i for i, r in enumerate(rules)}
    results, notes = [], []
    for rep in reports:
        if rep.error:
            notes.append({"level": "error", "message": {"text": f"{rep.model}: {rep.error}"}})
            continue
        for f in rep.findings:
            text = f.message + (f" (hint: {f.hint})" if f.hint else "")
            res = {"ruleId": f.code, "level": LEVELS.get(f.severity, "note"), "message": {"text": text},
                   "locations": _location(f)}
            if f.code in index:
                res["ruleIndex"] = index[f.code]
            res["properties"] = {"model": rep.model}
            results.append(res)
    run = {
        "tool": {"driver": {"name": "kvtool", "version": __version__, "semanticVersion": __version__,
                            "rules": rules}},
        "originalUriBaseIds": {SRCROOT: {"uri": _working_folder_uri()}},
        "invocations": [{"executionSuccessful": not notes, "toolExecutionNotifications": notes}],
        "results": results,
    }
    return console.json_text({"$schema": SARIF_SCHEMA, "version": "2.1.0", "runs": [run]}, indent=2)


def _working_folder_uri() -> str:
    """SRCROOT: the working folder's file URI; the root where it was removed under the shell (findings in it are
    absolute then, kvtool.io.locations.display_path)."""
    try:
        return Path.cwd().as_uri() + "/"
    except OSError:
        return "file:///"
