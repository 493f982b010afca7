"""`--method aware`: calibrated, RoPE-aware K/V head merging (see kvtool/convert/aware/__init__.py)."""

from __future__ import annotations

import hashlib
import math
import time
from typing import TYPE_CHECKING, Any

from kvtool import progress as kv_progress
from kvtool.convert.methods import MergeMethod, register_method
from kvtool.datasets import check_calibration_source
from kvtool.errors import InputError, UsageError
from kvtool.io.staging import sigterm_as_interrupt

if TYPE_CHECKING:
    from kvtool.convert.layout import AttentionWeights
    from kvtool.convert.methods import MergeJob

# Which KV heads share a group (kvtool/convert/aware/grouping.py). `error` measures candidate groups: on the trained
# tiny MHA model 8 -> 4 it took the training-free PPL from +1.9% to +0.5% (KLD 0.013 -> 0.004), where `similarity`
# was within noise of `contiguous` (docs/convert-quality.md).
GROUPINGS = ("error", "contiguous", "similarity")
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
DEFAULTS = {"calib_text": None, "calib_dataset": None, "calib_tokens": None, "refine_steps": 0,
            "grouping": "error", "seq_len": None, "o_ridge": 2.0, "layerwise": True, "refine_holdout": 0,
            "cov_shrink": 0.0, "refine_reg": 0.0, "distill_steps": 0, "distill_lr": DISTILL_LR,
            "static_angle": STATIC_ANGLE, "serve_context": None, "refine_target": None, "refine_lr": None}
# Calibration sequence length when not given. Measured on SmolLM2 MQA (4096 tokens, 2047 held-out tokens in
# windows of 1024): the closed-form merge is best on short sequences (more sequence starts: 3.43x at 256, 3.75x
# at 512), refinement on long ones, whose attention spans what serving sees (64 steps: 2.17x at 256, 2.06x at
# 512, 1.93x at 1024).
SEQ_LEN_CLOSED_FORM, SEQ_LEN_REFINE = 256, 1024
# Calibration tokens when not given. --refine-steps alone takes more (its steps visit the sequences in turn, the
# sources interleaved): measured on SmolLM2 MQA with 64 steps (dev texts, docs/convert-quality.md), 4096 / 8192 /
# 16384 tokens gave licences 3.11x / 2.98x / 2.73x and fortunes 2.09x / 1.90x / 1.84x, for 1.7x the calibration
# time at 16384. --distill-steps keeps 4096 (not measured with more).
CALIB_TOKENS, CALIB_TOKENS_REFINE = 4096, 16384


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

    option_names = tuple(DEFAULTS)
    approximate = True

    def __init__(self, **options: Any):
        options = {k: v for k, v in options.items() if v is not None}
        super().__init__(**options)
        self.settings = {**DEFAULTS, **self.options}
        s = self.settings
        check_calibration_source(s["calib_text"], s["calib_dataset"])
        if s["grouping"] not in GROUPINGS:
            raise UsageError(f"unknown grouping {s['grouping']!r}; choose from {', '.join(GROUPINGS)}",
                             option="grouping")
        if s["refine_target"] is None:
            s["refine_target"] = "layer" if s["distill_steps"] else "original"
        if not isinstance(s["refine_target"], str) or s["refine_target"] not in REFINE_TARGETS:
            raise UsageError(f"unknown refine_target {s['refine_target']!r}; choose from {', '.join(REFINE_TARGETS)}",
                             option="method_opt")
        if s["refine_lr"] is None:
            s["refine_lr"] = REFINE_TARGETS[s["refine_target"]]
        if s["calib_tokens"] is None:
            s["calib_tokens"] = CALIB_TOKENS_REFINE if s["refine_steps"] and not s["distill_steps"] else CALIB_TOKENS
        if s["seq_len"] is None:
            s["seq_len"] = SEQ_LEN_REFINE if s["refine_steps"] or s["distill_steps"] else SEQ_LEN_CLOSED_FORM
        for name, low in (("calib_tokens", 2), ("refine_steps", 0), ("seq_len", 2), ("distill_steps", 0)):
            if not isinstance(s[name], int) or s[name] < low:
                raise UsageError(f"{name.replace('_', '-')} must be an integer >= {low}, got {s[name]!r}",
                                 option=name)
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
        ctx = s["serve_context"]
        if ctx is not None and (not isinstance(ctx, int) or isinstance(ctx, bool) or ctx < 2):
            raise UsageError(f"serve-context must be an integer >= 2 (tokens), got {ctx!r}", option="serve_context")
        if not isinstance(s["layerwise"], bool):
            raise UsageError(f"layerwise must be true or false, got {s['layerwise']!r}", option="method_opt")
        # refinement fits the original model's own stream, which then runs alongside the calibration
        self.original_stream = bool(s["refine_steps"]) and s["refine_target"] == "original"
        self._merged: MergedLayers | None = None
        self._info: dict = {}

    def prepare(self, job: "MergeJob") -> None:
        reason = unsupported_reason(job)
        if reason:
            raise UsageError(f"--method aware: {reason}; use --method mean", option="method")
        if job.target_groups >= job.spec.num_kv_heads:
            return  # expansion or identity: exact, nothing to calibrate (merge_layer falls back to mean)
        s = self.settings
        t0 = time.perf_counter()
        # one unit per layer: its closed-form merge and each refinement step are equal fractions of it
        per_layer = 1 + s["refine_steps"]
        bar = kv_progress.task("calibrate", total=job.num_layers or None, unit="layers")
        self._merged = MergedLayers()
        try:
            bar.set_note("importing torch and transformers")
            import torch

            from kvtool.convert.aware.calibration import (calibration_batch, calibration_sources, calibration_shares,
                                                          run_layerwise, text_sha256)
            from kvtool.convert.aware.merge import MergeSettings, merge_layer
            from kvtool.runtime.layerwise import describe, open_layerwise, release_free_memory
            from kvtool.runtime.torch_utils import load_tokenizer

            bar.set_note("reading the calibration text")
            sources = calibration_sources(s["calib_text"], s["calib_dataset"])
            device = torch.device(job.device or "cpu")
            tokenizer = load_tokenizer(job.src)
            written: dict = {}

            def write(rows, seq_len):
                from kvtool.convert.aware.selftext import Sampling, write_calibration

                bar.set_note(f"the model writes {rows} calibration sequences of {seq_len} tokens")
                t1 = time.perf_counter()
                out = write_calibration(job.src, tokenizer, rows, seq_len, device=device, sampling=Sampling(),
                                        on_batch=lambda done: bar.set_note(f"written {done}/{rows} sequences"))
                written.update(rows=rows, seconds=round(time.perf_counter() - t1, 2), sampling=vars(Sampling()))
                return out

            used: list = []  # the texts' Tokens: the sha256 of the text each one used
            ids = calibration_batch(tokenizer, sources, s["calib_tokens"], s["seq_len"], write, used)
            # the provenance names the sources that gave sequences (a short calibration may not reach all of them)
            sources = [src for src, n in zip(sources, calibration_shares(len(sources), s["calib_tokens"],
                                                                         s["seq_len"])) if n]
            label = " + ".join(src.label for src in sources)
            del tokenizer
            release_free_memory()  # the tokenizer (~100 MB for a 49k vocabulary) is gone before the model comes
            spec = job.spec
            context = s["serve_context"] or spec.max_position
            settings = MergeSettings(num_heads=spec.num_heads, num_kv_heads=spec.num_kv_heads,
                                     groups=job.target_groups, head_dim=spec.head_dim, grouping=s["grouping"],
                                     o_ridge=s["o_ridge"], refine_steps=s["refine_steps"],
                                     refine_holdout=s["refine_holdout"], cov_shrink=float(s["cov_shrink"]),
                                     refine_reg=float(s["refine_reg"]), refine_lr=float(s["refine_lr"]),
                                     context=context,
                                     static_angle=float(s["static_angle"]))
            reports = {}
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
                final = run_layerwise(lm, ids, layer_fn, spec.num_heads, on_merged=self._merged.put,
                                      keep_original=bool(s["distill_steps"]),
                                      target_original=self.original_stream)
                if s["distill_steps"]:
                    from kvtool.convert.aware.distill import teacher_targets

                    bar.set_note("the original model's next-token distributions")
                    teacher = teacher_targets(lm, final)
                    del final  # the original stream's hidden states: the teacher's bins are all that is needed
                    bar.close()
                    distilled = self._distill(lm, ids, teacher, spec.num_heads)
        except BaseException:
            self._merged.close()
            raise
        finally:
            bar.close()
        errs = [reports[k].err_final for k in sorted(reports)]
        self._info = {
            "calib_text": label, "calib_text_sha256": text_sha256(used) if used else None,
            "calib_ids_sha256": hashlib.sha256(ids.numpy().astype("<i8").tobytes()).hexdigest(),
            "calib_tokens": int(ids.numel()), "seq_len": int(ids.shape[1]), "refine_steps": s["refine_steps"],
            "grouping": s["grouping"], "o_ridge": s["o_ridge"], "cov_shrink": s["cov_shrink"],
            **({"refine_reg": s["refine_reg"]} if s["refine_reg"] else {}),
            **({"refine_target": s["refine_target"], "refine_lr": s["refine_lr"]} if s["refine_steps"] else {}),
            **({"refine_holdout": s["refine_holdout"],
                "refine_best_steps": [reports[k].best_step for k in sorted(reports)]} if s["refine_holdout"] else {}),
            "static_angle": s["static_angle"], "serve_context": context,
            "rope_static_pairs": [reports[k].static_pairs for k in sorted(reports)],
            "kv_order": {str(k): r.order for k, r in sorted(reports.items()) if r.order != sorted(r.order)},
            "attention_rel_err_mean": sum(errs) / max(len(errs), 1), "attention_rel_err_max": max(errs, default=0.0),
            "calibration_seconds": round(time.perf_counter() - t0, 2),
            **({"self_written": written} if written else {}),
            **({"distill": {"steps": s["distill_steps"], "lr": s["distill_lr"], **distilled}} if distilled else {}),
            "calibration_model": held,
        }

    def _distill(self, lm, ids, teacher, num_heads: int) -> dict:
        """--distill-steps after the per-layer merge (kvtool/convert/aware/distill.py), with a progress bar of
        its own (the calibration's has finished its layers)."""
        from kvtool.convert.aware.distill import TOP_K, distill

        s = self.settings
        steps = kv_progress.task("distill", total=s["distill_steps"], unit="steps")
        try:
            out = distill(lm, ids, teacher, self._merged.get, self._merged.put, num_heads=num_heads,
                          steps=s["distill_steps"], lr=float(s["distill_lr"]), on_note=steps.set_note,
                          on_step=steps.update)
        finally:
            steps.close()
        return {"top_k": TOP_K, **out}

    def summary(self) -> str:
        from kvtool.datasets import CALIBRATION_MIXES, MERGE_CALIBRATION

        s = self.settings
        if s["calib_text"]:
            source = str(s["calib_text"])
        else:
            name = s["calib_dataset"] or MERGE_CALIBRATION
            source = f"{name} ({' + '.join(CALIBRATION_MIXES[name])})" if len(CALIBRATION_MIXES[name]) > 1 else name
        refine = f", {s['refine_steps']} refinement steps per layer" if s["refine_steps"] else ""
        refine += f", {s['distill_steps']} distillation steps" if s["distill_steps"] else ""
        refine = refine or ", training-free"
        served = f", for contexts up to {s['serve_context']} tokens" if s["serve_context"] else ""
        return (f"calibrated merge on {s['calib_tokens']} tokens of {source} in sequences of {s['seq_len']}"
                f"{refine}{served}")

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        if w.target_groups >= w.num_kv_heads:
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
                      num_kv_heads=w.target_groups)
        out.check()
        return out

    def provenance(self) -> dict:
        return dict(self._info)


class MergedLayers:
    """Merged projections waiting for the writer, one file per layer (kvtool/convert/aware/spill.py; not in
    memory: all layers' attention weights in float32 can exceed one decoder layer many times over). Each
    layer is read back once; the folder goes when the last layer is taken, on close(), or at garbage
    collection / interpreter exit, whichever comes first."""

    def __init__(self) -> None:
        from kvtool.convert.aware.spill import LayerFiles

        self._files = LayerFiles("kvtool-aware-", "the merged layer {layer}")
        self.folder = self._files.folder
        self._pending: set[int] = set()

    def put(self, layer: int, p) -> None:
        self._files.save(layer, p.tensors())
        self._pending.add(layer)

    def get(self, layer: int):
        """The layer's merged projections (float32, CPU), kept for take()."""
        from kvtool.convert.aware.attention import Proj

        return Proj.of(self._files.load(layer))

    def take(self, layer: int):
        """The layer's merged projections (float32, CPU), or None when there are none; removes them."""
        if layer not in self._pending:
            return None
        p = self.get(layer)
        self._files.path(layer).unlink()
        self._pending.discard(layer)
        if not self._pending:
            self.close()
        return p

    def close(self) -> None:
        self._files.close()
