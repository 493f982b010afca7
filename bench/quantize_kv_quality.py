"""quantize-kv observer sweep: PPL, KLD and paired standard errors on held-out text, one command.

    python bench/quantize_kv_quality.py smollm2 [--windows 8] [--observers absmax-pow2:2,attn-out,...]
    python bench/quantize_kv_quality.py gemma3 --windows 4
    python bench/quantize_kv_quality.py smollm2 --layers      # per layer / role: clipping, subnormals, cost
    python bench/quantize_kv_quality.py smollm2 --attention --windows 4 --window 512   # FP8 attention backends

Every observer is calibrated with kvtool's own `calibrate()` on the CLI's default calibration
(first 2048 tokens of the built-in pydoc calibration text, 512-token sequences), then scored on
held-out windows of 1024 tokens (BOS + 1023 text tokens when the tokenizer adds BOS, as
`kvtool eval` does). Window 0 is exactly the quality report's 1024-token text, so the "1 window"
table reproduces `kvtool quantize-kv`'s report; the larger table uses all windows.

Rows: the original model, FP8 with scale 1.0 (vLLM without scales), every observer, and
"floor": FP8 e4m3 rounding with an unbounded exponent (3 mantissa bits, no clipping, no
subnormals), the error every power-of-two scale reaches when nothing is clipped or subnormal.

Columns: PPL change vs the original with the *paired* standard error (tokens are scored on the
same text, so the SE is that of the per-token NLL difference, not of two independent PPLs), KLD
and its SE, top-1 agreement, and the difference to scale 1.0 (NLL and KLD, paired SE). Per-token
SEs treat tokens as independent; FP8 rounding makes the model a discontinuous function of its
inputs, so two scales with identical error statistics still give different per-token results
(see docs/quantize-kv.md): read differences smaller than ~2 SE as noise.

--layers: per layer and role on the held-out windows: fraction of values clipped (|x| > 448 s)
and subnormal (|x| < 2^-6 s, nonzero) with scale 1.0 and the default scales, relative RMS error,
and the KLD / NLL cost of quantizing that one layer's K or V alone (scale 1.0 and default) on
window 0 (one quantized tensor: no rounding downstream, so these are free of the effect above;
where the default's error equals scale 1.0's to 0.1% and neither clips, 1.0's cost is repeated).
"""

from __future__ import annotations

import argparse
import math
import time

DEFAULT_OBSERVERS = ("absmax:1", "absmax-pow2:1", "absmax-pow2:2", "absmax-pow2:4", "absmax-pow2:8", "mse",
                     "attn-out")
WINDOW = 1024
CALIB_TOKENS, CALIB_SEQ = 2048, 512  # the CLI defaults


def unbounded_e4m3(x):
    """x rounded to 3 mantissa bits (round to nearest even) with an unbounded exponent, in x's dtype."""
    import torch

    m, e = torch.frexp(x.float())  # x = m * 2^e, 0.5 <= |m| < 1
    return torch.ldexp(torch.round(m * 16) / 16, e).to(x.dtype)


def load(name: str):
    import torch

    from kvtool.testing.fixtures import gemma3_dir, smollm2_dir
    from kvtool.runtime.torch_utils import load_model, load_tokenizer

    src = smollm2_dir() if name == "smollm2" else gemma3_dir()
    tok = load_tokenizer(src)
    tok.model_max_length = 10**12
    model = load_model(src, device=torch.device("cpu"), dtype=torch.float32)
    return src, tok, model


def eval_windows(tok, n: int, text: str | None = None, window: int = WINDOW):
    """n windows of `window` tokens of the held-out text (or `text`); window 0 is the quality report's text."""
    import torch

    from kvtool.testing.text import evaluation_text

    ids = tok(evaluation_text() if text is None else text, add_special_tokens=True)["input_ids"]
    bos = ids[:1] if tok.bos_token_id is not None and ids[0] == tok.bos_token_id else []
    body = ids[len(bos):]
    step = window - len(bos)
    wins = [bos + body[k * step:(k + 1) * step] for k in range(n)]
    return [torch.tensor([w]) for w in wins if len(w) == window]


def calibrated(model, tok, observer: str, q_scales: bool = False):
    import torch

    from kvtool.quantize.calibrate import calibrate
    from kvtool.quantize.formats import FORMATS
    from kvtool.quantize.run import tokenize_windows
    from kvtool.testing.text import calibration_text

    batches, _ = tokenize_windows(tok, [calibration_text()], CALIB_TOKENS, CALIB_SEQ)
    return calibrate(model, batches, layers_path="model.layers", observer=observer, strategy="tensor",
                     fmt=FORMATS["e4m3"], device=torch.device("cpu"), num_kv_heads=model.config.num_key_value_heads,
                     q_scales=q_scales)


def score(model, wins, candidates: dict, log=print):
    """Per-token NLL of the original and every candidate, per-token KL and top-1 agreement."""
    import torch

    from kvtool.runtime.kv_hooks import kv_hook

    out = {"nll": {"original": []}, "kl": {}, "top1": {}}
    for c in candidates:
        out["nll"][c], out["kl"][c], out["top1"][c] = [], [], []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for wi, w in enumerate(wins):
            y = w[0, 1:, None]
            base = torch.log_softmax(model(input_ids=w, use_cache=False).logits[0, :-1].float(), -1)
            out["nll"]["original"].append(-base.gather(1, y)[:, 0].double())
            for c, fn in candidates.items():
                with kv_hook(model, fn):
                    lp = torch.log_softmax(model(input_ids=w, use_cache=False).logits[0, :-1].float(), -1)
                out["nll"][c].append(-lp.gather(1, y)[:, 0].double())
                out["kl"][c].append((base.exp() * (base - lp)).sum(-1).clamp_min(0).double())
                out["top1"][c].append((base.argmax(-1) == lp.argmax(-1)).double())
                del lp
            log(f"  window {wi + 1}/{len(wins)} scored ({time.perf_counter() - t0:.0f} s)")
    return {k: {c: torch.stack(v) for c, v in d.items()} for k, d in out.items()}


def _se(x) -> float:
    return float(x.std() / math.sqrt(x.numel())) if x.numel() > 1 else float("nan")


def table(res: dict, n_windows: int, ref: str = "fp8 scale 1.0", ref_label: str = "scale 1.0") -> str:
    nll, kl, t1 = res["nll"], res["kl"], res["top1"]
    o = nll["original"][:n_windows].reshape(-1)
    r_nll, r_kl = nll[ref][:n_windows].reshape(-1), kl[ref][:n_windows].reshape(-1)
    lines = [f"{o.numel()} held-out tokens ({n_windows} x {nll['original'].shape[1] + 1}-token windows); original PPL {math.exp(o.mean()):.4f}",
             f"| {'':27s} | {'PPL':>8s} | {'vs original (paired SE)':>23s} | {'KLD (SE)':>18s} | {'top-1':>6s} "
             f"| {'NLL vs ' + ref_label + ' (SE)':>21s} | {'KLD vs ' + ref_label + ' (SE)':>21s} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in kl:
        x = nll[c][:n_windows].reshape(-1)
        k = kl[c][:n_windows].reshape(-1)
        d = x - o
        dd, dk = x - r_nll, k - r_kl
        vs = ("" if c == ref else f"{100 * float(dd.mean()):+.2f}% ({100 * _se(dd):.2f})",
              "" if c == ref else f"{float(dk.mean()):+.5f} ({_se(dk):.5f})")
        vs_orig = f"{100 * (math.exp(d.mean()) - 1):+.2f}% ({100 * _se(d):.2f})"
        lines.append(f"| {c:27s} | {math.exp(x.mean()):8.4f} | {vs_orig:>23s} "
                     f"| {float(k.mean()):.5f} ({_se(k):.5f}) | {float(t1[c][:n_windows].mean()):6.4f} "
                     f"| {vs[0]:>21s} | {vs[1]:>21s} |")
    return "\n".join(lines)


def summary(res: dict, ref: str = "fp8 scale 1.0") -> str:
    """One row per candidate, window 0 and all windows side by side (docs/quantize-kv.md's table)."""
    nll, kl = res["nll"], res["kl"]
    sizes = sorted({1, nll["original"].shape[0]})
    head = " | ".join(f"{nll['original'][:n].numel()} tok: PPL vs original (SE) | KLD | NLL vs 1.0 (SE) | KLD vs 1.0 (SE)"
                      for n in sizes)
    lines = [f"| | {head} |", "| --- |" + " ---: |" * (4 * len(sizes))]
    for c in kl:
        cells = []
        for n in sizes:
            o = nll["original"][:n].reshape(-1)
            x, k = nll[c][:n].reshape(-1), kl[c][:n].reshape(-1)
            dd, dk = x - nll[ref][:n].reshape(-1), k - kl[ref][:n].reshape(-1)
            cells += [f"{100 * (math.exp((x - o).mean()) - 1):+.2f}% ({100 * _se(x - o):.2f})", f"{float(k.mean()):.5f}",
                      "" if c == ref else f"{100 * float(dd.mean()):+.2f}% ({100 * _se(dd):.2f})",
                      "" if c == ref else f"{float(dk.mean()):+.5f} ({_se(dk):.5f})"]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sweep(name: str, n_windows: int, observers: list[str], save: str | None) -> None:
    import torch

    from kvtool.eval.fp8 import KVScales

    _, tok, model = load(name)
    torch.manual_seed(0)
    wins = eval_windows(tok, n_windows)
    cands = {"fp8 scale 1.0": KVScales(source="one").hook(),
             "floor (unbounded exponent)": lambda layer, k, v: (unbounded_e4m3(k), unbounded_e4m3(v))}
    for obs in observers:
        t0 = time.perf_counter()
        r = calibrated(model, tok, obs)
        print(f"{name}: calibrated {obs} in {time.perf_counter() - t0:.1f} s", flush=True)
        for role in ("k", "v"):  # output-aware observers: what the search gained over the power of two
            gains = [float(e.min() / e[0]) for (_, rl), (_, e) in r.search.items() if rl == role and e[0] > 0]
            if gains:
                gains.sort()
                print(f"  {role}: chosen / power-of-two attention-output error over {len(gains)} layers: "
                      f"median {gains[len(gains) // 2]:.3f}, min {gains[0]:.3f}; power of two kept in "
                      f"{sum(g == 1.0 for g in gains)}", flush=True)
        cands[obs] = KVScales.from_mapping({i: (r.k[i], r.v[i]) for i in r.k}, source="calibrated").hook()
    res = score(model, wins, cands, log=lambda s: print(s, flush=True))
    if save:
        torch.save(res, save)
    print(f"\n{name}, calibration {CALIB_TOKENS} tokens in {CALIB_SEQ}-token sequences, CPU float32")
    for n in sorted({1, len(wins)}):
        print("\n" + table(res, n))
    print("\n" + summary(res))


def attention(name: str, n_windows: int, window: int, save: str | None) -> None:
    """FP8 attention as vLLM 0.33's backends compute it (kvtool.eval.fp8_backends): cache-only vs queries (and
    Triton's probabilities) in FP8, without scales (vLLM's 1.0), with calibrated K/V scales only (q falls back to
    1.0) and with calibrated q scales too; on held-out pydoc (the calibration text's genre) and the licences of
    /usr/share/common-licenses (another genre)."""
    import torch

    from kvtool.eval.fp8 import Fp8Attention, KVScales
    from kvtool.eval.fp8_backends import backend
    from kvtool.quantize.observers import DEFAULT_OBSERVER
    from other_texts import licenses_text

    _, tok, model = load(name)
    t0 = time.perf_counter()
    r = calibrated(model, tok, DEFAULT_OBSERVER, q_scales=True)
    print(f"{name}: calibrated {DEFAULT_OBSERVER} (K, V and q) in {time.perf_counter() - t0:.1f} s; q_scale "
          f"{min(float(t.max()) for t in r.q.values()):.4g}..{max(float(t.max()) for t in r.q.values()):.4g}, "
          f"q amax {max(float(t.max()) for t in r.q_amax.values()):.3g}", flush=True)
    kv = KVScales.from_mapping({i: (r.k[i], r.v[i]) for i in r.k}, source="calibrated")
    kvq = KVScales.from_mapping({i: (r.k[i], r.v[i], r.q[i]) for i in r.k}, source="calibrated")
    cands = {"cache-only, K/V calibrated": Fp8Attention(kv, backend("cache-only"))}
    for b in ("flash-attn", "triton"):  # q: vLLM's 1.0 without q scales, then calibrated
        cands[f"{b}, K/V calibrated, q 1.0"] = Fp8Attention(kv, backend(b))
        cands[f"{b}, K/V/q calibrated"] = Fp8Attention(kvq, backend(b))
    for label, text in (("pydoc held-out (calibration genre)", None), ("licences (another genre)", licenses_text())):
        wins = eval_windows(tok, n_windows, text, window)
        res = score(model, wins, cands, log=lambda s: print(s, flush=True))
        if save:
            torch.save(res, f"{save}.{'other' if text else 'same'}")
        print(f"\n{name}, {label}: {sum(w.numel() for w in wins)} tokens in {len(wins)} windows of {window}, CPU float32 "
              f"emulation; calibration {CALIB_TOKENS} pydoc tokens")
        print(table(res, len(wins), ref="cache-only, K/V calibrated", ref_label="cache-only"), flush=True)


def layers(name: str, n_windows: int, observer: str, costs: bool = True) -> None:
    import torch

    from kvtool.eval.fp8 import fp8_roundtrip
    from kvtool.runtime.kv_hooks import kv_hook

    _, tok, model = load(name)
    wins = eval_windows(tok, n_windows)
    r = calibrated(model, tok, observer)
    scales = {"one": {i: (1.0, 1.0) for i in r.k}, observer: {i: (float(r.k[i]), float(r.v[i])) for i in r.k}}
    stats: dict = {}

    def collect(layer, k, v):
        for ri, (role, x) in enumerate((("k", k), ("v", v))):
            d = stats.setdefault((layer, role), {"n": 0, "e2": 0.0, "amax": 0.0})
            d["n"] += x.numel()
            d["e2"] += float(x.double().pow(2).sum())
            d["amax"] = max(d["amax"], float(x.abs().max()))
            for label, table_ in scales.items():
                s = table_[layer][ri]
                y = x.abs() / s
                d[label, "clip"] = d.get((label, "clip"), 0) + int((y > 448).sum())
                d[label, "sub"] = d.get((label, "sub"), 0) + int(((y < 2 ** -6) & (y > 0)).sum())
                d[label, "err"] = d.get((label, "err"), 0.0) + float((fp8_roundtrip(x, s) - x).double().pow(2).sum())
            d["floor", "err"] = d.get(("floor", "err"), 0.0) + float((unbounded_e4m3(x) - x).double().pow(2).sum())
        return k, v

    with torch.inference_mode(), kv_hook(model, collect):
        for w in wins:
            model(input_ids=w, use_cache=False, logits_to_keep=1)

    # cost of one quantized tensor at a time, window 0
    w = wins[0]
    y = w[0, 1:, None]
    with torch.inference_mode():
        base = torch.log_softmax(model(input_ids=w, use_cache=False).logits[0, :-1].float(), -1)

    def one(layer: int, ri: int, s: float):
        def fn(lay, k, v):
            if lay != layer:
                return k, v
            return (fp8_roundtrip(k, s), v) if ri == 0 else (k, fp8_roundtrip(v, s))
        with torch.inference_mode(), kv_hook(model, fn):
            lp = torch.log_softmax(model(input_ids=w, use_cache=False).logits[0, :-1].float(), -1)
        return float((base.exp() * (base - lp)).sum(-1).mean()), float((base.gather(1, y) - lp.gather(1, y)).mean())

    print(f"{name}: {sum(x.numel() for x in wins)} held-out tokens; calibrated with {observer}; "
          f"one-tensor costs on window 0 ({w.numel()} tokens)")
    print("| layer | role | calib max | held-out max | clip % (1.0 / cal) | subnormal % (1.0 / cal) "
          "| rel. RMS error (1.0 / cal / floor) | alone: KLD (1.0 / cal) | alone: NLL % (1.0 / cal) |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for (layer, role), d in sorted(stats.items()):
        ri = 0 if role == "k" else 1
        cal_max = float((r.k_amax if ri == 0 else r.v_amax)[layer].max())
        e = {lab: math.sqrt(d[lab, "err"] / d["e2"]) for lab in ("one", observer, "floor")}
        if not costs:
            c1 = c2 = (float("nan"), float("nan"))
        else:
            c1 = one(layer, ri, 1.0)
        # where the calibrated scale rounds like 1.0 (same error to 0.1%: only subnormals differ), its cost is 1.0's
        same = abs(e[observer] - e["one"]) <= 1e-3 * e["one"] and d[observer, "clip"] == d["one", "clip"]
        if costs:
            c2 = c1 if same else one(layer, ri, scales[observer][layer][ri])
        print(f"| {layer} | {role} | {cal_max:.3f} | {d['amax']:.3f} "
              f"| {100 * d['one', 'clip'] / d['n']:.4f} / {100 * d[observer, 'clip'] / d['n']:.4f} "
              f"| {100 * d['one', 'sub'] / d['n']:.3f} / {100 * d[observer, 'sub'] / d['n']:.3f} "
              f"| {e['one']:.5f} / {e[observer]:.5f} / {e['floor']:.5f} "
              f"| {c1[0]:.6f} / {c2[0]:.6f} | {100 * c1[1]:+.3f} / {100 * c2[1]:+.3f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", choices=("smollm2", "gemma3"))
    ap.add_argument("--windows", type=int, default=8, help="held-out windows of 1024 tokens (default 8)")
    ap.add_argument("--observers", default=",".join(DEFAULT_OBSERVERS), help="comma-separated observer specs")
    ap.add_argument("--save", help="save the per-token results (torch.save) to this file")
    ap.add_argument("--load", help="print the tables of a file saved with --save (no model is run)")
    ap.add_argument("--layers", action="store_true", help="per-layer clipping / subnormal / cost table instead")
    ap.add_argument("--observer", default=None, help="--layers: the calibrated observer (default: kvtool's default)")
    ap.add_argument("--no-costs", action="store_true", help="--layers: skip the one-tensor KLD / NLL costs")
    ap.add_argument("--attention", action="store_true", help="FP8 attention backends instead (queries, probabilities)")
    ap.add_argument("--window", type=int, default=WINDOW, help="--attention: window length in tokens")
    a = ap.parse_args()
    import torch

    torch.set_num_threads(int(__import__("os").environ.get("OMP_NUM_THREADS", "1")))
    if a.load:
        res = torch.load(a.load)
        for n in sorted({1, res["nll"]["original"].shape[0]}):
            print(table(res, n) + "\n")
        print(summary(res))
        return None
    if a.attention:
        return attention(a.model, a.windows, a.window, a.save)
    if a.layers:
        from kvtool.quantize.observers import DEFAULT_OBSERVER

        return layers(a.model, a.windows, a.observer or DEFAULT_OBSERVER, costs=not a.no_costs)
    sweep(a.model, a.windows, [o for o in a.observers.split(",") if o], a.save)


if __name__ == "__main__":
    main()
