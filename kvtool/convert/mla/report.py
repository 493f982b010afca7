"""`kvtool convert --to mla`: the plan (--dry-run) and the result, as lines."""

from __future__ import annotations

from kvtool import console
from kvtool.units import fmt_bytes


def _ratio(p) -> str:
    return f"  ({p.kv_bytes_after / p.kv_bytes_before:.3g}x)" if p.kv_bytes_before else ""


def render_plan(p, dst, eval_tokens: int | None = None) -> console.Text:
    from kvtool.convert.source import template_of
    from kvtool.convert.mla import backends
    from kvtool.io.writer import _split

    s, sp, st = p.shape, p.spec, p.settings
    source = f"{sp.num_kv_heads} KV heads x head_dim {sp.head_dim}"
    calib = st["calib_text"] or st["calib_dataset"] or "the built-in mix"
    steps = [f"{st['refine_steps']} refinement steps" if st["refine_steps"] else "",
             f"{st['distill_steps']} distillation steps" if st["distill_steps"] else ""]
    lines = [
        f"kvtool convert plan: {p.src} -> {dst or '(dry run)'}",
        f"  model        {p.arch.model_type} -> deepseek_v3 (MLA, every layer dense), {sp.num_layers} layers, "
        f"{s.num_heads} query heads",
        f"  attention    {source} -> latent {s.kv_lora_rank} + shared rope key {s.qk_rope_head_dim} per token "
        f"(q/k heads {s.qk_nope_head_dim} + {s.qk_rope_head_dim}, v heads {s.v_head_dim}); the rope part turns "
        f"with the source's fastest {len(p.rope_pairs)} pairs (rope_theta {p.rope_theta:.6g})",
        f"  method       solved per layer ({st['mla_solve']}) from {st['calib_tokens']} calibration tokens of {calib} in sequences of "
        f"{st['seq_len']}{', ' + ', '.join(x for x in steps if x) if any(steps) else ', training-free'}",
        f"  KV cache     {fmt_bytes(p.kv_bytes_before)}/token -> {fmt_bytes(p.kv_bytes_after)}/token{_ratio(p)} "
        f"({p.kv_dtype}, as vLLM allocates: one {s.cached_dims}-dim latent row per layer)",
        f"  backends     {backends.summary(s)}",
    ]
    seen: dict = {}
    for name, old, new in p.touched:
        key = (template_of(name), old, new)
        seen[key] = seen.get(key, 0) + 1
    lines.append(f"  tensors      {len(p.layers) * 4} attention tensors become {len(p.layers) * 5}; the rest are copied"
                 + (f" (cast to {p.out_dtype})" if p.out_dtype else ""))
    lines += [f"    {t}  {list(a) if a else '(new)'} -> {list(b) if b else '(gone)'}  (x{n})"
              for (t, a, b), n in seen.items()]
    n_shards = len(_split(p.outputs, p.max_shard_size))
    lines.append(f"  output       {fmt_bytes(p.output_bytes)} in {n_shards} shard(s) of at most "
                 f"{p.max_shard_size / 1e9:g} GB; source {fmt_bytes(p.ckpt.weight_bytes)}")
    keys = ("model_type", "kv_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim", "q_lora_rank",
            "first_k_dense_replace", "rope_interleave", "tie_word_embeddings")
    lines.append("  config.json  " + ", ".join(f"{k}: {p.new_config.get(k)!r}" for k in keys))
    est = p.estimate(eval_tokens)
    lines.append(f"  estimate     {est.line()}")
    lines += [f"  warning      {w}" for w in p.warnings]
    return console.lines(lines)


def render_result(result) -> console.Text:
    p = result.plan
    s = p.shape
    return console.lines([
        f"converted {p.src} -> {result.dst}: {p.arch.model_type} {p.source_kv_heads} KV heads -> MLA latent "
        f"{s.kv_lora_rank} + rope {s.qk_rope_head_dim} (deepseek_v3)",
        f"  KV cache {fmt_bytes(p.kv_bytes_before)}/token -> {fmt_bytes(p.kv_bytes_after)}/token; "
        f"{len(p.outputs)} tensors written in {len(result.files)} file(s)",
        f"  copied: {', '.join(result.side_files) or 'nothing'}; provenance in kvtool.json",
    ])
