"""Merge-method registry: how K/V heads are merged (or expanded) during `kvtool convert`.

One registration path: decorate a `MergeMethod` subclass with `@register_method("name")`;
`get_method(name, options)` builds it. Built-in and plug-in modules (listed in `_METHOD_MODULES`)
are imported on first lookup, so a module only has to exist to be found.

Lifecycle, called by the convert driver:
1. `method.prepare(job)` once before streaming (the calibrated "aware" method runs its
   calibration here, reading what it needs through `job`);
2. `method.merge_layer(layer, weights)` for every attention layer, in layer order; it returns new
   `AttentionWeights` with `num_kv_heads == weights.target_groups`. Methods may change q and o too
   (e.g. fold per-head coefficients into q rows and o columns), but must keep their shapes.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from kvtool.errors import UsageError

if TYPE_CHECKING:
    from kvtool.model.architectures import Architecture
    from kvtool.convert.layout import AttentionWeights
    from kvtool.io.reader import CheckpointReader
    from kvtool.model.spec import ModelSpec

# Modules that register methods; a missing one is skipped (plug-ins may not be installed).
_METHOD_MODULES = ("kvtool.convert.pooling", "kvtool.convert.aware")
_REGISTRY: dict[str, type["MergeMethod"]] = {}
_loaded = False


@dataclass
class MergeJob:
    """What a method may know about the conversion (read-only by convention)."""

    src: Path  # source model folder
    spec: "ModelSpec"  # source config, normalised
    arch: "Architecture"  # its architecture table
    target_groups: int  # KV heads after conversion
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

    def __init__(self, **options: Any):
        unknown = sorted(set(options) - set(self.option_names))
        if unknown:
            allowed = ", ".join(self.option_names) or "none"
            raise UsageError(f"method {self.name!r} does not take option(s) {', '.join(unknown)} (accepted: {allowed})",
                             option="method")
        self.options = dict(options)

    def prepare(self, job: MergeJob) -> None:
        """Called once before streaming; default: nothing to prepare."""

    def merge_layer(self, layer: int, w: "AttentionWeights") -> "AttentionWeights":
        raise NotImplementedError

    def provenance(self) -> dict:
        """Extra facts recorded in kvtool.json (e.g. calibration text hash)."""
        return {}


def register_method(name: str):
    """Class decorator: make a MergeMethod available as `--method name`."""

    def deco(cls: type[MergeMethod]) -> type[MergeMethod]:
        if not (isinstance(cls, type) and issubclass(cls, MergeMethod)):
            raise TypeError(f"@register_method({name!r}) must decorate a MergeMethod subclass")
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"merge method {name!r} is registered twice")
        cls.name = name
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_modules() -> None:
    global _loaded
    if _loaded:
        return
    for mod in _METHOD_MODULES:
        try:
            importlib.import_module(mod)
        except ModuleNotFoundError as exc:
            if exc.name != mod:
                raise
    _loaded = True


def available_methods() -> list[str]:
    _load_modules()
    return sorted(_REGISTRY)


def method_options(o) -> dict:
    """The merge method's options from a ConvertOptions (kvtool/options/convert.py): its --method-opt
    KEY=VALUE pairs and the aware method's own fields that are set (any other method refuses them by name)."""
    import json

    from kvtool.options.convert import AWARE_FIELDS

    out: dict = {}
    for item in o.method_opt:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise UsageError(f"expected KEY=VALUE, got {item!r}", option="method_opt")
        try:
            out[key.strip()] = json.loads(value)
        except ValueError:
            out[key.strip()] = value
    out.update({k: getattr(o, k) for k in AWARE_FIELDS if getattr(o, k) is not None})
    return out


def get_method(name: str, **options: Any) -> MergeMethod:
    """Instantiate a registered method; an unknown name is a usage error listing the choices."""
    _load_modules()
    cls = _REGISTRY.get(name)
    if cls is None:
        raise UsageError(f"unknown merge method {name!r}; choose from {', '.join(sorted(_REGISTRY))}", option="method")
    return cls(**options)
