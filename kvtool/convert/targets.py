"""Conversion targets: what `kvtool convert --to NAME` converts to, one registered class per target.

One registration path (kvtool.registry): decorate a `Target` subclass with `@register_target("name")` in a module
listed in `TARGETS.modules`. Each target owns what differs between targets, so no caller asks which one it holds
(tests/convert/test_targets.py greps the package for `to == "mla"` and its kind):

- `fields`: the convert options that belong to this target alone (`--kv-rank` ... for mla); any other target
  refuses them by name, in `Target.__init__`;
- `calibration(o)`: whether the conversion calibrates on text, and whether a recipe step owes it text
  (kvtool/recipes/plan.py resolves `calibration.text` relative to the recipe for a target that calibrates);
- `Target(o)`: the target's option refusals (the heads targets build their merge method here), before any model
  is opened; `.plan(ckpt, ...)`: the model's refusals and the plan, from config and headers only.

Every plan answers the same questions (`ConversionPlan` below): its headline, estimate, render, needs_torch,
write, provenance and details, so the front door (kvtool/convert/run.py), the command, the recipe planner and
runner call them without knowing the target. Anchors: mergekit's MergeMethod, llm-compressor's modifiers.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from kvtool.errors import UsageError
from kvtool.registry import Registry

if TYPE_CHECKING:
    from kvtool import console

# `--to NAME` -> Target subclass, in registration order (the choices `--to` lists); the modules register them.
TARGETS: Registry[type["Target"]] = Registry("conversion target", option="to",
                                             modules=("kvtool.convert.heads", "kvtool.convert.mla.target"))


def target_names() -> list[str]:
    """`--to`'s choices (kvtool/options/convert.py): the registered targets, in registration order."""
    return TARGETS.names()


@dataclass(frozen=True)
class Calibration:
    """A conversion that calibrates on text (`calib_text` / `calib_dataset`). required: a recipe step must name
    its text (`calibration.text` or `.dataset`); otherwise the target's default text is used."""

    required: bool


@dataclass
class ConversionResult:
    """What a plan's `write` returns: the plan, the folder written, its weight files, the side files copied and
    kvtool.json's record. `render()`: the command's last lines, in the plan's words."""

    plan: "ConversionPlan"
    dst: Path
    files: list[str]
    side_files: list[str]
    provenance: dict

    def render(self) -> "console.Text":
        return self.plan.render_result(self)


class ConversionPlan(Protocol):
    """What every target's plan answers (kvtool.convert.driver.ConvertPlan, kvtool.convert.mla.plan.MlaPlan)."""

    src: Path
    outputs: list  # the write plan: kvtool.io.writer.PlannedTensor, source order
    new_config: dict  # config.json as written
    warnings: list[str]

    @property
    def headline(self) -> str: ...  # one line: a recipe's plan line

    def estimate(self, eval_tokens: int | None = None) -> Any: ...  # kvtool.model.costs.Estimate or None

    def render(self, dst, eval_tokens: int | None = None) -> "console.Text": ...  # the --dry-run plan

    @property
    def needs_torch(self) -> str | None: ...  # what needs torch to run ("--to mla"), None: nothing does

    def check_kwargs(self) -> dict: ...  # what the output check needs beyond source= (engines=, accept=)

    def write(self, dst, *, verify, force: bool = False, progress: bool | None = None,
              device: str = "cpu") -> ConversionResult: ...  # verify: the staged output's check before publish

    def render_result(self, result: ConversionResult) -> "console.Text": ...  # the command's last lines

    def provenance(self, extra: dict | None = None) -> dict: ...  # kvtool.json

    def details(self) -> dict: ...  # a recipe report's step details


class Target:
    """Base class: subclasses set `name` (via the decorator), `fields`, `does` and implement `plan`."""

    name: ClassVar[str] = ""
    # Convert options (kvtool/options/convert.py field names) that belong to this target alone.
    fields: ClassVar[tuple[str, ...]] = ()
    # What the target does, for the refusal of another target's option: "--to gqa converts KV heads".
    does: ClassVar[str] = ""

    def __init__(self, o):
        """The target's option refusals (no model opened): another target's own options first."""
        self.options = o
        for f in dict.fromkeys(f for other in TARGETS.values() for f in other.fields):
            if f not in self.fields and getattr(o, f, None) not in (None, [], ()):  # [] : a repeatable option unset
                takers = [t.name for t in TARGETS.values() if f in t.fields]
                names = ", ".join(takers[:-1]) + f" or {takers[-1]}" if len(takers) > 1 else takers[0]
                raise UsageError(f"only --to {names} takes it (--to {self.name} {self.does})", option=f)

    @classmethod
    def calibration(cls, o) -> Calibration | None:
        """Whether converting with options `o` calibrates on text (None: it reads no text)."""
        return None

    def plan(self, ckpt, *, max_shard_size: int, config: dict | None = None,
             tensors: dict | None = None) -> ConversionPlan:
        raise NotImplementedError


def register_target(name: str):
    """Class decorator: make a Target available as `--to name`."""
    return TARGETS.register_subclass(name, Target)


def target_of(o) -> type[Target]:
    """The target class `o.to` names; an unknown name is a usage error listing the choices."""
    return TARGETS.get(o.to)
