"""Peak memory of `kvtool quantize-kv --no-eval`: layer by layer against the whole model, same run.

Each case runs as a fresh process under /usr/bin/time (wall time, CPU time, peak RSS):
  floor       python importing torch / transformers / accelerate / kvtool's quantize-kv and tokenizing the
              calibration text (what any calibration pays before touching a weight)
  whole       quantize_kv(..., evaluate=False, layerwise=False): the whole model loaded with transformers,
              as quantize-kv did before layer-by-layer loading (same code path otherwise)
  layerwise   quantize_kv(..., evaluate=False): the default, one decoder layer's weights at a time
  cli         `kvtool quantize-kv SRC DST --calib-text F --no-eval` (the command as users run it; layerwise)
and prints peak RSS, peak above the floor, and that over the model's weight bytes (fp32, as calibration holds
them on the CPU). The scales written by the runs are compared (they must be identical).

    OMP_NUM_THREADS=1 python bench/quantize_kv_memory.py [--model DIR] [--calib-tokens 2048] [--repeat 1]
        [--observer absmax-pow2:2] [--deeper K]   # K: also a copy with every layer repeated K times

Default model: the SmolLM2-135M fixture (kvtool.testing.fixtures; ~540 MB of fp32 weights). Calibration
text: kvtool's built-in pydoc calibration part (kvtool.testing.text), as the other quantize-kv benches.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from convert_memory import add_common_args, deeper_copy, measure, model_sizes, models_of, report  # noqa: E402  (one measuring harness for both)

FLOOR = r'''
import sys, torch, transformers, accelerate, safetensors
import kvtool.quantize.run, kvtool.quantize.calibrate, kvtool.runtime.layerwise
from kvtool.quantize.run import tokenize_windows
from kvtool.runtime.torch_utils import load_tokenizer
tokenize_windows(load_tokenizer(sys.argv[1]), [open(sys.argv[2]).read()], int(sys.argv[3]), 512)
'''

RUN = r'''
import sys
from kvtool.quantize.run import QuantizeOptions, quantize_kv
src, dst, text, tokens, observer, layerwise = sys.argv[1:7]
quantize_kv(src, dst, QuantizeOptions(calib_texts=[text], calib_tokens=int(tokens), observer=observer,
                                      evaluate=False, device="cpu", force=True, layerwise=layerwise == "1"))
'''


def scales(folder: Path) -> dict:
    return json.loads((folder / "kvtool.json").read_text())["scales"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_common_args(ap)
    ap.add_argument("--observer", default="absmax-pow2:2")
    args = ap.parse_args(argv)
    env, models = models_of(args)
    from kvtool.testing.text import calibration_text

    work = Path(tempfile.mkdtemp(prefix="kvtool-bench-qmem-"))
    text = work / "calib.txt"
    text.write_text(calibration_text(), encoding="utf-8")
    try:
        if args.deeper > 1:
            models[f"x{args.deeper}"] = deeper_copy(models["x1"], work / "deeper-src", args.deeper)
        cases = {}
        for tag, src in models.items():
            run = [sys.executable, "-c", RUN, str(src)]
            tail = [str(text), str(args.calib_tokens), args.observer]
            if tag == "x1":
                cases[(tag, "floor")] = [sys.executable, "-c", FLOOR, str(src), str(text), str(args.calib_tokens)]
            cases[(tag, "whole")] = [*run, str(work / f"{tag}-whole"), *tail, "0"]
            cases[(tag, "layerwise")] = [*run, str(work / f"{tag}-layerwise"), *tail, "1"]
            cases[(tag, "cli")] = ["kvtool", "quantize-kv", str(src), str(work / f"{tag}-cli"),
                                   "--calib-text", str(text), "--calib-tokens", str(args.calib_tokens), "--observer", args.observer,
                                   "--no-eval", "--device", "cpu", "--force"]
        runs = measure(cases, env, args.repeat)
        same = {tag: scales(work / f"{tag}-whole") == scales(work / f"{tag}-layerwise") == scales(work / f"{tag}-cli")
                for tag in models}
        sizes = {tag: model_sizes(src, args.calib_tokens) for tag, src in models.items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report(cases, runs, sizes, f"model {models['x1'].name}, observer {args.observer}, {args.calib_tokens} calibration "
           f"tokens, repeat {args.repeat}, OMP_NUM_THREADS={env['OMP_NUM_THREADS']}",
           {tag: f"scales identical: {same[tag]}" for tag in models}, args.deeper if len(models) > 1 else None)
    if args.json:
        print(json.dumps({"sizes": sizes, "runs": {f"{t}/{c}": v for (t, c), v in runs.items()},
                          "scales_identical": same}, indent=2))
    return 0 if all(same.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
