"""One registration mechanism for every extension point (commands, lint rules, merge methods, conversion targets,
RoPE types, layer-type resolvers, gates, output formats).

A `Registry` maps names to things, in registration order. It is filled by `@REG.register(name)` (or
`REG.add(name, thing)`) in the modules listed in `modules`: those are imported, explicitly and by name, on the
first lookup, so a registry that needs torch-backed entries costs nothing until asked, and nothing scans a
folder. A listed module that does not exist is an error, never a silently shorter list.

    METHODS = Registry("merge method", option="method", modules=("kvtool.convert.pooling",))

    @METHODS.register("mean")
    class MeanMerge(MergeMethod): ...

    METHODS.get("mean")   # the class; an unknown name is one UsageError line listing the known names
    METHODS.names()       # ["mean", ...]
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

T = TypeVar("T")
_MISSING = object()


class Registry(Mapping, Generic[T]):
    """Names -> things. Read like a dict (`in`, `[]`, iteration, `items()`); `get` without a default raises
    the one-line "unknown ..." error. Registering a name twice is a bug (ValueError)."""

    def __init__(self, kind: str, *, option: str | None = None, modules: tuple[str, ...] = (),
                 choices: Callable[[], list[str]] | None = None, unknown: str | None = None):
        self.kind = kind  # "merge method": words for the error line
        self.option = option  # the options field the name was given in ("method"; the CLI shows --method)
        self.modules = tuple(modules)  # imported on first lookup; each registers its entries
        self._choices = choices  # how the error lists the names (default: names())
        # the error line: {kind}, {name!r} and {choices} are filled in
        self._unknown = unknown or "unknown {kind} {name!r}; choose from {choices}"
        self._items: dict[str, T] = {}
        self._loading = False
        self._loaded = not self.modules

    # --- registering -------------------------------------------------------------------------
    def add(self, name: str, thing: T) -> T:
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.kind} needs a non-empty name, got {name!r}")
        if name in self._items and self._items[name] is not thing:
            raise ValueError(f"{self.kind} {name!r} registered twice")
        self._items[name] = thing
        return thing

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator: `@REG.register("name")` on a class or function."""
        def deco(thing: T) -> T:
            return self.add(name, thing)
        return deco

    def register_subclass(self, name: str, base: type) -> Callable:
        """Class decorator for a registry of classes: the class must subclass `base`; it is registered under
        `name` and told its name (`cls.name`), e.g. `@register_method("mean")`, `@register_target("mla")`."""
        def deco(cls):
            if not (isinstance(cls, type) and issubclass(cls, base)):
                raise TypeError(f"a {self.kind} {name!r} must be a {base.__name__} subclass")
            self.add(name, cls)
            cls.name = name
            return cls
        return deco

    def remove(self, name: str) -> None:
        """Take an entry out again (tests that register a test-local one clean up with it)."""
        self._items.pop(name, None)

    def registered(self) -> Mapping[str, T]:
        """What is registered so far, without importing `modules` (for checks made while they register)."""
        return dict(self._items)

    # --- looking up --------------------------------------------------------------------------
    def load(self) -> None:
        """Import the modules that register entries (once; a missing module is ModuleNotFoundError)."""
        if self._loaded or self._loading:
            return
        self._loading = True  # a listed module may look its own registry up while it is imported
        try:
            for mod in self.modules:
                importlib.import_module(mod)
            self._loaded = True
        finally:
            self._loading = False

    def get(self, name: str, default=_MISSING) -> T:
        """The entry; unknown: `default` when one is given, else a UsageError naming the known names."""
        self.load()
        if name in self._items:
            return self._items[name]
        if default is not _MISSING:
            return default
        from kvtool.errors import UsageError

        raise UsageError(self.unknown_message(name), option=self.option)

    def unknown_message(self, name) -> str:
        choices = self._choices() if self._choices else self.names()
        return self._unknown.format(kind=self.kind, name=name, choices=", ".join(choices))

    def names(self) -> list[str]:
        self.load()
        return list(self._items)

    def __getitem__(self, name: str) -> T:
        self.load()
        return self._items[name]

    def __contains__(self, name) -> bool:
        self.load()
        return name in self._items

    def __iter__(self) -> Iterator[str]:
        self.load()
        return iter(list(self._items))

    def __len__(self) -> int:
        self.load()
        return len(self._items)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, {list(self._items)})"
