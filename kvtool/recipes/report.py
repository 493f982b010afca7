"""The run report of `kvtool apply` as a short markdown summary (the JSON is the full record)."""

from __future__ import annotations


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def render_markdown(report: dict) -> str:
    r = report["recipe"]
    lines = [f"# kvtool apply: {r['name']}", ""]
    if r.get("description"):
        lines += [r["description"], ""]
    lines += [f"- source: `{report['source']}`", f"- result: **{'passed' if report['passed'] else 'FAILED'}**",
              f"- started {report['started']}, finished {report.get('finished', '-')}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items() if v), "",
              "| # | step | settings | seconds | result |", "| --- | --- | --- | --- | --- |"]
    for s in report["steps"]:
        settings = ", ".join(f"{k}={_fmt(v)}" for k, v in s["settings"].items())
        lines.append(f"| {s['index']} | {s['kind']} | {settings} | {s['seconds']:.1f} | {'ok' if s['passed'] else 'FAILED'} |")
    for s in report["steps"]:
        d = s["details"]
        if s["kind"] == "lint":
            c = d.get("counts", {})
            lines += ["", f"**lint** (step {s['index']}): {c.get('error', 0)} error(s), {c.get('warning', 0)} warning(s), "
                      f"{c.get('info', 0)} info"]
            for f in d.get("findings", [])[:20]:
                lines.append(f"- `{f['code']}` {f['severity']}: {f['message']}")
        elif s["kind"] == "eval" and d.get("metrics"):
            m = d["metrics"]
            lines += ["", f"**eval** (step {s['index']}):", "", "| metric | value |", "| --- | --- |"]
            for k in ("baseline_ppl", "ppl", "ppl_ratio", "kld_mean", "top1_agreement", "tokens", "device"):
                if k in m:
                    lines.append(f"| {k} | {_fmt(m[k])} |")
    return "\n".join(lines) + "\n"
