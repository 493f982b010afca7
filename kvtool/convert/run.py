"""Convert's front door: `plan(options)` makes every refusal from the options, the config and the safetensors
headers (no tensor read), `apply(plan, dst)` writes. `kvtool convert`, a recipe's convert step (planned by
`kvtool apply --dry-run`, then run) and the Python API call these two, nothing else:

    from kvtool.convert.run import apply, plan
    from kvtool.options.convert import ConvertOptions

    p = plan(ConvertOptions(src="model", to="gqa", groups=2))
    apply(p, "model-gqa2")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from kvtool.convert.driver import ConvertPlan, ConvertResult, plan_checkpoint, write
from kvtool.errors import InputError, UsageError


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


def plan(o, *, ckpt=None, config: dict | None = None, tensors: dict | None = None) -> ConvertPlan:
    """Every refusal of the conversion `o` (a kvtool.options.convert.ConvertOptions) describes, in this order:
    the options (their declaration, the shard size, the merge method and its options), then the model.

    ckpt: an opened checkpoint (default: o.src, opened and preflighted here). A recipe plans a step on the
    model as its earlier steps leave it: `config` and `tensors` (name -> dtype / shape) of that model."""
    from kvtool.convert.methods import get_method
    from kvtool.units import parse_size

    o.check()  # the declared choices and bounds, again after a caller's edits (kvtool/options/fields.py)
    try:
        shard_bytes = parse_size(o.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc), option="max_shard_size") from None
    if shard_bytes <= 0:
        raise UsageError("must be positive", option="max_shard_size")
    from kvtool.convert.mla.plan import refuse_options_for_other_targets

    refuse_options_for_other_targets(o)
    method = get_method(o.method, **method_options(o)) if o.to != "mla" else None  # --to mla solves, never merges
    src = None
    if ckpt is None:
        from kvtool.model.preflight import preflight

        src = Path(o.src)
        if not src.is_dir():
            raise InputError("SRC must be a model folder (config.json + safetensors)", file=str(o.src))
        ckpt = preflight(src)  # corrupt weights, escaping index, pickles only: refused before any read
    if o.to == "mla":
        from kvtool.convert.mla.plan import plan_mla

        p = plan_mla(o, ckpt, max_shard_size=shard_bytes, config=config, tensors=tensors)
        if src is not None:
            p.src = src
        return p
    p = plan_checkpoint(ckpt, to=o.to, groups=o.groups, method=method, dtype=o.dtype, max_shard_size=shard_bytes,
                        config=config, tensors=tensors)
    if src is not None:
        p.src = src  # as the user wrote it: the dry-run and provenance name it so
    return p


def apply(p: ConvertPlan, dst: str | Path, *, verify: Callable[[Path], None] | None, force: bool = False,
          progress: bool | None = None, device: str = "cpu") -> ConvertResult:
    """Write the planned conversion to `dst` (staged, then renamed; the source is only read). `verify`: the
    check the staged output must pass before it is published (`partial(kvtool.rules.output_check.verify_output,
    source=SRC)`: convert cannot import lint, so its callers pass it; kvtool.io.staging.staged_output)."""
    if getattr(p, "target", None) == "mla":
        from kvtool.convert.mla.plan import write_mla

        return write_mla(p, dst, force=force, progress=progress, device=device, verify=verify)
    return write(p, dst, force=force, progress=progress, device=device, verify=verify)
