"""`--observer NAME[:ARG]` checked against the observer registry, without torch.

The registry entries carry the argument's meaning, default, range check and help; the observer
classes (torch maths, kvtool.quantize.observers) are imported only when an entry's `cls` is asked
for, so `kvtool quantize-kv --dry-run` and `kvtool apply --dry-run` refuse a bad spec alike before
torch is imported.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

from kvtool.errors import UsageError
from kvtool.registry import Registry

DEFAULT_OBSERVER = "absmax-pow2:2"


@dataclass(frozen=True)
class ObserverEntry:
    name: str
    impl: type | str  # the Observer subclass, or its name in kvtool.quantize.observers (imported when needed)
    arg: str | None  # what the ":arg" means, None when the observer takes none
    default_arg: float | None
    check: Callable[[float], bool] | None
    help: str

    @property
    def cls(self) -> type:
        if isinstance(self.impl, str):
            return getattr(importlib.import_module("kvtool.quantize.observers"), self.impl)
        return self.impl


# --observer NAME[:ARG] -> ObserverEntry
OBSERVERS: Registry[ObserverEntry] = Registry("observer", option="observer", choices=lambda: usage())


def declare(name: str, impl: type | str, *, arg: str | None = None, default: float | None = None,
            check: Callable[[float], bool] | None = None, help: str = "") -> None:
    OBSERVERS.add(name, ObserverEntry(name, impl, arg, default, check, help))


def parse_spec(spec: str) -> tuple[ObserverEntry, float | None]:
    """'percentile:99.9' -> (entry, 99.9); a one-line UsageError for anything else."""
    name, _, raw = (spec or "").strip().partition(":")
    entry = OBSERVERS.get(name, None)
    if entry is None:
        raise UsageError(OBSERVERS.unknown_message(spec), option="observer")
    if not raw:
        if entry.arg is not None and entry.default_arg is None:
            raise UsageError(f"observer {name!r} needs a value: {name}:{entry.arg}", option="observer")
        return entry, entry.default_arg
    if entry.arg is None:
        raise UsageError(f"observer {name!r} takes no value (got {spec!r})", option="observer")
    try:
        value = float(raw)
    except ValueError:
        raise UsageError(f"observer {name!r}: {entry.arg} must be a number, got {raw!r}", option="observer") from None
    if entry.check is not None and not entry.check(value):
        raise UsageError(f"observer {name!r}: {entry.arg} {value:g} is out of range ({entry.help})", option="observer")
    return entry, value


def canonical(spec: str) -> str:
    """The spec with its default argument spelled out ('absmax' -> 'absmax:1')."""
    entry, value = parse_spec(spec)
    return entry.name if value is None else f"{entry.name}:{value:g}"


def usage() -> list[str]:
    return [e.name if e.arg is None else f"{e.name}:{e.arg}" if e.default_arg is None else f"{e.name}[:{e.arg}]"
            for e in OBSERVERS.values()]


def _headroom(h: float) -> bool:
    return 1.0 <= h <= 448.0


# the built-in observers (classes in kvtool.quantize.observers, described there)
declare("absmax", "AbsMaxObserver", arg="H", default=1.0, check=_headroom,
        help="headroom factor, 1 <= H <= 448; scale = H * amax / fmax")
declare("absmax-pow2", "AbsMaxPow2Observer", arg="H", default=2.0, check=_headroom,
        help="headroom factor, 1 <= H <= 448; scale = H * amax / fmax rounded up to a power of two")
declare("percentile", "PercentileObserver", arg="P", check=lambda p: 50.0 <= p <= 100.0, help="50 <= P <= 100")
declare("mse", "MseObserver", help="minimise FP8 quantization MSE")
declare("attn-out", "AttentionOutputObserver", arg="H", default=2.0, check=_headroom,
        help="headroom factor, 1 <= H <= 448; the scale in [H, 2H) * amax / fmax whose attention output "
             "is closest to the unquantized one")
