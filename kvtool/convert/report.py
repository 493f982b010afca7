"""Human-readable plan (--dry-run) and result of `kvtool convert --to gqa | mqa | mha` (the heads targets;
--to mla's: kvtool/convert/mla/report.py): what ConvertPlan.render and .render_result return."""

from __future__ import annotations

from collections import OrderedDict

from kvtool import console
from kvtool.units import fmt_bytes


def _kind(h: int, kv: int) -> str:
    from kvtool.convert.driver import kind_name

    return kind_name(h, kv)


def _grouped_touched(plan) -> list[str]:
    """One line per weight template (layer index replaced by {i}), not one per layer."""
    from kvtool.convert.source import template_of

    groups: "OrderedDict[tuple, int]" = OrderedDict()
    for name, old, new in plan.touched:
        key = (template_of(name), old, new)
        groups[key] = groups.get(key, 0) + 1
    lines = []
    for (tmpl, old, new), n in groups.items():
        lines.append(f"    {tmpl}  {list(old)} -> {list(new)}  (x{n})")
    return lines


def render_plan(plan, dst, eval_tokens: int | None = None) -> console.Text:
    H, a, b = plan.num_heads, plan.source_kv_heads, plan.target_kv_heads
    how = {"pool": plan.method.summary(),
           "expand": "each KV head repeated (exact: same outputs)",
           "unchanged": "same KV-head count (identity)"}[plan.direction]
    lines = [
        f"kvtool convert plan: {plan.src} -> {dst or '(dry run)'}",
        f"  model        {plan.arch.model_type}, {plan.spec.num_layers} layers, {H} query heads, head_dim {plan.head_dim}",
        f"  KV heads     {a} -> {b}  ({_kind(H, a)} -> {_kind(H, b)}; query head h reads KV head h // {H // b})",
        f"  method       {plan.method.name}: {how}",
        f"  KV cache     {fmt_bytes(plan.kv_bytes_before)}/token -> {fmt_bytes(plan.kv_bytes_after)}/token"
        + (f"  ({plan.kv_bytes_after / plan.kv_bytes_before:.3g}x)" if plan.kv_bytes_before else ""),
        f"  tensors      {len(plan.touched)} of {len(plan.outputs)} change shape; the rest are copied"
        + (f" (cast to {plan.out_dtype})" if plan.out_dtype else ""),
    ]
    lines += _grouped_touched(plan)
    from kvtool.io.writer import _split

    n_shards = len(_split(plan.outputs, plan.max_shard_size))
    lines.append(f"  output       {fmt_bytes(plan.output_bytes)} in {n_shards} shard(s) of at most "
                 f"{plan.max_shard_size / 1e9:g} GB; source {fmt_bytes(plan.ckpt.weight_bytes)}")
    changed = [k for k in plan.new_config if plan.new_config.get(k) != plan.ckpt.config.get(k)]
    lines.append(f"  config.json  {', '.join(f'{k}: {plan.ckpt.config.get(k)!r} -> {plan.new_config[k]!r}' for k in changed) or 'unchanged'}")
    est = plan.estimate(eval_tokens)
    lines.append(f"  estimate     {est.line() if est else f'no cost model for method {plan.method.name!r}'}")
    for w in plan.warnings:
        lines.append(f"  warning      {w}")
    return console.lines(lines)


def render_result(result) -> console.Text:
    plan = result.plan
    lines = [
        f"converted {plan.src} -> {result.dst}: KV heads {plan.source_kv_heads} -> {plan.target_kv_heads} "
        f"({_kind(plan.num_heads, plan.source_kv_heads)} -> {_kind(plan.num_heads, plan.target_kv_heads)}), "
        f"method {plan.method.name}",
        f"  KV cache {fmt_bytes(plan.kv_bytes_before)}/token -> {fmt_bytes(plan.kv_bytes_after)}/token; "
        f"{len(plan.touched)} tensors reshaped, {len(plan.outputs)} written in {len(result.files)} file(s)",
        f"  copied: {', '.join(result.side_files) or 'nothing'}; provenance in kvtool.json",
    ]
    return console.lines(lines)
