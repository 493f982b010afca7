"""Package layering, read from every module's imports (ast; imports inside functions count too).

- the core (kvtool.model, kvtool.io and the small shared modules) imports no feature package;
- no two packages import each other, directly or around a longer loop;
- typer only under kvtool/commands/ and kvtool/cli.py;
- nothing in the package imports kvtool.testing (the tests' helper names).
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvtest import REPO

PACKAGE = REPO / "kvtool"
CORE = ("kvtool.model", "kvtool.io", "kvtool.errors", "kvtool.units", "kvtool.values", "kvtool.progress",
        "kvtool.registry", "kvtool.console")
# typer's home; kvtool/rope/command.py is the one module left outside it (issue 15: h15opt moves it)
TYPER_ALLOWED = ("kvtool.commands", "kvtool.cli")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[str, int]]:
    """(imported module, line) for every import in the file, relative ones resolved."""
    name = _module_name(path)
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[:len(here) - node.level + 1] + ([node.module] if node.module else []))
            out.append((base, node.lineno))
            out += [(f"{base}.{a.name}", node.lineno) for a in node.names]  # `from kvtool.io import preflight`
    return out


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
IMPORTS = {m: _imports(p) for m, p in MODULES.items()}


def _package(module: str) -> str:
    """kvtool.model.rope.types -> kvtool.model; kvtool.cli -> kvtool.cli."""
    return ".".join(module.split(".")[:2])


def _internal(target: str) -> str | None:
    """The kvtool module an import names (a name imported from a module counts as that module)."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target or None


def _package_graph() -> dict[str, dict[str, list[str]]]:
    graph: dict[str, dict[str, list[str]]] = {}
    for mod, imports in IMPORTS.items():
        for target, line in imports:
            t = _internal(target) if target.startswith("kvtool") else None
            if t and _package(t) != _package(mod):
                graph.setdefault(_package(mod), {}).setdefault(_package(t), []).append(f"{mod}:{line} -> {t}")
    return graph


def _cycles(graph) -> list[list[str]]:
    """Strongly connected components with more than one package (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_the_scan_sees_the_package():
    # a scan that found nothing would pass every check below
    assert len(MODULES) > 100 and "kvtool.model.spec" in MODULES
    assert "kvtool.model.architectures" in {t for t, _ in IMPORTS["kvtool.model.spec"]}
    assert "kvtool.rules" in _package_graph()["kvtool.rope"]  # rope.apply lints the new config, in a function


def test_every_kvtool_import_names_a_module_that_exists():
    # function-level imports fail only when run: a module moved (kvtool.model.preflight -> kvtool.model.preflight)
    # and an import left behind in a rarely taken branch is caught here
    bad = []
    for mod, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("kvtool"):
                targets = [node.module]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names if a.name.startswith("kvtool")]
            else:
                continue
            bad += [f"{mod}:{node.lineno} imports {t}" for t in targets if t not in MODULES]
    assert bad == []


def test_core_imports_no_feature():
    bad = [f"{mod}:{line} imports {t}" for mod, imports in IMPORTS.items() if _package(mod) in CORE
           for target, line in imports if target.startswith("kvtool")
           for t in [_internal(target)] if t and _package(t) not in CORE]
    assert bad == []


def test_no_import_cycle_between_packages():
    graph = _package_graph()
    found = _cycles(graph)
    detail = [edge for comp in found for a in comp for b in comp if b in graph.get(a, {}) for edge in graph[a][b]]
    assert found == [], detail


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b": []}, "b": {"c": []}, "c": {"a": []}, "d": {"a": []}}) == [["a", "b", "c"]]


def test_typer_only_in_the_command_layer():
    bad = [f"{mod}:{line}" for mod, imports in IMPORTS.items() for target, line in imports
           if target.split(".")[0] == "typer" and not mod.startswith(TYPER_ALLOWED)]
    assert bad == []


def test_nothing_in_the_package_imports_kvtool_testing():
    bad = [f"{mod}:{line}" for mod, imports in IMPORTS.items() if not mod.startswith("kvtool.testing")
           for target, line in imports if target.startswith("kvtool.testing")]
    assert bad == []


def test_registries_are_filled_by_named_imports_not_folder_scans():
    scanning = [m for m, imports in IMPORTS.items() if any(t == "pkgutil" for t, _ in imports)]
    assert scanning == []


def test_every_rule_module_is_a_listed_topic():
    from kvtool.rules.registry import TOPICS

    defining = {m for m, p in MODULES.items() if m.startswith("kvtool.rules.") and m != "kvtool.rules.registry"
                and ("define(" in p.read_text(encoding="utf-8") or "@checker(" in p.read_text(encoding="utf-8"))}
    assert defining == set(TOPICS)
