"""Which tests need torch (the `torch` marker), read from their imports, so `pytest -m "not torch"` runs the
rest in seconds, with or without torch installed.

A test needs torch when it, or its module at top level, or a fixture of its module, imports torch /
transformers / accelerate / compressed-tensors or a module (kvtool's or a tests/ helper) that imports them at
top level; when it uses a real-model fixture (smollm2_path, gemma3_path); or when it is marked slow, oracle or
real_weights; when its file, name or parameters name a command or option that loads a model (quantize-kv,
eval, aware, calib-text). Other tests that reach torch only through the CLI carry `@pytest.mark.torch`.
"""

from __future__ import annotations

import ast
import functools
import re
import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCH_LIBS = frozenset({"torch", "transformers", "accelerate", "compressed_tensors"})
TORCH_FIXTURES = frozenset({"smollm2_path", "gemma3_path"})
TORCH_MARKS = ("torch", "slow", "oracle", "real_weights")
# Commands (and options) that load a model with transformers: a test named or parametrized after one of them
# runs torch through the CLI (the hostile tests run every command on one bad input).
TORCH_COMMAND_WORDS = re.compile(r"(?<![a-z])(quantize[-_]kv|eval|aware|calib[-_]text)(?![a-z])")


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module | None:
    try:
        return ast.parse(path.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None


def _names(nodes) -> set[str]:
    """Modules imported by these statements (and everything under them)."""
    out: set[str] = set()
    for node in nodes:
        for n in ast.walk(node):
            if isinstance(n, ast.Import):
                out.update(a.name for a in n.names)
            elif isinstance(n, ast.ImportFrom) and n.module and not n.level:
                out.add(n.module)
                out.update(f"{n.module}.{a.name}" for a in n.names)
            elif (isinstance(n, ast.Call) and getattr(n.func, "attr", None) == "importorskip" and n.args
                  and isinstance(n.args[0], ast.Constant) and isinstance(n.args[0].value, str)):
                out.add(n.args[0].value)  # pytest.importorskip("torch")
    return out


def _top_level(tree: ast.Module) -> list[ast.stmt]:
    """Statements that run at import (functions' and classes' bodies and `if TYPE_CHECKING:` excluded)."""
    out = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            continue
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            out += node.orelse
            continue
        out.append(node)
    return out


@functools.lru_cache(maxsize=None)
def _source(module: str) -> Path | None:
    """kvtool.x.y -> kvtool/x/y.py (or its __init__), a tests/ helper name -> tests/**/name.py."""
    parts = module.split(".")
    if parts[0] == "kvtool":
        base = REPO.joinpath(*parts)
        for p in (base.with_suffix(".py"), base / "__init__.py"):
            if p.is_file():
                return p
        return None
    if len(parts) == 1:
        hits = _test_modules().get(module)
        return hits[0] if hits else None
    return None


@functools.lru_cache(maxsize=None)
def _test_modules() -> dict[str, list[Path]]:
    """Every .py file under tests/ by its name, sorted (one walk of the tree, not one per import looked up)."""
    out: dict[str, list[Path]] = {}
    for p in sorted((REPO / "tests").rglob("*.py")):
        out.setdefault(p.stem, []).append(p)
    return out


@functools.lru_cache(maxsize=None)
def _imports(module: str) -> frozenset[str]:
    """What importing `module` imports at top level (kvtool's modules and tests/ helpers only)."""
    path = _source(module)
    tree = _tree(path) if path is not None else None
    return frozenset(_names(_top_level(tree))) if tree is not None else frozenset()


@functools.lru_cache(maxsize=None)
def heavy(module: str) -> bool:
    """Importing `module` imports torch (or transformers ...): a walk of the top-level import graph (each module's
    imports read once, a loop visited once)."""
    seen, todo = set(), [module]
    while todo:
        m = todo.pop()
        if m.split(".")[0] in TORCH_LIBS:
            return True
        if m not in seen:
            seen.add(m)
            todo.extend(_imports(m))
    return False


@functools.lru_cache(maxsize=None)
def module_is_heavy(path: Path) -> bool:
    """Importing the file at `path` imports torch (read once per file, not once per test)."""
    tree = _tree(path)
    return tree is not None and any(heavy(m) for m in _names(_top_level(tree)))


def needs_torch(item) -> bool:
    if any(item.get_closest_marker(m) for m in TORCH_MARKS):
        return True
    if TORCH_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    if TORCH_COMMAND_WORDS.search(f"{Path(str(item.fspath)).stem} {item.name}".replace("no-eval", "")):
        return True
    path = Path(str(item.fspath))
    tree = _tree(path)
    if tree is None:
        return False
    if module_is_heavy(path):
        return True
    name = getattr(item, "originalname", None) or item.name.split("[")[0]
    if _heavy_function(tree, name):
        return True
    # the fixtures it uses: defined in its module or in a conftest.py of its folder or above
    fixtures = tuple(getattr(item, "fixturenames", ()))
    trees = [tree] + [t for t in map(_tree, _conftests(path)) if t is not None]
    return any(_heavy_function(t, f) for t in trees for f in fixtures)


@functools.lru_cache(maxsize=None)
def _heavy_function(tree: ast.Module, name: str) -> bool:
    """A function of that name in the file imports torch in its body: read once per (file, name), not once per
    test (a parametrized test and a shared fixture are asked thousands of times)."""
    return any(heavy(m) for m in _names(_function_index(tree).get(name, ())))


@functools.lru_cache(maxsize=None)
def _function_index(tree: ast.Module) -> dict[str, list[ast.AST]]:
    """The functions (at any depth) of a parsed file by name, in ast.walk order: one walk per file, not per test."""
    out: dict[str, list[ast.AST]] = {}
    for n in ast.walk(tree):
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            out.setdefault(n.name, []).append(n)
    return out


@functools.lru_cache(maxsize=None)
def _conftests(path: Path) -> list[Path]:
    out = []
    for folder in path.parents:
        if folder == REPO:
            break
        if (folder / "conftest.py").is_file():
            out.append(folder / "conftest.py")
    return out
