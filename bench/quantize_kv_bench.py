"""quantize-kv calibration against llm-compressor's FP8 KV-cache example, same model and text.

    PYTHONPATH=/path/to/llmcompressor python bench/quantize_kv_bench.py [--tokens 1024] [--seq-len 512]

Both calibrate SmolLM2-135M (kvtool's fixture) on the same token windows of the built-in pydoc
calibration text. kvtool: `calibrate()` with absmax:1 (the running maximum; the statistic of
llm-compressor's "static_minmax") and with the default observer. llm-compressor: `oneshot` with
the kv_cache_scheme of its examples/quantization_kv_cache (float 8-bit, tensor, static,
symmetric), once with its default observer ("minmax", an exponential moving average) and once
with "static_minmax". Prints wall times (ratio in the same run) and per-layer scale ratios.
llm-compressor is optional: without it only kvtool's side is measured.

The quality comparison of the observers (PPL, KLD, paired standard errors, the FP8 floor) is
bench/quantize_kv_quality.py.
"""

from __future__ import annotations

import argparse
import statistics
import time


def windows(tok, n_tokens: int, seq_len: int):
    import torch

    from kvtool.testing.text import calibration_text

    ids = tok(calibration_text(), add_special_tokens=False)["input_ids"][:n_tokens]
    return [torch.tensor([ids[i:i + seq_len]]) for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) == seq_len]


def kvtool_scales(src, wins, observer: str):
    import torch

    from kvtool.quantize.calibrate import calibrate
    from kvtool.quantize.formats import FORMATS
    from kvtool.runtime.torch_utils import load_model

    model = load_model(src, device=torch.device("cpu"), dtype=torch.float32)
    t0 = time.perf_counter()
    r = calibrate(model, wins, layers_path="model.layers", observer=observer, strategy="tensor",
                  fmt=FORMATS["e4m3"], device=torch.device("cpu"), num_kv_heads=model.config.num_key_value_heads)
    return time.perf_counter() - t0, {i: (float(r.k[i]), float(r.v[i])) for i in r.k}


def llmc_scales(src, wins, observer: str | None):
    import torch
    from compressed_tensors.quantization import QuantizationArgs
    from datasets import Dataset
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(src), dtype=torch.float32)
    ds = Dataset.from_dict({"input_ids": [w[0].tolist() for w in wins],
                            "attention_mask": [[1] * w.shape[1] for w in wins]})
    args = dict(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True)
    if observer:
        args["observer"] = observer
    recipe = QuantizationModifier(kv_cache_scheme=QuantizationArgs(**args))
    t0 = time.perf_counter()
    oneshot(model=model, dataset=ds, recipe=recipe, num_calibration_samples=len(wins),
            max_seq_length=wins[0].shape[1], pipeline="basic")
    seconds = time.perf_counter() - t0
    out = {}
    for m in model.modules():
        if hasattr(m, "k_scale") and hasattr(m, "v_scale") and isinstance(getattr(m, "layer_idx", None), int):
            out[m.layer_idx] = (float(m.k_scale.reshape(-1)[0]), float(m.v_scale.reshape(-1)[0]))
    return seconds, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()

    import torch

    from kvtool.quantize.observers import DEFAULT_OBSERVER
    from kvtool.testing.fixtures import smollm2_dir
    from kvtool.runtime.torch_utils import load_tokenizer

    torch.manual_seed(0)
    src = smollm2_dir()
    wins = windows(load_tokenizer(src), a.tokens, a.seq_len)
    print(f"SmolLM2-135M, {len(wins)} x {a.seq_len} tokens of pydoc calibration text, CPU, torch {torch.__version__}")
    rows = {}
    rows["kvtool absmax:1"] = kvtool_scales(src, wins, "absmax:1")
    rows[f"kvtool {DEFAULT_OBSERVER}"] = kvtool_scales(src, wins, DEFAULT_OBSERVER)
    try:
        import llmcompressor  # noqa: F401
    except ImportError as exc:
        print(f"llm-compressor not importable ({exc}); kvtool only")
    else:
        for obs in (None, "static_minmax"):
            label = f"llm-compressor {obs or 'minmax (default)'}"
            try:
                rows[label] = llmc_scales(src, wins, obs)
            except Exception as exc:  # noqa: BLE001 - report and go on: the comparison is optional
                print(f"{label}: failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    ref_label = "kvtool absmax:1"
    ref_t, ref = rows[ref_label]
    print(f"\n{'calibration':34s} {'seconds':>8s} {'x kvtool':>9s}  k_scale/ref (median, min..max)  v_scale/ref")
    for label, (sec, sc) in rows.items():
        common = sorted(set(sc) & set(ref))
        kr = [sc[i][0] / ref[i][0] for i in common]
        vr = [sc[i][1] / ref[i][1] for i in common]
        print(f"{label:34s} {sec:8.1f} {sec / ref_t:9.2f}  {statistics.median(kr):.4f} ({min(kr):.4f}..{max(kr):.4f})"
              f"  {statistics.median(vr):.4f} ({min(vr):.4f}..{max(vr):.4f})  [{len(common)} layers]")


if __name__ == "__main__":
    main()
