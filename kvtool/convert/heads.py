"""The heads targets: `--to gqa --groups G | --to mqa | --to mha` change the number of KV heads, by a merge method
(kvtool/convert/methods.py) when pooling and by repeating heads when expanding; the plan and write are
kvtool/convert/driver.py's. Each says how many KV heads it means (`kv_heads`); everything else is shared."""

from __future__ import annotations

import json

from kvtool.convert.targets import Calibration, Target, register_target
from kvtool.errors import UsageError


def method_options(o) -> dict:
    """The merge method's options from a ConvertOptions: its --method-opt KEY=VALUE pairs and the method's own
    declared fields that are set (`ConvertOptions.METHOD_FIELDS`; a method that does not take one refuses it
    by name). A declared field is set by its own option, where its declaration checks it, never by KEY=VALUE."""
    out: dict = {}
    for item in o.method_opt:
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise UsageError(f"expected KEY=VALUE, got {item!r}", option="method_opt")
        if key in o.METHOD_FIELDS:
            raise UsageError(f"{key} has an option of its own; set it there, not with --method-opt",
                             option="method_opt")
        try:
            out[key] = json.loads(value)
        except ValueError:
            out[key] = value
    out.update({k: getattr(o, k) for k in o.METHOD_FIELDS if getattr(o, k) is not None})
    return out


class HeadsTarget(Target):
    """A KV-head count, reached by the merge method `o.method` (built here, with its options)."""

    # the KV-head count, the merge method's own options (--method itself has a default: Mla refuses another)
    fields = ("groups", "grouping", "method_opt")
    does = "converts KV heads"

    def __init__(self, o):
        from kvtool.convert.methods import get_method

        super().__init__(o)
        self.method = get_method(o.method, **method_options(o))

    @classmethod
    def calibration(cls, o) -> Calibration | None:
        """The merge method calibrates when it takes calibration text; a recipe step then owes it text."""
        from kvtool.convert.methods import METHODS

        return Calibration(required=True) if "calib_text" in METHODS.get(o.method).option_names else None

    def kv_heads(self, num_heads: int) -> int:
        """The KV heads this target means for a model of `num_heads` query heads (checked against the model by
        kvtool.convert.driver.resolve_target)."""
        raise NotImplementedError

    def plan(self, ckpt, *, max_shard_size: int, config: dict | None = None, tensors: dict | None = None):
        from kvtool.convert.driver import plan_checkpoint

        return plan_checkpoint(ckpt, target=self, method=self.method, dtype=self.options.dtype,
                               max_shard_size=max_shard_size, config=config, tensors=tensors)


@register_target("gqa")
class Grouped(HeadsTarget):
    def kv_heads(self, num_heads: int) -> int:
        if self.options.groups is None:
            raise UsageError("--to gqa needs --groups G (the number of KV heads after conversion)", option="groups")
        return self.options.groups


@register_target("mqa")
class MultiQuery(HeadsTarget):
    def kv_heads(self, num_heads: int) -> int:
        if self.options.groups not in (None, 1):
            raise UsageError("--to mqa means one KV head; drop --groups", option="groups")
        return 1


@register_target("mha")
class MultiHead(HeadsTarget):
    def kv_heads(self, num_heads: int) -> int:
        if self.options.groups not in (None, num_heads):
            raise UsageError(f"--to mha means {num_heads} KV heads (one per query head); drop --groups",
                             option="groups")
        return num_heads
