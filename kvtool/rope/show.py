"""Explain a RoPE setup: per-dimension wavelengths before / after, served context, and a plot.

A wavelength is the number of tokens one frequency pair takes to turn a full circle (2 pi / inv_freq).
Pairs whose wavelength exceeds the pre-training context never completed a turn in training: those
are the ones context extension must interpolate.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvtool import console
from kvtool.errors import UsageError
from kvtool.model.rope import types as rt
from kvtool.model.rope.freqs import wavelengths
from kvtool.model.rope.params import geometry_for, raw_dict, rope_dict


# Types whose frequencies depend on the sequence length (shown at the served length).
LENGTH_DEPENDENT = ("dynamic", "longrope")


@dataclass
class RopeState:
    label: str  # layer type
    params: dict  # flat rope dict
    dim: int | None
    max_position: int | None
    inv_freq: np.ndarray | None
    attention: float | None
    served: int | None  # vLLM's max_model_len
    reason: str = ""  # why frequencies are missing


def state_of(spec, layer_key: str, rp, params: dict | None = None, *, switches: frozenset = frozenset()) -> RopeState:
    """The state of one layer type; `params` overrides the dict (the planned one). `switches`: the vLLM
    release's max_model_len arithmetic (kvtool.engines.releases.vllm_max_len_switches)."""
    p = params if params is not None else {**raw_dict(spec, rp, layer_key), **rope_dict(rp, spec)}
    p = {k: v for k, v in p.items() if k != "type"}
    g = geometry_for(spec, rp)
    label = "full_attention" if layer_key == "default" else layer_key
    served = rt.served_context(p, spec.max_position, spec.model_type,
                               yarn_from_original="yarn_from_original" in switches)
    if g is None:
        return RopeState(label, p, None, spec.max_position, None, None, served, "rotary dimension unknown")
    g = rt.Geometry(dim=g.dim, theta=float(p.get("rope_theta", g.theta)), max_position_embeddings=spec.max_position,
                    head_dim=g.head_dim)
    try:
        if rt.validate(p, g):
            raise ValueError("invalid RoPE settings (see kvtool lint --select KV2)")
        # dynamic and longrope change with the sequence length: show them at the served length
        inv, att = rt.compute(p, g, seq_len=served)
    except (ValueError, KeyError, TypeError, ZeroDivisionError) as exc:
        return RopeState(label, p, g.dim, spec.max_position, None, None, served, str(exc))
    return RopeState(label, p, g.dim, spec.max_position, inv, att, served)


def current_states(spec, *, switches: frozenset = frozenset()) -> list[RopeState]:
    return [state_of(spec, key, rp, switches=switches) for key, rp in spec.rope.items()]


def _fmt_len(x: float) -> str:
    if not np.isfinite(x):
        return "inf"
    return f"{x:,.0f}" if x >= 1000 else f"{x:.1f}" if x >= 10 else f"{x:.2f}"


def _params_line(p: dict) -> str:
    parts = []
    for k in sorted(p):
        if k in ("rope_type", "rope_theta"):
            continue
        v = p[k]
        parts.append(f"{k}=[{len(v)} values]" if isinstance(v, list) and len(v) > 4 else f"{k}={v}")
    return ", ".join(parts)


def _rows(n: int, limit: int = 16) -> list[int]:
    if n <= limit:
        return list(range(n))
    return sorted(set(np.linspace(0, n - 1, limit).round().astype(int).tolist()))


def describe(before: RopeState, after: RopeState | None = None, *, original: int | None = None) -> str:
    """Text for one layer type: settings, context, and the wavelength table."""
    s = before if after is None else after
    lines = [f"[{s.label}]"]
    for tag, st in (("before", before), ("after", after)) if after is not None else (("", before),):
        head = f"  {tag + ': ' if tag else ''}{st.params.get('rope_type', 'default')} RoPE, theta {st.params.get('rope_theta'):g}"
        extra = _params_line(st.params)
        lines.append(head + (f", {extra}" if extra else ""))
        at = f", frequencies at {st.served} tokens" if rt.canonical(st.params.get("rope_type", "")) in LENGTH_DEPENDENT else ""
        lines.append(f"    rotary dims {st.dim}, attention scaling {st.attention:.4f}{at}" if st.attention is not None
                     else f"    rotary dims {st.dim}: frequencies not computed ({st.reason})")
        mpe = st.max_position
        served = st.served
        refusal = rt.vllm_refusal(st.params)
        if refusal is not None:
            ctx = f"    context: max_position_embeddings {mpe}; vLLM refuses this RoPE dict ({refusal})"
        else:
            ctx = f"    context: max_position_embeddings {mpe}, vLLM serves {served}"
            if served != mpe:
                ctx += " (differs!)"
        lines.append(ctx)
    if before.inv_freq is None or (after is not None and after.inv_freq is None):
        return console.lines(lines)
    orig = original or (before.params.get("original_max_position_embeddings") or before.max_position)
    wb = wavelengths(before.inv_freq)
    if orig:
        lines.append(f"  {int(np.sum(wb > orig))} of {len(wb)} frequency pairs turn less than once in "
                     f"{orig} tokens (they carry absolute position)")
    if after is None:
        lines.append("  pair  wavelength(tokens)")
        for i in _rows(len(wb)):
            lines.append(f"  {i:4d}  {_fmt_len(wb[i]):>18}")
    else:
        assert after.inv_freq is not None  # returned above otherwise
        wa = wavelengths(after.inv_freq)
        lines.append("  pair  before(tokens)    after(tokens)   stretch")
        for i in _rows(len(wb)):
            ratio = wa[i] / wb[i] if np.isfinite(wa[i]) and np.isfinite(wb[i]) else float("nan")
            lines.append(f"  {i:4d}  {_fmt_len(wb[i]):>14}  {_fmt_len(wa[i]):>15}  {ratio:8.3f}")
    return console.lines(lines)


def plot(out, before: RopeState, after: RopeState | None, title: str) -> None:
    """Wavelength against frequency pair, before and after, log scale, as PNG into `out` (an open binary file
    from kvtool.io.outputfile)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError("needs matplotlib: pip install 'kvtool[plot]'", option="plot") from None
    if before.inv_freq is None:
        raise UsageError(f"no frequencies to plot ({before.reason})", option="plot")
    fig, ax = plt.subplots(figsize=(7, 4))
    idx = np.arange(len(before.inv_freq))
    ax.semilogy(idx, wavelengths(before.inv_freq), label=f"before: {before.params.get('rope_type')}")
    if after is not None and after.inv_freq is not None:
        ax.semilogy(idx, wavelengths(after.inv_freq), label=f"after: {after.params.get('rope_type')}")
    orig = before.params.get("original_max_position_embeddings") or before.max_position
    if orig:
        ax.axhline(orig, color="grey", linestyle="--", linewidth=0.8, label=f"original context {orig}")
    ax.set_xlabel("frequency pair i (dims 2i, 2i+1)")
    ax.set_ylabel("wavelength (tokens)")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=100, format="png")
    finally:
        plt.close(fig)
