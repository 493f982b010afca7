"""Human-readable summary of a quantize-kv run."""

from __future__ import annotations

from kvtool import console


def _fmt_range(values) -> str:
    vals = [float(x) for t in values for x in t.reshape(-1)]
    return f"{min(vals):.4g} .. {max(vals):.4g}" if vals else "-"


def render_plan(src, dst, calib_tokens: int, eval_tokens: int) -> console.Text:
    """--dry-run: what the run costs (kvtool.model.costs), before torch is imported."""
    from kvtool.model import costs

    shape = costs.for_checkpoint(src)
    report = f", quality report on {eval_tokens} tokens" if eval_tokens else ""
    return console.lines([
        f"kvtool quantize-kv plan: {src} -> {dst or '(dry run)'}",
        f"  calibration  {calib_tokens} tokens through {shape.layers} layers, one layer at a time{report}",
        f"  estimate     {costs.quantize_kv(shape, calib_tokens, eval_tokens).line()}"])


def serve_line(fmt) -> str:
    """How to serve the scales written for `fmt` (kvtool.quantize.formats.Fp8Format; None: e4m3)."""
    from kvtool.quantize.formats import FORMATS

    fmt = fmt or FORMATS["e4m3"]
    line = f"serve with vLLM --kv-cache-dtype {' or '.join(fmt.serves)}"
    if fmt.kind != "fp8":
        # vLLM 0.33 loads an unquantized model's KV scales only through compressed-tensors' kv_cache_scheme, which
        # accepts num_bits 8 type float only (CompressedTensorsKVCacheMethod.validate_kv_cache_scheme)
        line += (f" (given explicitly: the scheme can only say FP8; these are {fmt.name} global scales, "
                 f"amax / {fmt.max:g}, not FP8 ones)")
    return line


def render(result) -> console.Text:
    c = result.calibration
    lines = [
        f"wrote {result.dst}",
        f"  calibration: {c.tokens} tokens in {c.sequences} sequences, observer {c.observer}, strategy {c.strategy}, "
        f"{c.format}, {c.device}, {c.seconds:.1f} s"
        + (f", peak device memory {c.peak_device_bytes / 2**20:.0f} MiB" if c.peak_device_bytes else ""),
        f"  scales: {len(result.scale_tensors)} tensors in model-kv-scales.safetensors; "
        f"k_scale {_fmt_range(c.k.values())}, v_scale {_fmt_range(c.v.values())}"
        + (f", q_scale {_fmt_range(c.q.values())}" if getattr(c, "q", None) else ""),
        (f"  source shards: {len(result.linked)} hard-linked, {len(result.copied)} copied (unchanged)" if result.linked
         else f"  source shards: {len(result.copied)} copied (unchanged)"),
        "  config.json: quantization_config.kv_cache_scheme (compressed-tensors); " + serve_line(result.format),
    ]
    lines += [f"  {line}" for line in result.ignoring]
    for note in c.notes:
        lines.append(f"  note: {note}")
    if result.quality:
        r0 = result.quality[0]
        lines.append(f"quality on held-out text ({r0.text}, {r0.tokens} tokens, window {r0.window}, {r0.device}):")
        lines.append(f"  {'':44s} {'PPL':>9s} {'vs orig (SE)':>16s} {'KLD (SE)':>19s} {'top-1':>7s}")
        for r in result.quality:
            m = r.metrics
            ratio, se = m.get("ppl_ratio"), m.get("ppl_ratio_se")
            vs = f"{(ratio - 1) * 100:+.2f}% ({se * 100:.2f})" if ratio and se else f"{0:+.2f}%"
            kld = f"{m.get('kld_mean') or 0:.5f} ({m.get('kld_se') or 0:.5f})"
            lines.append(f"  {r.label:44s} {m['ppl']:9.4f} {vs:>16s} {kld:>19s} {m.get('top1_agreement') or 1:7.4f}")
        verdict = versus_scale_one(result.quality)
        if verdict:
            lines.append(f"  {verdict}")
    return console.lines(lines)


def versus_scale_one(rows) -> str | None:
    """One line: is the calibrated row worse than scale 1.0 on PPL or KLD beyond noise?

    The SE of a difference between two rows is taken as sqrt(se1^2 + se2^2) from their paired SEs
    against the original: an upper bound, since both rows share the original's tokens and most of
    their FP8 noise (the rows' per-token values are not kept to pair them directly)."""
    one = next((r for r in rows if r.label.endswith(" scale 1.0")), None)
    cal = next((r for r in rows if " calibrated (" in r.label), None)
    if one is None or cal is None:
        return None
    parts, worse = [], []
    for name, key, se_key, unit in (("PPL", "log_ppl_ratio", "log_ppl_ratio_se", 100.0), ("KLD", "kld_mean", "kld_se", 1.0)):
        a, b = cal.metrics.get(key), one.metrics.get(key)
        if a is None or b is None:
            return None
        se = (cal.metrics.get(se_key) or 0.0) ** 2 + (one.metrics.get(se_key) or 0.0) ** 2
        diff, se = a - b, se ** 0.5
        parts.append(f"{name} {diff * unit:+.{2 if unit > 1 else 5}f}{'%' if unit > 1 else ''} (SE {se * unit:.{2 if unit > 1 else 5}f})")
        if diff > 2 * se:
            worse.append(name)
    tail = (f"WORSE than scale 1.0 beyond noise on {' and '.join(worse)}" if worse
            else "not worse than scale 1.0 beyond noise (2 SE)")
    return "calibrated vs scale 1.0: " + ", ".join(parts) + f": {tail}"
