"""Estimated peak memory and time of the heavy commands, from the measured cost model (no torch).

The coefficients are data (kvtool/model/costs.json), fitted by bench/scaling_bench.py and
bench/convert_bench.py on random-weight Llama checkpoints at 1B, 8B and 70B widths (docs/scaling.md).
Time is in CPU-core seconds (one thread, as measured); commands spread it over the machine's cores,
so the wall time is about that divided by the cores used. The model is linear where the
measurements are: per layer, in the layer's parameters times tokens (calibration, evaluation),
and in bytes for convert --method mean (a copy, plus pooling one layer's K/V at a time).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

COSTS_FILE = Path(__file__).with_name("costs.json")
_LAYER_NAME = re.compile(r"\.(\d+)\.")  # model.layers.12.mlp... / transformer.h.3.attn...


@lru_cache(maxsize=1)
def coefficients() -> dict:
    return json.loads(COSTS_FILE.read_text(encoding="utf-8"))


@dataclass(frozen=True)
class Shape:
    """What the costs depend on, from the config and the safetensors headers."""

    layers: int
    hidden: int
    layer_params: int  # mean parameters of one decoder layer
    other_params: int  # embeddings, lm_head, final norm
    attn_params: int  # q, k, v, o of one layer
    layer_kv_bytes: int  # stored bytes of one layer's k_proj + v_proj
    weight_bytes: int  # the checkpoint's tensor bytes
    vocab: int

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.other_params


def shape_of(spec, tensors: dict) -> Shape:
    """`tensors`: name -> header info with .shape and .nbytes (Checkpoint.tensors)."""
    from math import prod

    layers = spec.num_layers or 1
    hidden = spec.hidden_size or 0
    heads, kv, hd = spec.num_heads or 0, spec.num_kv_heads or spec.num_heads or 0, spec.head_dim or 0
    in_layers = other = weight_bytes = 0
    for name, info in tensors.items():
        n = prod(info.shape) if info.shape else 1
        weight_bytes += info.nbytes
        if _LAYER_NAME.search(name):
            in_layers += n
        else:
            other += n
    bytes_per = (weight_bytes / max(1, in_layers + other)) if tensors else 2
    return Shape(layers=layers, hidden=hidden, layer_params=in_layers // layers, other_params=other,
                 attn_params=2 * heads * hd * hidden + 2 * kv * hd * hidden,
                 layer_kv_bytes=int(2 * kv * hd * hidden * bytes_per), weight_bytes=weight_bytes,
                 vocab=int(spec.number("vocab_size") or 0))


@dataclass(frozen=True)
class Estimate:
    peak_bytes: float
    cpu_seconds: float  # one core; for a disk-bound run, seconds at the measured copy speed
    disk_bound: bool = False

    def line(self) -> str:
        """One line for a plan: '~1.20 GiB peak memory, ~3 min of one CPU core; ...' (machine-independent
        wording: commands spread CPU time over the cores torch uses)."""
        from kvtool.units import fmt_bytes

        how = "at the measured copy speed" if self.disk_bound else "of one CPU core"
        return (f"~{fmt_bytes(self.peak_bytes)} peak memory, ~{fmt_duration(self.cpu_seconds)} {how}; "
                "measured cost model, docs/scaling.md")


def fmt_duration(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


def convert_mean(shape: Shape) -> Estimate:
    c = coefficients()["convert_mean"]
    t = c["startup_s"] + shape.weight_bytes / c["copy_bytes_per_s"] + shape.layers * shape.layer_kv_bytes / c[
        "pool_bytes_per_s"]
    return Estimate(c["rss_base_bytes"] + c["rss_per_layer_kv_byte"] * shape.layer_kv_bytes, t, disk_bound=True)


def _layer_seconds(c: dict, shape: Shape, tokens: int) -> float:
    """One layer's calibration: handling its weights (read, widen), the forward over the tokens and,
    for the aware method, the closed-form solves (hidden^3; the term that dominates at 70B width)."""
    return (shape.layer_params * (c["s_per_param"] + tokens * c["s_per_param_token"])
            + c.get("s_per_hidden_cubed", 0.0) * shape.hidden ** 3)


def _calibration(c: dict, shape: Shape, tokens: int) -> Estimate:
    """Layer-by-layer replay: one decoder layer (fp32) and the embeddings resident, whatever the depth."""
    t = c["startup_s"] + shape.layers * _layer_seconds(c, shape, tokens)
    peak = (c["rss_base_bytes"] + c["rss_per_param"] * shape.other_params
            + c.get("rss_per_layer_param", c["rss_per_param"]) * shape.layer_params  # the resident layer
            + c.get("rss_per_hidden_squared", 0.0) * shape.hidden ** 2)  # aware: its float64 Gram matrices
    return Estimate(peak, t)


def convert_aware(shape: Shape, calib_tokens: int, seq_len: int, refine_steps: int = 0,
                  distill_steps: int = 0, original_stream: bool = False, grouping_passes: float = 0.0,
                  grouping_tokens: int = 0, grouping_heads: int = 0, grouping_groups: int = 0) -> Estimate:
    """original_stream: the original model runs alongside the calibration (refinement's default target,
    kvtool/convert/aware/merge.py); distillation runs it anyway. grouping_*: `--grouping error` merges
    grouping_groups candidate groups per layer in closed form and measures them in grouping_passes passes of the
    layer's attention over grouping_tokens tokens, keeping each of the grouping_heads KV heads' share of the
    layer's output over them (float32; kvtool.convert.aware.partition)."""
    c = coefficients()["convert_aware"]
    e = _calibration(c, shape, calib_tokens)
    t, peak = e.cpu_seconds, e.peak_bytes
    t += shape.layers * (grouping_passes * shape.attn_params * grouping_tokens * c["s_per_param_token"]
                         + grouping_groups * c.get("grouping_s_per_group", 0.0))
    peak += 4 * grouping_heads * grouping_tokens * shape.hidden
    if refine_steps:
        # a fixed part per refined layer (the fp32 copies, the optimizer, the loss before and after) and the steps
        t += shape.layers * shape.attn_params * (c["refine_fixed_s_per_attn_param"]
                                                 + refine_steps * seq_len * c["refine_step_s_per_attn_param_token"])
    if original_stream and not distill_steps:
        # one more pass of each layer over the calibration tokens; its hidden states and one layer's input (float32)
        t += shape.layers * shape.layer_params * calib_tokens * c["s_per_param_token"]
        peak += 2 * 4 * calib_tokens * shape.hidden
    if distill_steps:
        # the original model alongside the calibration, the KL before and after, and per step a forward, a
        # recomputed forward and a backward over one sequence, LM head included (kvtool/convert/aware/distill.py)
        per_token = (shape.layers * shape.layer_params + shape.vocab * shape.hidden) * c["s_per_param_token"]
        t += per_token * (3 * calib_tokens + distill_steps * min(seq_len, calib_tokens) * c["distill_step_passes"])
        # one sequence's kept layer inputs, the logits of one chunk of positions with their gradient, and one
        # layer's projections as stored, installed, their gradients, Adam moments and one temporary (float32)
        peak += (4 * shape.layers * min(seq_len, calib_tokens) * shape.hidden + 4 * 4 * 256 * shape.vocab
                 + 6 * 4 * shape.attn_params)
    return Estimate(peak, t)


def quantize_kv(shape: Shape, calib_tokens: int, eval_tokens: int = 0) -> Estimate:
    e = _calibration(coefficients()["quantize_kv"], shape, calib_tokens)
    if eval_tokens:  # the quality report evaluates source and output
        return combine(e, evaluate(shape, eval_tokens, models=2))
    return e


def combine(first: Estimate, *then: Estimate) -> Estimate:
    """Runs one after the other: the larger peak, the summed time."""
    runs = (first, *then)
    return Estimate(max(e.peak_bytes for e in runs), sum(e.cpu_seconds for e in runs),
                    disk_bound=all(e.disk_bound for e in runs))


def for_checkpoint(source) -> Shape:
    """The Shape of a model folder, from config.json and the safetensors headers (no weights read)."""
    from kvtool.model.checkpoint import open_checkpoint
    from kvtool.model.spec import build_spec

    ckpt = open_checkpoint(source, read_side_files=False)
    return shape_of(build_spec(ckpt.config), ckpt.tensors)


SEGMENT_BYTES = 512 * 2**20  # hidden states one forward path keeps per segment of windows (kvtool.eval.layerwise)
LAYER_WORK_BYTES = 64 * 2**20  # one layer's temporaries and the logit chunks, at the default window


def evaluate(shape: Shape, tokens: int, models: int = 1) -> Estimate:
    """Perplexity of `models` models (candidate, and baseline when given) in float32 on CPU, one decoder layer
    at a time (kvtool.eval.layerwise): the time is the whole-model cost measured by the bench (the layer-by-
    layer path costs 4-6% more CPU, docs/memory.md); the memory is one layer, the LM heads of all models
    (their logits are compared side by side) and each model's hidden states of the tokens, whatever the depth."""
    c = coefficients()["eval"]
    per_model = (shape.params * c["s_per_param"]  # loading, in float32
                 + tokens * (shape.layers * shape.layer_params + shape.vocab * shape.hidden) * c["s_per_param_token"])
    resident = 4 * (shape.layer_params + models * shape.vocab * shape.hidden)
    peak = (c["rss_base_bytes"] + resident + models * min(4 * tokens * shape.hidden, SEGMENT_BYTES)
            + LAYER_WORK_BYTES)
    return Estimate(peak, c["startup_s"] + models * per_model)
