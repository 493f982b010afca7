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
            # every quality figure with its standard error (tokens as independent samples: a lower bound)
            lines += ["", f"**eval** (step {s['index']}):", "", "| metric | value | SE |", "| --- | --- | --- |"]
            for k, se in (("baseline_ppl", "baseline_ppl_se"), ("ppl", "ppl_se"), ("ppl_ratio", "ppl_ratio_se"),
                          ("kld_mean", "kld_se"), ("top1_agreement", "top1_se"), ("tokens", None), ("device", None)):
                if k in m:
                    lines.append(f"| {k} | {_fmt(m[k])} | {_fmt(m[se]) if se and m.get(se) is not None else ''} |")
    return "\n".join(lines) + "\n"
