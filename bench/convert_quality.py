"""Quality of K/V head merging without retraining: mean pooling vs `--method aware` (+ refinement, + distillation).

Prints one markdown table: model x target KV heads x method -> PPL ratio to the original (± standard
error), mean KLD and top-1 agreement against the original, on two held-out texts: the same source as the
default calibration (the evaluation part of kvtool's built-in pydoc text) and English prose of another genre
(`bench/other_texts.py`: Austen's *Persuasion* by default, never used for calibration or tuning; the licence
texts, `--other licenses` and `--other fortunes`, were the dev texts of issue 17), and conversion wall and CPU seconds.

    python bench/convert_quality.py [--calib-tokens N] [--refine-steps 64] [--distill-steps 48] \
        [--eval-tokens 4096] [--calib-dataset NAME] [--other persuasion|licenses|fortunes|luke|FILE] [--gqa-only]

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
    ap.add_argument("--calib-tokens", type=int, default=None, help="default: kvtool's (4096; 16384 when refining)")
    ap.add_argument("--refine-steps", type=int, default=64)
    ap.add_argument("--distill-steps", type=int, default=0,
                    help="also a row with refinement and this many --distill-steps (0: none)")
    ap.add_argument("--eval-tokens", type=int, default=4096)
    ap.add_argument("--calib-dataset", default=None, help="--calib-dataset of the aware conversions (default: kvtool's)")
    ap.add_argument("--other", default="persuasion", help="other-genre text: persuasion, licenses, fortunes, luke or a file")
    ap.add_argument("--gqa-only", action="store_true", help="only SmolLM2 3 -> 1 (the MHA cases are exact checks)")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--work", type=Path, default=None, help="folder for the converted models (default: temporary)")
    a = ap.parse_args()
    from kvtool.eval.api import evaluate_many
    from other_texts import write_texts

    work = a.work or Path(tempfile.mkdtemp(prefix="kvtool-quality-"))
    other = Path(a.other) if Path(a.other).is_file() else write_texts(work / "texts", [a.other])[a.other]
    texts = {"same source": None, "other genre": [other.read_text(encoding="utf-8")]}
    src = smollm2_dir()
    mha = work / "smollm2-mha"
    calib = ["--calib-tokens", str(a.calib_tokens)] if a.calib_tokens else []
    if a.calib_dataset:
        calib += ["--calib-dataset", a.calib_dataset]
    methods = [("mean", "mean", []), ("aware", "aware", calib)]
    if a.refine_steps:
        methods.append((f"aware+refine{a.refine_steps}", "aware", calib + ["--refine-steps", str(a.refine_steps)]))
    if a.distill_steps:
        methods.append((f"aware+refine{a.refine_steps}+distill{a.distill_steps}", "aware",
                        calib + ["--refine-steps", str(a.refine_steps), "--distill-steps", str(a.distill_steps)]))
    cases = [("SmolLM2-135M (GQA 3)", src, 1)]
    if not a.gqa_only:
        convert(src, mha, 9, "mean", [])  # exact expansion: every KV head repeated
        cases += [("SmolLM2-135M as MHA 9", mha, 3), ("SmolLM2-135M as MHA 9", mha, 1)]
    rows = []
    for label, model, to_kv in cases:
        outs = []
        for name, method, extra in methods:
            dst = work / f"{model.name}-{to_kv}-{name}"
            wall, cpu = convert(model, dst, to_kv, method, extra)
            outs.append((name, dst, wall, cpu))
        # the original (src) is the baseline for every case: the MHA expansion is the same function
        reports = {kind: evaluate_many([str(d) for _, d, _, _ in outs], baseline=str(src), texts=t,
                                       max_tokens=a.eval_tokens, max_length=a.window, device="auto")
                   for kind, t in texts.items()}
        for i, (name, _, wall, cpu) in enumerate(outs):
            rows.append((label, to_kv, name, {k: r[i] for k, r in reports.items()}, wall, cpu))
        base = {k: r[0] for k, r in reports.items()}
    same, oth = base["same source"], base["other genre"]
    print(f"\nsame source: {same.tokens} tokens of {same.text}, original PPL {same.baseline_ppl:.3f}; other genre: "
          f"{oth.tokens} tokens of {other.name}, original PPL {oth.baseline_ppl:.3f}; windows of {a.window}; "
          f"calibration: {a.calib_tokens or 'the default number of'} tokens of {a.calib_dataset or 'the default'}; "
          f"device {same.device}\n")
    print("| model | KV heads after | method | same source: PPL ratio | KLD | top-1 | other genre: PPL ratio | KLD | "
          "top-1 | convert wall s | convert CPU s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for label, to_kv, name, r, wall, cpu in rows:
        cells = [f"{m['ppl_ratio']:.3f} ± {m['ppl_ratio_se']:.3f} | {m['kld_mean']:.3f} ± {m['kld_se']:.3f} | "
                 f"{m['top1_agreement']:.3f} ± {m['top1_se']:.3f}" for m in (r[k].metrics for k in texts)]
        print(f"| {label} | {to_kv} | {name} | {' | '.join(cells)} | {wall:.1f} | {cpu:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
