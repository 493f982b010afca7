"""Merge-method registry: how K/V heads are merged (or expanded) during `kvtool convert`.

One registration path (kvtool.registry): decorate a `MergeMethod` subclass with `@register_method("name")`
in a module listed in `METHODS.modules`; `get_method(name, **options)` builds it. The listed modules are
imported on first lookup (a missing one is an error).

Lifecycle, called by the convert driver:
1. `method.prepare(job)` once before streaming (the calibrated "aware" method runs its
   calibration here, reading what it needs through `job`);
2. `method.merge_layer(layer, weights)` for every attention layer, in layer order; it returns new
   `AttentionWeights` with `num_kv_heads == weights.target_kv_heads`. Methods may change q and o too
   (e.g. fold per-head coefficients into q rows and o columns), but must keep their shapes.

A method also describes itself to the plan: `summary()` (the `method` line of `--dry-run`) and
`estimate(plan, shape)` (its peak memory and time, kvtool.model.costs), so the report has no per-method code.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvtool.errors import UsageError
from kvtool.registry import Registry

if TYPE_CHECKING:
    from kvtool.model.architectures import Architecture
    from kvtool.convert.layout import AttentionWeights
    from kvtool.io.reader import CheckpointReader
    from kvtool.model.spec import ModelSpec

# `--method NAME` -> MergeMethod subclass; the modules below register the built-in ones.
METHODS: Registry[type["MergeMethod"]] = Registry("merge method", option="method",
                                                  modules=("kvtool.convert.pooling", "kvtool.convert.aware"),
                                                  choices=lambda: sorted(METHODS))


@dataclass
class MergeJob:
    """What a method may know about the conversion (read-only by convention)."""

    src: Path  # source model folder
    spec: "ModelSpec"  # source config, normalised
    arch: "Architecture"  # its architecture table
    target_kv_heads: int  # KV heads after conversion
    device: str = "cpu"  # "cuda" when available, for methods that compute
    dtype: Any = None  # torch dtype of the output tensors (None: keep the stored dtype)
    options: dict = field(default_factory=dict)  # method options: calib_text, calib_tokens, refine_steps, grouping ...
    reader: "CheckpointReader | None" = None  # the source tensors, for methods that read more than one layer

    @property
    def num_layers(self) -> int:
        return int(self.spec.num_layers or 0)


class MergeMethod:
    """Base class: subclasses set `name` (via the decorator) and implement `merge_layer`."""

    name: ClassVar[str] = ""
    # Option names this method accepts (others are refused, so a typo is an error).
    option_names: ClassVar[tuple[str, ...]] = ()
    # True when the result is only an approximation of the source (shown in the plan and kvtool.json).
    approximate: ClassVar[bool] = True
    # "torch": AttentionWeights hold CPU torch tensors in the stored dtype. "numpy": float32 numpy
    # arrays (float64 for F64 checkpoints), and torch is never imported (the mean method).
    array_api: ClassVar[str] = "torch"
    # AttentionWeights fields the method reads (None: all). The driver reads only these (and the
    # fused tensors holding them); the others are shape-only placeholders that the method must
    # return unchanged, and they are then copied file to file, never loaded.
    reads: ClassVar[frozenset[str] | None] = None
    # numpy methods: safetensors dtypes taken as storage arrays, not widened to float
    # (AttentionWeights.storage; BF16 as uint16): the widening cost more than the pooling.
    storage_dtypes: ClassVar[tuple[str, ...]] = ()

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            allowed = ", ".join(self.option_names) or "none"
            raise UsageError(f"method {self.name!r} does not take option(s) {', '.join(unknown)} (accepted: {allowed})",
                             option="method")
        self.options = dict(options)

    def summary(self) -> str:
        """One line for the plan: what this method will do (by default the first line of its docstring)."""
        return (type(self).__doc__ or self.name).strip().splitlines()[0].rstrip(".")

    def estimate(self, plan, shape):
        """Peak memory and time of merging `plan` (a kvtool.convert.driver.ConvertPlan that pools), a
        kvtool.model.costs.Estimate from the cost model's `shape` of the model; None: no cost model."""
        return None

    def prepare(self, job: MergeJob) -> None:
        """Called once before streaming; default: nothing to prepare."""

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        raise NotImplementedError

    def provenance(self) -> dict:
        """Extra facts recorded in kvtool.json (e.g. calibration text hash)."""
        return {}


def register_method(name: str):
    """Class decorator: make a MergeMethod available as `--method name`."""
    return METHODS.register_subclass(name, MergeMethod)


def available_methods() -> list[str]:
    return sorted(METHODS.names())


def get_method(name: str, **options: Any) -> MergeMethod:
    """Instantiate a registered method; an unknown name is a usage error listing the choices."""
    return METHODS.get(name)(**options)
