"""Convert's front door: `plan(options)` makes every refusal from the options, the config and the safetensors
headers (no tensor read), `apply(plan, dst)` writes. `kvtool convert`, a recipe's convert step (planned by
`kvtool apply --dry-run`, then run) and the Python API call these two, nothing else:

    from kvtool.convert.run import apply, plan
    from kvtool.options.convert import ConvertOptions

    p = plan(ConvertOptions(src="model", to="gqa", groups=2))
    apply(p, "model-gqa2")
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from kvtool.convert.targets import ConversionPlan, target_of
from kvtool.errors import InputError, UsageError


def plan(o, *, ckpt=None, config: dict | None = None, tensors: dict | None = None) -> ConversionPlan:
    """Every refusal of the conversion `o` (a kvtool.options.convert.ConvertOptions) describes, in this order:
    the options (their declaration, the shard size, the target's own: another target's options, the merge
    method and its options), then the model.

    ckpt: an opened checkpoint (default: o.src, opened and preflighted here). A recipe plans a step on the
    model as its earlier steps leave it: `config` and `tensors` (name -> dtype / shape) of that model."""
    from kvtool.units import parse_size

    o.check()  # the declared choices and bounds, again after a caller's edits (kvtool/options/fields.py)
    try:
        shard_bytes = parse_size(o.max_shard_size)
    except ValueError as exc:
        raise UsageError(str(exc), option="max_shard_size") from None
    if shard_bytes <= 0:
        raise UsageError("must be positive", option="max_shard_size")
    target = target_of(o)(o)  # --to's registered target, built with the options it checks
    src = None
    if ckpt is None:
        from kvtool.model.preflight import preflight

        src = Path(o.src)
        if not src.is_dir():
            raise InputError("SRC must be a model folder (config.json + safetensors)", file=str(o.src))
        ckpt = preflight(src)  # corrupt weights, escaping index, pickles only: refused before any read
    p = target.plan(ckpt, max_shard_size=shard_bytes, config=config, tensors=tensors)
    if src is not None:
        p.src = src  # as the user wrote it: the dry-run and provenance name it so
    return p


def apply(p: ConversionPlan, dst: str | Path, *, verify: Callable[[Path], None] | None, force: bool = False,
          progress: bool | None = None, device: str = "cpu"):
    """Write the planned conversion to `dst` (staged, then renamed; the source is only read). `verify`: the
    check the staged output must pass before it is published (`partial(kvtool.rules.output_check.verify_output,
    source=SRC, **p.check_kwargs())`: convert cannot import lint, so its callers pass it, with what the plan says
    its check needs, the releases it was written for; kvtool.io.staging.staged_output). Any callable taking the
    folder will do; None publishes unchecked (the caller's explicit choice)."""
    return p.write(dst, force=force, progress=progress, device=device, verify=verify)
