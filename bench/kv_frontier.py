"""The measured KV frontier of docs/kv-frontier.md: `kvtool eval --kv-sweep` on SmolLM2-135M and Gemma-3-270M,
on pydoc (kvtool's built-in evaluation text) and on a held-out text of another genre.

The held-out text is the GNU GPL version 3 as Debian ships it (/usr/share/common-licenses/GPL-3, base-files,
on every Debian system; legal prose, ~8k tokens), never used by kvtool for calibration. Each run is a child
`kvtool eval MODEL --kv-sweep --format json --plot ...` (the command as a user runs it); --candidate folders are
passed through for SmolLM2 (conversions on the same frontier: issue 41 item 6).

    nice -n 10 python bench/kv_frontier.py --max-tokens 2048            # writes bench/kv_frontier.json, plots
    python bench/kv_frontier.py --markdown                              # the tables of docs/kv-frontier.md
    python bench/kv_frontier.py --replot                                # its plots again, from the JSON
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "bench" / "kv_frontier.json"
HELD_OUT = Path("/usr/share/common-licenses/GPL-3")
TEXTS = {"pydoc": None, "gpl3": HELD_OUT}


def _models() -> dict[str, Path]:
    from kvtool.testing.fixtures import gemma3_dir, smollm2_dir

    return {"smollm2": smollm2_dir(), "gemma3": gemma3_dir()}


def run(models: list[str], texts: list[str], max_tokens: int, max_length: int, candidates: list[str]) -> dict:
    results: dict = {}
    paths = _models()
    for model in models:
        for text in texts:
            cmd = [sys.executable, "-m", "kvtool", "eval", str(paths[model]), "--kv-sweep", "--format", "json",
                   "--max-tokens", str(max_tokens), "--max-length", str(max_length), "--progress",
                   "--plot", str(ROOT / "docs" / f"kv-frontier-{model}-{text}.png")]
            if TEXTS[text] is not None:
                cmd += ["--text", str(TEXTS[text])]
            if model == "smollm2":
                for c in candidates:
                    cmd += ["--candidate", c]
            print(f"== {model} on {text}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
            out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                                 env=dict(os.environ, PYTHONPATH=str(ROOT)))
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            results = json.loads(OUT.read_text()) if OUT.is_file() else {}  # another run may have written
            results[f"{model}/{text}"] = json.loads(out.stdout)
            OUT.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")  # a bench artefact, not kvtool's
    return results


def markdown(results: dict) -> str:
    lines = []
    for key, r in results.items():
        lines += [f"**{key}** ({r['tokens']} tokens, windows of {r['window']}, {r['dtype']} on {r['device']}; "
                  f"recommended: `{r['recommended']}`)", "",
                  "| option | KV B/token | PPL ratio ± SE | KLD ± SE (nats/token) | top-1 | frontier | gate |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- |"]
        for o in r["options"]:
            m = o["metrics"]
            front = "/".join(k for k, on in (("PPL", o["frontier"]["ppl_ratio"]), ("KLD", o["frontier"]["kld"])) if on)
            alias = f" (= {', '.join(o['same_as'])})" if o["same_as"] else ""
            lines.append(f"| {o['label']}{alias} | {o['kv_bytes_per_token']:,.0f} | {m['ppl_ratio']:.4f} ± "
                         f"{m['ppl_ratio_se']:.4f} | {m['kld_mean']:.5f} ± {m['kld_se']:.5f} | "
                         f"{m['top1_agreement']:.4f} | {front or '-'} | {'ok' if o['passed'] else 'FAILED'} |")
        verdicts = r.get("conversions", [])
        for v in verdicts:
            if v["rival"] is not None:
                lines.append(f"\n{v['option']}: {'beats' if v['beats_dtypes'] else 'does not beat'} the dtypes at "
                             f"no more bytes (best: {v['rival']})")
        smaller = [v["option"] for v in verdicts if v["rival"] is None]
        if smaller:
            lines.append(f"\nNo dtype of the model is as small as: {', '.join(smaller)}")
        lines.append("")
    return "\n".join(lines)


def replot(results: dict) -> None:
    """Redraw docs/kv-frontier-MODEL-TEXT.png from the JSON with kvtool's plot writer (after a change to the plot,
    without re-running the sweeps): each option and the report rebuilt from its as_dict()."""
    from types import SimpleNamespace

    from kvtool.eval.sweep_plot import write_plot

    for key, r in results.items():
        opts = [SimpleNamespace(model=o["model"], label=o["label"], bytes_per_token=o["kv_bytes_per_token"],
                                candidate=o["candidate"], metrics=o["metrics"], gates=o["gates"], passed=o["passed"],
                                frontier_ppl=o["frontier"]["ppl_ratio"], frontier_kld=o["frontier"]["kld"])
                for o in r["options"]]
        rec = next((o for o in opts if o.label == r["recommended"]), None)
        model, text = key.split("/")
        report = SimpleNamespace(model=r["model"], text=r["text"], tokens=r["tokens"], options=opts, recommended=rec)
        target = ROOT / "docs" / f"kv-frontier-{model}-{text}.png"
        target.unlink(missing_ok=True)  # the writer refuses to overwrite a file
        write_plot(report, str(target))
        print(f"wrote {target.relative_to(ROOT)}", file=sys.stderr)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["smollm2", "gemma3"])
    ap.add_argument("--texts", nargs="+", default=list(TEXTS), choices=list(TEXTS))
    ap.add_argument("--max-tokens", type=int, default=2048)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--candidate", action="append", default=[], help="a converted SmolLM2 (repeatable)")
    ap.add_argument("--markdown", action="store_true", help="print the tables of bench/kv_frontier.json")
    ap.add_argument("--replot", action="store_true", help="redraw the docs' plots from bench/kv_frontier.json")
    args = ap.parse_args()
    if args.replot:
        replot(json.loads(OUT.read_text()))
        return
    if args.markdown:
        print(markdown(json.loads(OUT.read_text())))
        return
    run(args.models, args.texts, args.max_tokens, args.max_length, args.candidate)


if __name__ == "__main__":
    main()
