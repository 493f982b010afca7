"""`kvtool apply`: every option, declared once (it runs recipes; it is no recipe step)."""

from __future__ import annotations

from kvtool.options.fields import argument, operation, option
from kvtool.progress import FLAG_HELP

FORMATS = ("text", "json")
DEVICES = ("auto", "cpu", "cuda", "cuda:N")


@operation("apply", recipe=False)
class ApplyOptions:
    recipe: str = argument(help="Recipe YAML file (see recipes/).")
    src: str = argument(help="Source model folder (never modified).")
    dst: str = argument(help="Output folder; created only when every step and gate passes.")
    dry_run: bool = option(False, help="Validate the recipe against SRC and print the plan; do no work.")
    keep_intermediate: bool = option(False, help="Keep each step's output in DST.intermediate/.")
    force: bool = option(False, help="Replace a non-empty DST.")
    device: str = option("auto", choices=DEVICES, pattern=r"auto|cpu|cuda(:[0-9]{1,3})?",
                         help="auto | cpu | cuda | cuda:N for steps that run the model.")
    format: str = option("text", choices=FORMATS, help="text | json (the run report on stdout).")
    progress: bool | None = option(None, negatable=True, help=FLAG_HELP)
