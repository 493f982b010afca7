"""kvtool.registry.Registry: the one registration mechanism."""

from __future__ import annotations

import pytest

from kvtool.errors import UsageError
from kvtool.registry import Registry


def test_register_get_names_in_order():
    reg = Registry("widget", option="widget")

    @reg.register("b")
    def b():
        return 2

    reg.add("a", 1)
    assert reg.names() == ["b", "a"] and reg.get("a") == 1 and reg["b"] is b and "a" in reg and len(reg) == 2
    assert reg.get("zz", None) is None


def test_unknown_name_is_one_line_listing_the_known_names():
    reg = Registry("widget", option="widget")
    reg.add("x", 1)
    reg.add("y", 2)
    with pytest.raises(UsageError) as exc:
        reg.get("z")
    assert exc.value.option == "widget" and exc.value.line() == "widget: unknown widget 'z'; choose from x, y"
    custom = Registry("rule", unknown="unknown {kind} {name!r}; `kvtool rules` lists them", choices=lambda: [])
    with pytest.raises(UsageError, match=r"unknown rule 'KV1'; `kvtool rules` lists them"):
        custom.get("KV1")


def test_a_name_registered_twice_is_a_bug():
    reg = Registry("widget")
    reg.add("x", 1)
    reg.add("x", 1)  # the same thing again (a module imported twice) is harmless
    with pytest.raises(ValueError, match="widget 'x' registered twice"):
        reg.add("x", 2)
    reg.remove("x")
    assert reg.add("x", 2) == 2


PLUGINS = Registry("plug-in", modules=("kvtool_toy_plugin",))


def test_listed_modules_are_imported_on_first_lookup(tmp_path, monkeypatch):
    (tmp_path / "kvtool_toy_plugin.py").write_text("import test_registry\ntest_registry.PLUGINS.add('toy', 42)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert PLUGINS.registered() == {}  # nothing imported before the first lookup
    assert PLUGINS.get("toy") == 42 and PLUGINS.names() == ["toy"]


def test_a_listed_module_that_is_missing_is_an_error():
    reg = Registry("widget", modules=("kvtool.no_such_module",))
    with pytest.raises(ModuleNotFoundError):
        reg.names()
