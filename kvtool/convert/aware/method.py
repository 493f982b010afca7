"""`--method aware`: calibrated, RoPE-aware K/V head merging (see kvtool/convert/aware/__init__.py)."""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Any

from kvtool.convert.methods import MergeMethod, register_method
from kvtool.errors import InputError, UsageError

if TYPE_CHECKING:
    from kvtool.convert.layout import AttentionWeights
    from kvtool.convert.methods import MergeJob

GROUPINGS = ("contiguous", "similarity")
DEFAULTS = {"calib_text": None, "calib_tokens": 2048, "refine_steps": 0, "grouping": "contiguous",
            "seq_len": 256, "o_ridge": 2.0}


def unsupported_reason(job: "MergeJob") -> str | None:
    """Why the architecture cannot be merged this way (None when it can), from its table."""
    w = job.arch.weights
    if job.spec.is_mla:
        return "multi-head latent attention has no K/V heads to merge"
    if "q_norm" in w or "k_norm" in w:
        return (f"{job.arch.model_type} normalises q/k per head before RoPE, so per-head key coefficients cannot "
                "be folded into the queries")
    if "qkv" in w:
        return f"{job.arch.model_type} stores a fused qkv projection (not supported by the calibrated merge yet)"
    return None


@register_method("aware")
class AwareMerge(MergeMethod):
    """Calibrated merge: sequential per-layer calibration, RoPE-aware keys, o-weighted values, o refit."""

    option_names = tuple(DEFAULTS)
    approximate = True

    def __init__(self, **options: Any):
        options = {k: v for k, v in options.items() if v is not None}
        super().__init__(**options)
        self.settings = {**DEFAULTS, **self.options}
        s = self.settings
        if s["grouping"] not in GROUPINGS:
            raise UsageError(f"unknown grouping {s['grouping']!r}; choose from {', '.join(GROUPINGS)}",
                             field="--grouping")
        for name, low in (("calib_tokens", 2), ("refine_steps", 0), ("seq_len", 2)):
            if not isinstance(s[name], int) or s[name] < low:
                raise UsageError(f"{name.replace('_', '-')} must be an integer >= {low}, got {s[name]!r}",
                                 field="--" + name.replace("_", "-"))
        self._merged: dict[int, Any] = {}
        self._info: dict = {}

    def prepare(self, job: "MergeJob") -> None:
        reason = unsupported_reason(job)
        if reason:
            raise UsageError(f"--method aware: {reason}; use --method mean", field="--method")
        if job.target_groups >= job.spec.num_kv_heads:
            return  # expansion or identity: exact, nothing to calibrate (merge_layer falls back to mean)
        import torch

        from kvtool.convert.aware.calibration import calibration_ids, read_text, run_sequential
        from kvtool.convert.aware.merge import MergeSettings, merge_layer
        from kvtool.torch_utils import load_model, load_tokenizer

        s = self.settings
        t0 = time.perf_counter()
        text, label = read_text(s["calib_text"])
        device = torch.device(job.device or "cpu")
        tok = load_tokenizer(job.src)
        ids = calibration_ids(tok, text, s["calib_tokens"], s["seq_len"], label)
        model = load_model(job.src, device=device, dtype=torch.float32, attn="sdpa")
        spec = job.spec
        settings = MergeSettings(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads, groups=job.target_groups,
                                 head_dim=spec.head_dim, grouping=s["grouping"], o_ridge=s["o_ridge"],
                                 refine_steps=s["refine_steps"])
        reports = {}

        def layer_fn(layer, inp, src):
            new, rep = merge_layer(inp, src, settings)
            self._merged[layer] = new.to(torch.float32)
            reports[layer] = rep
            return new

        run_sequential(model, ids, layer_fn, spec.num_heads)
        del model
        self._merged = {k: _to_cpu(v) for k, v in self._merged.items()}
        errs = [reports[k].err_final for k in sorted(reports)]
        self._info = {
            "calib_text": label, "calib_text_sha256": hashlib.sha256(text.encode("utf-8")).hexdigest(),
            "calib_tokens": int(ids.numel()), "seq_len": int(ids.shape[1]), "refine_steps": s["refine_steps"],
            "grouping": s["grouping"], "o_ridge": s["o_ridge"],
            "kv_order": {str(k): r.order for k, r in sorted(reports.items()) if r.order != sorted(r.order)},
            "attention_rel_err_mean": sum(errs) / max(len(errs), 1), "attention_rel_err_max": max(errs, default=0.0),
            "calibration_seconds": round(time.perf_counter() - t0, 2),
        }

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        if w.target_groups >= w.num_kv_heads:
            from kvtool.convert.pooling import mean_pool

            return mean_pool(w)  # expansion / identity is exact by repetition
        new = self._merged.get(layer)
        if new is None:
            raise InputError(f"layer {layer}: no calibration result (the model's attention modules were not all "
                             "reached by the calibration pass)", field="--method")

        def cast(t, like):
            return None if t is None else t.to(dtype=like.dtype if like is not None else w.q.dtype)

        out = w.with_(q=cast(new.q, w.q), k=cast(new.k, w.k), v=cast(new.v, w.v), o=cast(new.o, w.o),
                      q_bias=cast(new.q_bias, w.q_bias), k_bias=cast(new.k_bias, w.k_bias),
                      v_bias=cast(new.v_bias, w.v_bias), o_bias=cast(new.o_bias, w.o_bias),
                      num_kv_heads=w.target_groups)
        out.check()
        return out

    def provenance(self) -> dict:
        return dict(self._info)


def _to_cpu(p):
    from kvtool.convert.aware.attention import Proj

    return Proj(*(None if t is None else t.detach().cpu() for t in
                  (p.q, p.k, p.v, p.o, p.q_bias, p.k_bias, p.v_bias, p.o_bias)))
