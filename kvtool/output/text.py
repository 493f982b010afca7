"""Human output: `file:line: CODE [severity] message` lines, a hint, then a KV-cost line per model."""

from __future__ import annotations

from kvtool import console
from kvtool.units import fmt_bytes


def render_text(reports) -> console.Text:
    lines: list[str] = []
    for r in reports:
        if r.error:  # unusable input: `kvtool lint` prints it on stderr (error_line), not among the findings
            continue
        for f in r.findings:
            loc = f.file or r.model
            if f.line:
                loc += f":{f.line}"
            at = f" ({f.path})" if f.path else ""
            lines.append(f"{loc}: {f.code} [{f.severity}] {f.message}{at}")
            if f.hint:
                lines.append(f"    hint: {f.hint}")
        if r.kv:
            kv = r.kv
            seq = kv.get("bytes_per_max_len_sequence")
            tail = f", {fmt_bytes(seq)} per {kv['max_len']}-token sequence" if seq else ""
            # a dtype other than the config's: say it is vLLM's auto choice (the JSON output says why)
            dtype = f"{kv['dtype']}, vLLM --kv-cache-dtype auto" if kv.get("dtype_note") else kv["dtype"]
            lines.append(f"{r.model}: KV cache {fmt_bytes(kv['bytes_per_token'])}/token ({dtype}){tail}")
        counts = {s: sum(1 for f in r.findings if f.severity == s) for s in ("error", "warning", "info")}
        checked = f"; checked {r.checked()}" if getattr(r, "engines", None) else ""
        lines.append(f"{r.model}: {counts['error']} error(s), {counts['warning']} warning(s), {counts['info']} info"
                     f"{checked}")
    return console.lines(lines)


def error_line(report) -> str:
    """`kvtool: error: FILE: FIELD: message` for a model that could not be linted (kvtool's one error format)."""
    msg = report.error or ""
    where = "" if msg.startswith(report.model) else f"{report.model}: "
    return f"kvtool: error: {where}{msg}"
