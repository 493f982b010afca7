"""`--method aware`: calibrated, RoPE-aware K/V head merging (see kvtool/convert/aware/__init__.py)."""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

from kvtool import progress as kv_progress
from kvtool.convert import defaults
from kvtool.convert.methods import MergeMethod, register_method
from kvtool.datasets import MERGE_CALIBRATION, check_calibration_source
from kvtool.errors import InputError, UsageError
from kvtool.io.staging import sigterm_as_interrupt

if TYPE_CHECKING:
    from kvtool.convert.layout import AttentionWeights
    from kvtool.convert.methods import MergeJob
    from kvtool.convert.aware.spill import LayerStore

# What --refine-steps fits each layer to (kvtool/convert/aware/merge.py): the original layer's output on the
# original model's own hidden states, or on the converted model's (the inputs the layer sees once converted).
# Measured on SmolLM2 MQA (dev texts, docs/convert-quality.md): `original` is better refined alone (licences
# 3.21x vs 3.40x, fortunes 2.12x vs 2.19x, both at step 5e-3), `layer` before --distill-steps (2.70x vs 2.82x,
# 1.84x vs 1.93x). Each target's Adam step (relative to each tensor's RMS): `original` starts further from its
# target (the closed form fits the layer's), and larger steps were better up to LR_ORIGINAL (3e-3 / 5e-3 / 8e-3 /
# 1.2e-2: licences 3.33x / 3.21x / 3.15x / 3.11x; 2e-2: 3.24x); `layer` keeps the step measured for it
# (kvtool/convert/aware/refine.py).
LR_ORIGINAL = 1.2e-2
REFINE_TARGETS = {"original": LR_ORIGINAL, "layer": 5e-3}
# Adam step of --distill-steps, relative to each tensor's RMS (kvtool/convert/aware/distill.py)
DISTILL_LR = 6e-4
# RoPE pairs turning by less than this many radians over the served context merge as one real subspace
# (kvtool/convert/aware/keys.py). Measured on SmolLM2 (8192 positions; docs/convert-quality.md): 1.5 (8 of 32
# pairs) beat 1 (6) training-free in 1024- and 8192-token windows, but refined conversions did worse with it in
# 8192-token windows (licences 3.97x vs 3.56x); 1 is better than no static pairs everywhere measured.
STATIC_ANGLE = 1.0
# --method-opt KEY=VALUE settings (their checks are in __init__); the declared options (kvtool/options/convert.py,
# whose declaration checks them) are given as keywords too, None when not set.
DEFAULTS = {"o_ridge": 2.0, "layerwise": True, "refine_holdout": 0, "cov_shrink": 0.0, "refine_reg": 0.0,
            "distill_lr": DISTILL_LR, "static_angle": STATIC_ANGLE, "refine_target": None, "refine_lr": None}


def unsupported_reason(job: "MergeJob") -> str | None:
    """Why the architecture cannot be merged this way (None when it can), from its table and the config."""
    from kvtool.model.spec import get_path

    arch, spec, w = job.arch, job.spec, job.arch.weights
    if spec.is_mla:
        return "multi-head latent attention has no K/V heads to merge"
    if spec.position != "rope":
        return (f"{arch.model_type} uses {spec.position} positions; the calibrated merge needs RoPE position "
                "embeddings")
    when = w.get("qk_norm_when")
    if when is not None:
        norms = all(get_path(spec.config, k, arch.defaults.get(k)) == v for k, v in when.items())
    else:
        norms = bool(w.get("q_norm") or w.get("k_norm"))
    if norms:
        flags = " (" + ", ".join(f"{k}: {str(v).lower()}" for k, v in when.items()) + ")" if when else ""
        return (f"{arch.model_type} normalises q/k per head before RoPE{flags}, so per-head key coefficients cannot "
                "be folded into the queries")
    return None


@register_method("aware")
class AwareMerge(MergeMethod):
    """Calibrated merge: sequential per-layer calibration, RoPE-aware keys, o-weighted values, o refit."""

    option_names = defaults.AWARE_FIELDS + tuple(DEFAULTS)
    approximate = True

    def __init__(self, **options: Any):
        options = {k: v for k, v in options.items() if v is not None}
        super().__init__(**options)
        self.settings = s = {**dict.fromkeys(defaults.AWARE_FIELDS), **DEFAULTS, **self.options}
        check_calibration_source(s["calib_text"], s["calib_dataset"])
        if s["calib_text"] is None and s["calib_dataset"] is None:
            s["calib_dataset"] = MERGE_CALIBRATION  # None means the merge's own mix, here and only here
        s["grouping"] = s["grouping"] or defaults.GROUPING
        s["refine_steps"], s["distill_steps"] = s["refine_steps"] or 0, s["distill_steps"] or 0
        if s["calib_tokens"] is None:
            s["calib_tokens"] = defaults.calib_tokens(s["refine_steps"], s["distill_steps"])
        if s["seq_len"] is None:
            s["seq_len"] = defaults.seq_len(s["refine_steps"], s["distill_steps"])
        if s["refine_target"] is None:
            s["refine_target"] = "layer" if s["distill_steps"] else "original"
        if not isinstance(s["refine_target"], str) or s["refine_target"] not in REFINE_TARGETS:
            raise UsageError(f"unknown refine_target {s['refine_target']!r}; choose from {', '.join(REFINE_TARGETS)}",
                             option="method_opt")
        if s["refine_lr"] is None:
            s["refine_lr"] = REFINE_TARGETS[s["refine_target"]]
        if not isinstance(s["refine_holdout"], int) or isinstance(s["refine_holdout"], bool) or s["refine_holdout"] < 0:
            raise UsageError(f"refine_holdout must be an integer >= 0, got {s['refine_holdout']!r}", option="method_opt")
        # --method-opt numbers: name, lowest value, whether the lowest is excluded, highest value
        for name, low, above, high in (("cov_shrink", 0, False, 1), ("refine_reg", 0, False, None),
                                       ("distill_lr", 0, True, None), ("static_angle", 0, False, None),
                                       ("refine_lr", 0, True, None)):
            v = s[name]
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v < low or (above and v == low) or (high is not None and v > high)):
                bound = f"from {low} to {high}" if high is not None else f"{'>' if above else '>='} {low}"
                raise UsageError(f"{name} must be a number {bound}, got {v!r}", option="method_opt")
        if not isinstance(s["layerwise"], bool):
            raise UsageError(f"layerwise must be true or false, got {s['layerwise']!r}", option="method_opt")
        # refinement fits the original model's own stream, which then runs alongside the calibration
        self.original_stream = bool(s["refine_steps"]) and s["refine_target"] == "original"
        self._merged: LayerStore | None = None  # the calibrated layers (Proj) waiting for the writer
        self._info: dict = {}

    def estimate(self, plan, shape):
        from kvtool.convert.aware.partition import cost_terms
        from kvtool.model import costs

        s = self.settings
        grouping = (cost_terms(plan.source_kv_heads, plan.target_kv_heads, s["calib_tokens"], s["seq_len"])
                    if s["grouping"] == "error" else {})
        return costs.convert_aware(shape, s["calib_tokens"], s["seq_len"], s["refine_steps"], s["distill_steps"],
                                   self.original_stream, **grouping)

    def merge_settings(self, job: "MergeJob"):
        """The per-layer merge's settings (kvtool.convert.aware.merge.MergeSettings) for this conversion."""
        from kvtool.convert.aware.merge import MergeSettings

        s, spec = self.settings, job.spec
        return MergeSettings(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                             target_kv_heads=job.target_kv_heads, head_dim=spec.head_dim, grouping=s["grouping"],
                             o_ridge=s["o_ridge"],
                             refine_steps=s["refine_steps"], refine_holdout=s["refine_holdout"],
                             cov_shrink=float(s["cov_shrink"]), refine_reg=float(s["refine_reg"]),
                             refine_lr=float(s["refine_lr"]), context=s["serve_context"] or spec.max_position,
                             static_angle=float(s["static_angle"]))

    def prepare(self, job: "MergeJob") -> None:
        """Calibrate: the calibration data (CalibrationData), then every layer merged in turn on the converted
        stream (`_merge_layers`), then distillation when asked; the merged layers wait on disk for the writer."""
        reason = unsupported_reason(job)
        if reason:
            raise UsageError(f"--method aware: {reason}; use --method mean", option="method")
        if job.target_kv_heads >= job.spec.num_kv_heads:
            return  # expansion or identity: exact, nothing to calibrate (merge_layer falls back to mean)
        s = self.settings
        t0 = time.perf_counter()
        bar = kv_progress.task("calibrate", total=job.num_layers or None, unit="layers")
        from kvtool.convert.aware.spill import LayerStore

        self._merged = LayerStore("kvtool-aware-", "the merged layer {layer}", encode=_proj_tensors, decode=_proj)
        try:
            bar.set_note("importing torch and transformers")
            import torch

            from kvtool.convert.aware.calibration_data import CalibrationData

            device = torch.device(job.device or "cpu")
            data = CalibrationData.build(job.src, s["calib_text"], s["calib_dataset"], s["calib_tokens"],
                                         s["seq_len"], device=device, note=bar.set_note)
            settings = self.merge_settings(job)
            reports, held, distilled = self._merge_layers(job, data.ids, settings, device, bar)
        except BaseException:
            self._merged.close()
            raise
        finally:
            bar.close()
        self._info = {**data.provenance(), **self._details(reports, settings),
                      "calibration_seconds": round(time.perf_counter() - t0, 2),
                      **({"distill": {"steps": s["distill_steps"], "lr": s["distill_lr"], **distilled}}
                         if distilled else {}),
                      "calibration_model": held}

    def _merge_layers(self, job: "MergeJob", ids, settings, device, bar) -> tuple[dict, dict, dict]:
        """The layer loop: each layer merged from its attention input on the converted stream, one decoder
        layer's weights in memory (kvtool.runtime.layerwise), then --distill-steps. Returns (per-layer merge
        reports, what the layer-by-layer model held, distillation figures)."""
        import torch

        from kvtool.convert.aware.calibration import run_layerwise
        from kvtool.convert.aware.merge import merge_layer
        from kvtool.runtime.layerwise import describe, open_layerwise

        s = self.settings
        per_layer = 1 + s["refine_steps"]  # one unit per layer: its merge and each refinement step equal parts
        reports: dict = {}
        distilled: dict = {}
        bar.set_note(f"building the model, {ids.numel()} calibration tokens")
        with sigterm_as_interrupt(), open_layerwise(job.src, device=device, dtype=torch.float32,
                                                     reader=job.reader, layerwise=s["layerwise"]) as lm:
            held = describe(lm)

            def layer_fn(layer, inp, src):
                steps = [0]

                def on_step():
                    what = f"layer {layer}" + (f", refinement step {steps[0]}/{s['refine_steps']}"
                                               if steps[0] else ", merged")
                    steps[0] += 1
                    bar.update(1 / per_layer, note=what)

                new, rep = merge_layer(inp, src, settings, on_step=on_step,
                                       on_note=lambda text: bar.set_note(f"layer {layer}, {text}"))
                reports[layer] = rep
                return new

            # on_merged gets each layer in the checkpoint's dimension order (interleaved RoPE is merged
            # in rotate_half order and put back before it reaches the writer)
            final = run_layerwise(lm, ids, layer_fn, job.spec.num_heads, on_merged=self._merged.put,
                                  keep_original=bool(s["distill_steps"]), target_original=self.original_stream)
            if s["distill_steps"]:
                from kvtool.convert.aware.distill import teacher_targets

                bar.set_note("the original model's next-token distributions")
                teacher = teacher_targets(lm, final)
                del final  # the original stream's hidden states: the teacher's bins are all that is needed
                bar.close()
                distilled = self._distill(lm, ids, teacher, job.spec.num_heads)
        return reports, held, distilled

    def _details(self, reports: dict, settings) -> dict:
        """kvtool.json's record of the merge: its settings and each layer's measured error and choices."""
        s = self.settings
        errs = [reports[k].err_final for k in sorted(reports)]
        return {
            "refine_steps": s["refine_steps"], "grouping": s["grouping"], "o_ridge": s["o_ridge"],
            "cov_shrink": s["cov_shrink"], **({"refine_reg": s["refine_reg"]} if s["refine_reg"] else {}),
            **({"refine_target": s["refine_target"], "refine_lr": s["refine_lr"]} if s["refine_steps"] else {}),
            **({"refine_holdout": s["refine_holdout"],
                "refine_best_steps": [reports[k].best_step for k in sorted(reports)]} if s["refine_holdout"] else {}),
            "static_angle": s["static_angle"], "serve_context": settings.context,
            "rope_static_pairs": [reports[k].static_pairs for k in sorted(reports)],
            "kv_order": {str(k): r.order for k, r in sorted(reports.items()) if r.order != sorted(r.order)},
            "attention_rel_err_mean": sum(errs) / max(len(errs), 1), "attention_rel_err_max": max(errs, default=0.0),
        }

    def _distill(self, lm, ids, teacher, num_heads: int) -> dict:
        """--distill-steps after the per-layer merge (kvtool/convert/aware/distill.py), with a progress bar of
        its own (the calibration's has finished its layers)."""
        from kvtool.convert.aware.distill import distill_with_progress

        s = self.settings
        return distill_with_progress(lm, ids, teacher, self._merged.peek, self._merged.put, num_heads=num_heads,
                                     steps=s["distill_steps"], lr=float(s["distill_lr"]))

    def summary(self) -> str:
        from kvtool.datasets import CALIBRATION_MIXES

        s = self.settings
        if s["calib_text"]:
            source = str(s["calib_text"])
        else:
            name = s["calib_dataset"]
            source = f"{name} ({' + '.join(CALIBRATION_MIXES[name])})" if len(CALIBRATION_MIXES[name]) > 1 else name
        refine = f", {s['refine_steps']} refinement steps per layer" if s["refine_steps"] else ""
        refine += f", {s['distill_steps']} distillation steps" if s["distill_steps"] else ""
        refine = refine or ", training-free"
        served = f", for contexts up to {s['serve_context']} tokens" if s["serve_context"] else ""
        return (f"calibrated merge on {s['calib_tokens']} tokens of {source} in sequences of {s['seq_len']}"
                f"{refine}{served}")

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        if w.target_kv_heads >= w.num_kv_heads:
            from kvtool.convert.pooling import mean_pool

            return mean_pool(w)  # expansion / identity is exact by repetition
        new = self._merged.take(layer) if self._merged is not None else None
        if new is None:
            raise InputError(f"layer {layer}: no calibration result (the model's attention modules were not all "
                             "reached by the calibration pass)", option="method")

        def cast(t, like):
            return None if t is None else t.to(dtype=like.dtype if like is not None else w.q.dtype)

        out = w.with_(q=cast(new.q, w.q), k=cast(new.k, w.k), v=cast(new.v, w.v), o=cast(new.o, w.o),
                      q_bias=cast(new.q_bias, w.q_bias), k_bias=cast(new.k_bias, w.k_bias),
                      v_bias=cast(new.v_bias, w.v_bias), o_bias=cast(new.o_bias, w.o_bias),
                      num_kv_heads=w.target_kv_heads)
        out.check()
        return out

    def provenance(self) -> dict:
        return dict(self._info)


def _proj_tensors(p) -> dict:
    return p.tensors()


def _proj(tensors: dict):
    """A stored layer as the merge's Proj (kvtool/convert/aware/attention.py imports torch: here, when read)."""
    from kvtool.convert.aware.attention import Proj

    return Proj.of(tensors)
