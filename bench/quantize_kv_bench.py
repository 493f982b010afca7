"""quantize-kv calibration against llm-compressor's FP8 KV-cache example, same model and text.

    PYTHONPATH=/path/to/llmcompressor python bench/quantize_kv_bench.py [--tokens 1024] [--seq-len 512]
    python bench/quantize_kv_bench.py --quality smollm2|gemma3 [--tokens 2048] [--eval-windows 4]

Both calibrate SmolLM2-135M (kvtool's fixture) on the same token windows of the built-in pydoc
calibration text. kvtool: `calibrate()` with absmax:1 (the running maximum; the statistic of
llm-compressor's "static_minmax") and with the default observer. llm-compressor: `oneshot` with
the kv_cache_scheme of its examples/quantization_kv_cache (float 8-bit, tensor, static,
symmetric), once with its default observer ("minmax", an exponential moving average) and once
with "static_minmax". Prints wall times (ratio in the same run) and per-layer scale ratios.
llm-compressor is optional: without it only kvtool's side is measured.

--quality: the observer comparison of the README (quantize-kv section). One calibration keeps the
values (mse observer), so every absmax / absmax-pow2 variant is derived from the same observed
maxima; each variant is scored against the original on held-out 1024-token windows (PPL, KLD,
top-1), next to scale 1.0 and a few uniform scales.
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
    from kvtool.torch_utils import load_model

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


def quality(name: str, n_tokens: int, seq_len: int, eval_windows: int) -> None:
    import math

    import torch

    from kvtool.eval.fp8 import KVScales
    from kvtool.kv_hooks import kv_hook
    from kvtool.quantize.calibrate import calibrate
    from kvtool.quantize.formats import FORMATS
    from kvtool.quantize.run import tokenize_windows
    from kvtool.testing.fixtures import gemma3_dir, smollm2_dir
    from kvtool.testing.text import calibration_text, evaluation_text
    from kvtool.torch_utils import load_model, load_tokenizer

    src = smollm2_dir() if name == "smollm2" else gemma3_dir()
    tok = load_tokenizer(src)
    model = load_model(src, device=torch.device("cpu"), dtype=torch.float32)
    cal, _ = tokenize_windows(tok, [calibration_text()], n_tokens, seq_len)
    ev = tok(evaluation_text(), add_special_tokens=False)["input_ids"][:eval_windows * 1024]
    probe = tok("a")["input_ids"]
    bos = [tok.bos_token_id] if tok.bos_token_id is not None and probe[:1] == [tok.bos_token_id] else []
    wins = [torch.tensor([bos + ev[i:i + 1024]]) for i in range(0, len(ev), 1024)]

    def logps(fn):
        out = []
        with torch.inference_mode():
            for w in wins:
                with kv_hook(model, fn) if fn else torch.inference_mode():
                    out.append(torch.log_softmax(model(w).logits[0, :-1].float(), -1))
        return out

    base = logps(None)

    def row(label, lps):
        nll = torch.cat([-lp.gather(1, w[0, 1:, None])[:, 0] for w, lp in zip(wins, lps)])
        kl = torch.cat([(b.exp() * (b - lp)).sum(-1) for b, lp in zip(base, lps)])
        t1 = torch.cat([(b.argmax(-1) == lp.argmax(-1)).float() for b, lp in zip(base, lps)])
        print(f"{label:24s} ppl {math.exp(nll.mean()):.4f} kld {kl.mean():.5f} top1 {t1.mean():.4f}", flush=True)

    print(f"{name}: {sum(b.numel() for b in cal)} calibration tokens, {len(wins)} x 1024 held-out tokens")
    row("original", base)
    n = model.config.num_hidden_layers
    for s in (1.0, 0.5, 2.0, 1.1, 1.2, 1.4):
        row(f"uniform scale {s}", logps(KVScales.from_mapping({i: (s, s) for i in range(n)}).hook()))
    r = calibrate(model, cal, layers_path="model.layers", observer="mse", strategy="tensor", fmt=FORMATS["e4m3"],
                  device=torch.device("cpu"), num_kv_heads=model.config.num_key_value_heads)
    row("mse", logps(KVScales.from_mapping({i: (r.k[i], r.v[i]) for i in r.k}).hook()))

    def pow2(x):
        return torch.exp2(torch.ceil(torch.log2(x)))

    for h in (1, 2, 4):
        row(f"absmax:{h}", logps(KVScales.from_mapping(
            {i: (r.k_amax[i] * h / 448, r.v_amax[i] * h / 448) for i in r.k}).hook()))
        row(f"absmax-pow2:{h}", logps(KVScales.from_mapping(
            {i: (pow2(r.k_amax[i] * h / 448), pow2(r.v_amax[i] * h / 448)) for i in r.k}).hook()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--quality", choices=("smollm2", "gemma3"), help="run the observer comparison instead")
    ap.add_argument("--eval-windows", type=int, default=4)
    a = ap.parse_args()
    if a.quality:
        return quality(a.quality, a.tokens, a.seq_len, a.eval_windows)

    import torch

    from kvtool.quantize.observers import DEFAULT_OBSERVER
    from kvtool.testing.fixtures import smollm2_dir
    from kvtool.torch_utils import load_tokenizer

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
