"""Human-readable summary of a quantize-kv run."""

from __future__ import annotations


def _fmt_range(values) -> str:
    vals = [float(x) for t in values for x in t.reshape(-1)]
    return f"{min(vals):.4g} .. {max(vals):.4g}" if vals else "-"


def render(result) -> str:
    c = result.calibration
    lines = [
        f"wrote {result.dst}",
        f"  calibration: {c.tokens} tokens in {c.sequences} sequences, observer {c.observer}, strategy {c.strategy}, "
        f"{c.format}, {c.device}, {c.seconds:.1f} s"
        + (f", peak device memory {c.peak_device_bytes / 2**20:.0f} MiB" if c.peak_device_bytes else ""),
        f"  scales: {len(result.scale_tensors)} tensors in model-kv-scales.safetensors; "
        f"k_scale {_fmt_range(c.k.values())}, v_scale {_fmt_range(c.v.values())}",
        f"  source shards: {len(result.linked)} hard-linked, {len(result.copied)} copied (unchanged)",
        "  config.json: quantization_config.kv_cache_scheme (compressed-tensors); serve with vLLM --kv-cache-dtype fp8",
    ]
    for note in c.notes:
        lines.append(f"  note: {note}")
    if result.quality:
        r0 = result.quality[0]
        lines.append(f"quality on held-out text ({r0.text}, {r0.tokens} tokens, window {r0.window}, {r0.device}):")
        lines.append(f"  {'':44s} {'PPL':>9s} {'vs orig':>8s} {'KLD':>9s} {'top-1':>7s}")
        for r in result.quality:
            m = r.metrics
            ratio = m.get("ppl_ratio")
            lines.append(f"  {r.label:44s} {m['ppl']:9.4f} {(ratio - 1) * 100 if ratio else 0:+7.2f}% "
                         f"{m.get('kld_mean') or 0:9.5f} {m.get('top1_agreement') or 1:7.4f}")
    return "\n".join(lines) + "\n"
