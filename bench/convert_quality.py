"""Quality of K/V head merging without retraining: mean pooling vs `--method aware` (+ refinement).

Prints one markdown table: model x target KV heads x method -> perplexity on held-out text, ratio to
the original, mean KLD and top-1 agreement against the original, conversion wall and CPU seconds.
Calibration uses the calibration part of kvtool's built-in text; evaluation the disjoint part.

    python bench/convert_quality.py [--calib-tokens 4096] [--refine-steps 64] [--eval-tokens 2048]

Cases: SmolLM2-135M 3 -> 1 KV heads (MQA); SmolLM2 expanded to MHA (9 KV heads, exact) and merged
back to 3 (the duplicate heads must be found again) and to 1.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import resource
import tempfile
import time
from pathlib import Path

from kvtool.cli import main as kvtool
from kvtool.testing.fixtures import smollm2_dir


def _cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def convert(src: Path, dst: Path, to_kv: int, method: str, extra: list[str]) -> tuple[float, float]:
    to = ["--to", "mqa"] if to_kv == 1 else ["--to", "gqa", "--groups", str(to_kv)]
    t0, c0 = time.perf_counter(), _cpu_seconds()
    with contextlib.redirect_stdout(io.StringIO()):
        rc = kvtool(["convert", str(src), str(dst), *to, "--method", method, "--no-eval", "--no-progress", "--force",
                     *extra])
    if rc != 0:
        raise SystemExit(f"convert {src} -> {dst} failed with exit code {rc}")
    return time.perf_counter() - t0, _cpu_seconds() - c0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--refine-steps", type=int, default=64)
    ap.add_argument("--eval-tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--work", type=Path, default=None, help="folder for the converted models (default: temporary)")
    a = ap.parse_args()
    from kvtool.eval.api import evaluate_many

    work = a.work or Path(tempfile.mkdtemp(prefix="kvtool-quality-"))
    src = smollm2_dir()
    mha = work / "smollm2-mha"
    convert(src, mha, 9, "mean", [])  # exact expansion: every KV head repeated
    calib = ["--calib-tokens", str(a.calib_tokens)]
    methods = [("mean", "mean", []), ("aware", "aware", calib)]
    if a.refine_steps:
        methods.append((f"aware+refine{a.refine_steps}", "aware", calib + ["--refine-steps", str(a.refine_steps)]))
    cases = [("SmolLM2-135M (GQA 3)", src, 1), ("SmolLM2-135M as MHA 9", mha, 3), ("SmolLM2-135M as MHA 9", mha, 1)]
    rows = []
    for label, model, to_kv in cases:
        outs = []
        for name, method, extra in methods:
            dst = work / f"{model.name}-{to_kv}-{name}"
            wall, cpu = convert(model, dst, to_kv, method, extra)
            outs.append((name, dst, wall, cpu))
        # the original (src) is the baseline for every case: the MHA expansion is the same function
        reports = evaluate_many([str(d) for _, d, _, _ in outs], baseline=str(src), max_tokens=a.eval_tokens,
                                max_length=a.window, device="auto")
        for (name, _, wall, cpu), r in zip(outs, reports):
            rows.append((label, to_kv, name, r, wall, cpu))
        base = reports[0]
    print(f"\nheld-out: {base.tokens} tokens of {base.text}, windows of {a.window}; calibration: {a.calib_tokens} "
          f"tokens; device {base.device}; original perplexity {base.baseline_ppl:.3f}\n")
    print("| model | KV heads after | method | PPL | PPL ratio | mean KLD | top-1 | convert wall s | convert CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, to_kv, name, r, wall, cpu in rows:
        print(f"| {label} | {to_kv} | {name} | {r.ppl:.2f} | {r.ppl_ratio:.3f} | {r.kld_mean:.4f} | "
              f"{r.top1_agreement:.3f} | {wall:.1f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
