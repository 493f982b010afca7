"""kv-budget output: a readable text report and a stable JSON object (sorted keys)."""

from __future__ import annotations

from kvtool import console
from kvtool.budget.budget import Budget, Figures, LayerRow
from kvtool.units import fmt_bytes

GIB = 2**30
POSITION_NAMES = {"rope": "RoPE", "alibi": "ALiBi", "learned": "learned", "none": "none in attention"}


# --- JSON ------------------------------------------------------------------------------------
def _layer_dict(r: LayerRow) -> dict:
    lay = r.layer
    return {
        "index": lay.index, "layer_type": lay.layer_type, "kind": lay.kind, "group_size": lay.group_size,
        "kv_heads": lay.kv_heads, "kv_heads_per_gpu": r.per_gpu.kv_heads, "head_dim": lay.head_dim,
        "window": lay.window, "bytes_per_token": r.bytes_per_token,
        "bytes_per_token_per_gpu": r.bytes_per_token_per_gpu, "tokens_allocated": r.tokens_allocated,
        "bytes_per_sequence": r.bytes_per_sequence, "bytes_per_sequence_per_gpu": r.bytes_per_sequence_per_gpu,
    }


def _figures_dict(f: Figures, current: Figures | None) -> dict:
    d = {
        "name": f.name, "kv_heads": _kv_heads(f), "kv_cache_dtype": f.kv_dtype, "kv_bytes_per_element": f.elem_bytes,
        "kv_bytes_per_token": f.kv_bytes_per_token, "kv_bytes_per_token_per_gpu": f.kv_bytes_per_token_per_gpu,
        "kv_bytes_per_sequence": f.kv_bytes_per_sequence,
        "kv_bytes_per_sequence_per_gpu": f.kv_bytes_per_sequence_per_gpu,
        "kv_bytes_total": f.kv_bytes_total, "kv_bytes_total_per_gpu": f.kv_bytes_total_per_gpu,
        "max_concurrency": f.max_concurrency, "max_concurrent_sequences": f.max_concurrent_sequences,
        "kv_pool_tokens": f.kv_pool_tokens, "tensor_parallel_refusal": f.tp_refusal,
        "padding_layers": [{"layer_type": p.layer_type, "count": p.count, "bytes_per_sequence": p.bytes_per_sequence,
                            "bytes_per_sequence_per_gpu": p.bytes_per_sequence_per_gpu} for p in f.padding],
        "attention_block_size": f.block_size, "recurrent_state": _state_dict(f),
        "aux_caches": [{"id": a.cache.id, "what": a.cache.what, "layers": list(a.cache.layers),
                        "bytes_per_token_per_layer": a.cache.bytes_per_token, "replicated": a.cache.replicated,
                        "bytes_per_token": a.bytes_per_token, "bytes_per_sequence": a.bytes_per_sequence,
                        "bytes_per_sequence_per_gpu": a.bytes_per_sequence_per_gpu} for a in f.aux],
    }
    if current is not None:
        d["saving_vs_current"] = _saving(f, current)
    return d


def _state_dict(f: Figures) -> dict | None:
    """Mamba / linear-attention state (kvtool.budget.recurrent), included in kv_bytes_per_sequence."""
    st = f.state
    if st is None:
        return None
    lay = st.layout
    return {"kind": lay.kind, "layers": st.layers, "conv_elements_per_gpu": lay.conv_elements,
            "ssm_elements_per_gpu": lay.ssm_elements, "conv_bytes_per_element": lay.conv_bytes,
            "ssm_bytes_per_element": lay.ssm_bytes, "ssm_dtype": lay.ssm_dtype,
            "page_bytes_per_gpu": lay.page_bytes, "padded_page_bytes_per_gpu": st.page_bytes_per_gpu,
            "bytes_per_sequence": st.bytes_per_sequence, "bytes_per_sequence_per_gpu": st.bytes_per_sequence_per_gpu}


def _kv_heads(f: Figures) -> int | None:
    """KV heads of the (first) KV-caching layer; None for MLA or a model without KV layers."""
    kv = [r.layer for r in f.layers if r.layer.kind not in ("none", "MLA")]
    return kv[0].kv_heads if kv else None


def _saving(f: Figures, current: Figures) -> float | None:
    """Fraction of the current per-GPU KV bytes a variant saves (negative: it costs more).

    Per GPU, because that is what decides the fit: under tensor parallelism a replicated KV head
    saves less than the head count suggests."""
    if not current.kv_bytes_per_sequence_per_gpu:
        return None
    return 1 - f.kv_bytes_per_sequence_per_gpu / current.kv_bytes_per_sequence_per_gpu


def as_dict(b: Budget) -> dict:
    o = b.options
    cur = b.current
    d = _figures_dict(cur, None)
    d.pop("name")
    d.update({
        "model": b.model, "model_type": b.model_type, "position_encoding": b.position,
        "max_model_len": b.max_model_len, "max_model_len_source": b.max_model_len_source,
        "batch": o.batch, "block_size": o.block_size, "max_num_batched_tokens": b.batched_tokens,
        "max_num_seqs_default": b.batch_defaults.max_num_seqs, "entrypoint": o.entrypoint,
        "tensor_parallel_size": o.tensor_parallel_size, "platform": o.platform,
        "cpu_kvcache_bytes": o.cpu_kvcache_bytes,
        "weight_bytes": b.weight_bytes, "weight_bytes_per_gpu": b.weight_bytes_per_gpu,
        "weight_source": b.weight_source, "weight_params_estimate": b.weight_params,
        "gpu": None if o.gpu is None else {
            "name": o.gpu.name, "memory_bytes": o.gpu.memory_bytes, "memory_basis": o.gpu.basis,
            "gpu_memory_utilization": o.gpu_memory_utilization, "reserve_bytes": o.reserve_bytes,
            "kv_budget_bytes": b.kv_budget_per_gpu,
        },
        "kv_pool_bytes_per_gpu": b.kv_pool_per_gpu, "weights_fit": b.weights_fit,
        "fits": not b.problems if (o.gpu is not None or o.cpu_kvcache_bytes) else None,
        "problems": b.problems,
        "layers": [_layer_dict(r) for r in cur.layers],
        "what_if": [_figures_dict(v, cur) for v in b.variants],
        "notes": b.notes,
    })
    return d


def render_json(b: Budget) -> console.Text:
    return console.json_text(as_dict(b), indent=2, sort_keys=True)


# --- text ------------------------------------------------------------------------------------
def _ranges(idx: list[int]) -> str:
    out, start, prev = [], None, None
    for i in idx + [None]:
        if start is None:
            start = prev = i
        elif i is not None and prev is not None and i == prev + 1:
            prev = i
        else:
            out.append(f"{start}" if start == prev else f"{start}-{prev}")
            start = prev = i
    text = ",".join(out)
    return text if len(text) <= 24 else text[:21] + "..."


def _kind(r: LayerRow) -> str:
    lay = r.layer
    if lay.kind == "GQA" and lay.group_size:
        return f"GQA group {lay.group_size}"
    if lay.kind == "none":
        return "no KV cache"
    return lay.kind


def _layer_groups(f: Figures, tp: int) -> list[list[str]]:
    groups: dict[tuple, list[int]] = {}
    rows: dict[tuple, LayerRow] = {}
    for r in f.layers:
        key = (r.layer.layer_type, r.layer.kind, r.layer.kv_heads, r.per_gpu.kv_heads, r.layer.head_dim,
               r.layer.window, r.tokens_allocated)
        groups.setdefault(key, []).append(r.layer.index)
        rows.setdefault(key, r)
    table = []
    for key, idx in groups.items():
        r = rows[key]
        if r.layer.kind in ("none", "MLA"):
            heads = {"none": "-", "MLA": "latent"}[r.layer.kind]
        else:
            heads = str(r.layer.kv_heads) if tp == 1 else f"{r.layer.kv_heads} ({r.per_gpu.kv_heads}/GPU)"
        table.append([
            _ranges(idx), str(len(idx)), r.layer.layer_type, _kind(r), heads,
            "-" if not r.layer.head_dim else str(r.layer.head_dim),
            "-" if r.layer.window is None else f"{r.layer.window:,}",
            f"{r.bytes_per_token_per_gpu:,.0f}", f"{r.tokens_allocated:,}",
            fmt_bytes(r.bytes_per_sequence_per_gpu * len(idx)),
        ])
    if f.state is not None:
        st = f.state
        t = next(r.layer.layer_type for r in f.layers if r.layer.kind == "none" and r.layer.layer_type in
                 ("mamba", "linear_attention"))
        table.append(["state", str(st.layers), t, f"{st.layout.kind} state", "", "", "", "", "1 page",
                      fmt_bytes(st.bytes_per_sequence_per_gpu)])
    for a in f.aux:
        held = f.layers[a.cache.layers[0]].tokens_allocated if a.cache.layers else 0
        table.append([_ranges(list(a.cache.layers)), str(len(a.cache.layers)), a.cache.id, "beside K/V", "", "", "",
                      f"{a.cache.bytes_per_token:,}", f"{held:,}", fmt_bytes(a.bytes_per_sequence_per_gpu)])
    for p in f.padding:
        table.append(["padding", str(p.count), p.layer_type, "vLLM group pad", "", "", "", "", "",
                      fmt_bytes(p.bytes_per_sequence_per_gpu)])
    return table


def _table(header: list[str], rows: list[list[str]], right: set[int]) -> list[str]:
    widths = [max(len(header[i]), *(len(r[i]) for r in rows)) for i in range(len(header))]

    def line(cells):
        return "  ".join(c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return [line(header)] + [line(r) for r in rows]


def _heads_label(f: Figures) -> str:
    if any(r.layer.kind == "MLA" for r in f.layers):
        return "MLA"
    heads = _kv_heads(f)
    return "-" if heads is None else str(heads)


def _pct(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{-x * 100:+.1f}%"


def _scaled(f: Figures) -> str:
    """What the bytes per element hold beyond the values: the format's scales or packing, or unquantized layers."""
    fmt = f.cache
    if fmt is None or (fmt.dtype.layout == "dense" and not fmt.skip):
        return ""
    return ", scales included" if not fmt.skip else ", scales and unquantized boundary layers included"


def render_text(b: Budget) -> console.Text:
    o, cur = b.options, b.current
    tp = o.tensor_parallel_size
    per = f" per GPU (TP {tp})" if tp > 1 else ""
    lines = [f"{b.model}  ({b.model_type or 'unknown model_type'}, positions: {POSITION_NAMES.get(b.position, b.position)})"]
    block = (f"{o.block_size}" if cur.block_size == o.block_size else
             f"{cur.block_size} (vLLM's for this hybrid; --block-size {o.block_size})")
    lines.append(f"  KV cache dtype   {cur.kv_dtype} ({cur.elem_bytes:.4g} B/element{_scaled(cur)}), block size {block}, "
                 f"max_model_len {b.max_model_len:,} ({b.max_model_len_source})")
    lines.append("")
    lines.extend("  " + s for s in _table(
        ["layers", "n", "type", "attention", "KV heads", "head_dim", "window", f"B/token{'/GPU' if tp > 1 else ''}",
         "tokens held", "per sequence"],
        _layer_groups(cur, tp), right={1, 7, 8, 9}))
    lines.append("")
    kv = [("KV per token", f"{fmt_bytes(cur.kv_bytes_per_token)} ({cur.kv_bytes_per_token:,.0f} B)")]
    if tp > 1:
        kv.append((f"KV per token{per}", f"{fmt_bytes(cur.kv_bytes_per_token_per_gpu)} "
                                         f"({cur.kv_bytes_per_token_per_gpu:,.0f} B)"))
    state = "" if cur.state is None else f", {fmt_bytes(cur.state.bytes_per_sequence)} of it recurrent state"
    kv.append(("KV per sequence", f"{fmt_bytes(cur.kv_bytes_per_sequence)} at {b.max_model_len:,} tokens{state}"))
    if tp > 1:
        kv.append((f"KV per sequence{per}", fmt_bytes(cur.kv_bytes_per_sequence_per_gpu)))
    kv.append((f"KV for {o.batch} sequence{'s' if o.batch != 1 else ''}",
               fmt_bytes(cur.kv_bytes_total) + (f", {fmt_bytes(cur.kv_bytes_total_per_gpu)}{per}" if tp > 1 else "")))
    if b.weight_bytes is not None:
        src = "safetensors headers" if b.weight_source == "safetensors" else "ESTIMATE from config.json"
        w = f"{fmt_bytes(b.weight_bytes)} ({src})"
        if tp > 1:
            w += f", {fmt_bytes(b.weight_bytes_per_gpu)}{per}"
        kv.append(("weights", w))
    if o.cpu_kvcache_bytes:
        kv.append(("CPU KV pool", f"{fmt_bytes(o.cpu_kvcache_bytes)} (VLLM_CPU_KVCACHE_SPACE; weights apart)"))
    if o.gpu is not None or o.cpu_kvcache_bytes:
        if o.gpu is not None:
            g = o.gpu
            budget = (f"{g.name}: {fmt_bytes(g.memory_bytes)} x {o.gpu_memory_utilization:g}"
                      + (f" - reserve {fmt_bytes(o.reserve_bytes)}" if o.reserve_bytes else "")
                      + f" = {fmt_bytes(b.kv_budget_per_gpu)} per GPU")
            kv.append(("GPU budget", budget))
            kv.append(("KV pool" + per, fmt_bytes(b.kv_pool_per_gpu) if b.weights_fit else
                       f"none: weights need {fmt_bytes(b.weight_bytes_per_gpu)}, budget is "
                       f"{fmt_bytes(b.kv_budget_per_gpu)}"))
        if b.weights_fit and cur.max_concurrent_sequences is None:
            kv.append(("max sequences", "not limited by a KV cache (no layer keeps one)"))
        elif b.weights_fit:
            kv.append(("max sequences", f"{cur.max_concurrent_sequences:,} of {b.max_model_len:,} tokens "
                                        f"(concurrency {cur.max_concurrency:,.2f})"))
            if cur.kv_pool_tokens is not None:
                kv.append(("KV pool tokens", f"{cur.kv_pool_tokens:,} (every KV layer holding every token)"))
    width = max(len(k) for k, _ in kv)
    lines.extend(f"  {k.ljust(width)}  {v}" for k, v in kv)
    if b.variants:
        lines.append("")
        rows = []
        for f in [cur, *b.variants]:
            rows.append([
                f.name, _heads_label(f),
                f.kv_dtype, f"{f.kv_bytes_per_token:,.0f}", fmt_bytes(f.kv_bytes_per_sequence_per_gpu),
                fmt_bytes(f.kv_bytes_total_per_gpu), "-" if f is cur else _pct(_saving(f, cur)),
                "-" if f.max_concurrent_sequences is None else f"{f.max_concurrent_sequences:,}",
                "refused" if f.tp_refusal else "ok",
            ])
        lines.extend("  " + s for s in _table(
            ["what-if", "KV heads", "KV dtype", "B/token", "per sequence" + ("/GPU" if tp > 1 else ""),
             f"{o.batch} seq{'s' if o.batch != 1 else ''}" + ("/GPU" if tp > 1 else ""), "vs current", "max seqs", f"TP {tp}"], rows,
            right={3, 4, 5, 6, 7}))
    if b.notes:
        lines.append("")
        lines.extend(f"  note: {n}" for n in b.notes)
    problems = b.problems
    lines.append("")
    if problems:
        lines.extend(f"  {p}" for p in problems)
    elif o.gpu is not None or o.cpu_kvcache_bytes:
        lines.append(f"  fits: {o.batch} sequence{'s' if o.batch != 1 else ''} of {b.max_model_len:,} tokens "
                     + (f"on {tp} x {o.gpu.name}" if o.gpu is not None else
                        f"in a {fmt_bytes(o.cpu_kvcache_bytes)} CPU pool"))
    while lines and not lines[-1].strip():
        lines.pop()
    return console.lines(lines)
