"""Will an evaluation fit in memory? Decided from the safetensors headers, before any weight is read.

Available memory: the smaller of /proc/meminfo MemAvailable and the cgroup's limit minus its usage
(v2 memory.max / memory.current, v1 memory.limit_in_bytes / memory.usage_in_bytes): a container's
limit is invisible to MemAvailable. KVTOOL_MEMORY_LIMIT (e.g. 8GiB) replaces the measurement (a
budget to stay under, and how the tests force a small machine).

Needed memory, at the evaluation dtype (fp32 on CPU doubles a bf16 checkpoint):
- layer by layer (kvtool.eval.layerwise): the largest decoder layer, or the largest tensor outside
  the layers (the LM head / embedding) of every model together (layers and heads are never resident
  together; the heads of a baseline and a candidate are, for their logits side by side), plus the hidden states
  of one segment of windows for every forward path and one batch's activations inside a layer;
- whole model: every distinct model's weights plus one batch's activations.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from kvtool.errors import InputError, UsageError
from kvtool.units import plain_int

LIMIT_ENV = "KVTOOL_MEMORY_LIMIT"
_LAYER_RE = re.compile(r"(?:^|\.)(?:layers|h|blocks|block)\.(\d+)\.")
_FLOAT = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1}
GiB = 2**30
WHOLE = "every weight resident"


@dataclass(frozen=True)
class WeightSizes:
    """Bytes of one checkpoint's tensors at the evaluation dtype (integer tensors keep theirs)."""

    total: int
    largest_layer: int
    largest_other: int  # the largest tensor outside the decoder layers (LM head or embedding)
    layers: int


def weight_sizes(tensors, elem_bytes: int) -> WeightSizes:
    """From a {name: TensorInfo} of safetensors headers (kvtool.model.checkpoint)."""
    per_layer: dict[int, int] = {}
    total = other = 0
    for name, info in tensors.items():
        n = info.numel * elem_bytes if info.dtype in _FLOAT else info.nbytes
        total += n
        m = _LAYER_RE.search(name)
        if m:
            per_layer[int(m.group(1))] = per_layer.get(int(m.group(1)), 0) + n
        else:
            other = max(other, n)
    return WeightSizes(total, max(per_layer.values(), default=0), other, len(per_layer))


def available_bytes() -> tuple[int, str]:
    """(bytes this process may still use, where the figure comes from)."""
    from kvtool.units import parse_size

    forced = os.environ.get(LIMIT_ENV)
    if forced:
        try:
            return parse_size(forced), LIMIT_ENV
        except ValueError as exc:
            raise UsageError(str(exc), field=LIMIT_ENV) from None
    best, source = _meminfo_available(), "MemAvailable"
    cg = _cgroup_headroom()
    if cg is not None and (best is None or cg < best):
        best, source = cg, "cgroup limit"
    return (best if best is not None else 2**62), source


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_headroom(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """The cgroup's limit minus its usage, or None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit = (root / limit_file).read_text().strip()
            usage = plain_int((root / usage_file).read_text().strip(), max_digits=30)
        except (OSError, ValueError):
            continue
        if usage is None:
            continue
        bound = plain_int(limit, max_digits=30)
        if bound is None or bound >= 2**60:  # "max"; v1's "no limit" is ~2**63
            return None
        return max(0, bound - usage)
    return None


def gib(n: int) -> str:
    if n < GiB:
        return f"{n / 2**20:.1f} MiB"
    return f"{n / GiB:.2f} GiB" if n < 10 * GiB else f"{n / GiB:.0f} GiB"


@dataclass(frozen=True)
class Need:
    weights: int
    activations: int
    what: str  # how the weights are held, for the message

    @property
    def total(self) -> int:
        return self.weights + self.activations


def layerwise_need(sizes: list[WeightSizes], activations: int) -> Need:
    """One model's layer at a time, but the LM heads of all models together (the logits of a chunk are
    computed side by side)."""
    return Need(max(max(s.largest_layer for s in sizes), sum(s.largest_other for s in sizes)), activations,
                "one decoder layer at a time")


def whole_need(sizes: list[WeightSizes], activations: int) -> Need:
    return Need(sum(s.total for s in sizes), activations, WHOLE)


def refuse_if_too_big(need: Need, *, file: str, elem_bytes: int, layerwise_possible: bool) -> None:
    """One-line InputError (exit 2) naming the memory needed and the option that makes it fit."""
    have, source = available_bytes()
    if need.total <= have:
        return
    fix = _fix(need, have, elem_bytes, layerwise_possible)
    raise InputError(f"evaluating ({need.what}) needs about {gib(need.total)} of memory ({gib(need.weights)} of "
                     f"weights, {gib(need.activations)} of activations) and {gib(have)} is available ({source}); "
                     f"{fix}", file=file, field="memory")


def _fix(need: Need, have: int, elem_bytes: int, layerwise_possible: bool) -> str:
    if layerwise_possible and need.what == WHOLE:
        return "evaluate it one decoder layer at a time (the default for model folders without --device-map)"
    if not layerwise_possible:
        return ("--device-map auto loads it with accelerate, which puts what does not fit (--max-memory) on the "
                "GPUs or offloads it to disk")
    half = need.weights // (elem_bytes // 2) if elem_bytes > 2 else need.weights
    if half < need.weights and half + need.activations <= have:
        return f"--dtype bf16 halves the weights (about {gib(half + need.activations)})"
    if need.weights < have:
        return "a smaller --max-length or --batch-size shrinks the activations"
    if half < have:
        return "--dtype bf16 with a smaller --max-length or --batch-size"
    return "no option makes one layer fit here: serve it over several GPUs with vLLM (docs/multi-node.md)"


def activation_bytes(config: dict, *, batch: int, length: int, paths: int, segment_tokens: int,
                     elem_bytes: int, chunk_elements: int) -> int:
    """Hidden states of a segment for every forward path + one batch through one layer + logits chunks."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    h = int(text.get("hidden_size") or 0)
    inter = int(text.get("intermediate_size") or 4 * h)
    heads = int(text.get("num_attention_heads") or 1)
    vocab = int(text.get("vocab_size") or 0)
    hidden = paths * segment_tokens * h * elem_bytes
    in_layer = batch * length * (3 * inter + heads * length + 4 * h) * elem_bytes
    # float32 logits of one chunk per path, and the log-softmax temporaries of a pair (kvtool.eval.metrics)
    logits = (paths + 2) * min(chunk_elements, batch * length * vocab) * 4
    return hidden + in_layer + logits
