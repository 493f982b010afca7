"""Every file kvtool writes goes through kvtool/io/outputfile.py (O_EXCL | O_NOFOLLOW, fresh names, checked copies).

Read from every module's AST, as tests/package/test_layering.py reads imports: a call that creates, opens for
writing, copies, moves, links or re-permissions a file by path anywhere else in the package fails here,
naming the module and line. The few exceptions say why they cannot be reached through a model folder.
"""

from __future__ import annotations

import ast
from pathlib import Path

from kvtest import REPO

PACKAGE = REPO / "kvtool"
PRIMITIVE = "kvtool/io/outputfile.py"

# os.<name>(...) that write through a path
OS_WRITES = {"replace", "rename", "renames", "link", "symlink", "mkdir", "makedirs", "mknod", "mkfifo", "truncate",
             "chmod", "chown", "lchown", "utime", "removexattr", "setxattr"}
SHUTIL_WRITES = {"copy", "copy2", "copyfile", "copytree", "copystat", "copymode", "move"}
TEMPFILE_WRITES = {"mkstemp", "NamedTemporaryFile", "SpooledTemporaryFile", "TemporaryFile"}
# methods that write by path (pathlib, numpy, torch, safetensors, transformers, matplotlib)
METHOD_WRITES = {"write_text", "write_bytes", "mkdir", "touch", "symlink_to", "hardlink_to", "rename",
                 "save_pretrained", "save_file", "savefig", "to_json_file", "savez", "savez_compressed"}
MODULE_SAVES = {("np", "save"), ("numpy", "save"), ("torch", "save")}
OPEN_FLAGS_WRITE = {"O_WRONLY", "O_RDWR", "O_CREAT", "O_TRUNC", "O_APPEND"}

# (module, call) -> why it is not a way in for a model folder
ALLOWED = {
    ("kvtool/convert/aware/spill.py", "save_file"): "into a folder of its own from tempfile.mkdtemp (mode 0700, "
                                                    "random name): nothing can be planted there",
    ("kvtool/rope/show.py", "savefig"): "into the open file outputfile.replace hands it",
    ("kvtool/io/plotfile.py", "savefig"): "into the open file outputfile.replace hands it",
    ("kvtool/fixtures.py", "mkdir"): "the fixture cache kvtool builds for its tests (never a model folder)",
    ("kvtool/fixtures.py", "open"): "the fixture cache's lock file",
    ("kvtool/fixtures.py", "save_pretrained"): "the fixture cache's own staging folder",
    ("kvtool/fixtures.py", "os.replace"): "the fixture cache's own staging folder",
    ("kvtool/eval/server.py", "open"): "urllib's OpenerDirector.open: an HTTP request to the server, no file",
    ("kvtool/console.py", "os.open"): "opens os.devnull write-only to stand in for a stdout that refused output",
    ("kvtool/options/__main__.py", "write_text"): "a developer tool regenerating the repository's docs tables",
    ("kvtool/engines/inside.py", "write_text"): "a developer tool regenerating schemas/engines/fact_releases.json",
}


def _mode_writes(node: ast.Call, position: int) -> bool:
    mode = node.args[position] if len(node.args) > position else next(
        (k.value for k in node.keywords if k.arg == "mode"), None)
    if mode is None:
        return False
    if isinstance(mode, ast.Constant) and isinstance(mode.value, str):
        return any(c in mode.value for c in "wax+")
    return True  # not a literal: cannot tell, so it counts


def _flag_names(node: ast.AST) -> set[str]:
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
            if isinstance(n, (ast.Attribute, ast.Name))}


def _imported(tree: ast.AST) -> dict[str, str]:
    """Names bound by `from os import replace as r` and the like: local name -> "os.replace"."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module in ("os", "shutil", "tempfile"):
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


def _writes(node: ast.Call, imported: dict[str, str] = {}) -> str | None:
    """The name of the write a call makes, or None."""
    f = node.func
    if isinstance(f, ast.Name):
        if f.id == "open" and _mode_writes(node, 1):
            return "open"
        module, _, name = imported.get(f.id, "").partition(".")
        if name in {"os": OS_WRITES | {"open"}, "shutil": SHUTIL_WRITES, "tempfile": TEMPFILE_WRITES}.get(module, ()):
            return imported[f.id]
        return f.id if f.id in METHOD_WRITES else None
    if not isinstance(f, ast.Attribute):
        return None
    owner = f.value.id if isinstance(f.value, ast.Name) else None
    if owner == "os":
        if f.attr == "open":
            flags = _flag_names(node.args[1]) if len(node.args) > 1 else {"?"}
            unknown = {n for n in flags if not n.startswith("O_")} - {"os", "getattr"}  # a variable: counts
            return "os.open" if flags & OPEN_FLAGS_WRITE or unknown else None
        return f"os.{f.attr}" if f.attr in OS_WRITES else None
    if owner == "shutil":
        return f"shutil.{f.attr}" if f.attr in SHUTIL_WRITES else None
    if owner == "tempfile":
        return f"tempfile.{f.attr}" if f.attr in TEMPFILE_WRITES else None
    if (owner, f.attr) in MODULE_SAVES:
        return f"{owner}.{f.attr}"
    if f.attr == "open" and _mode_writes(node, 0):  # Path.open("w")
        return "open"
    return f.attr if f.attr in METHOD_WRITES else None


def write_calls() -> list[tuple[str, int, str]]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel == PRIMITIVE:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        imported = _imported(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and (name := _writes(node, imported)):
                out.append((rel, node.lineno, name))
    return out


def test_every_write_goes_through_the_write_primitive():
    bad = [f"{rel}:{line}: {name}(...) writes a file; use kvtool.io.outputfile"
           for rel, line, name in write_calls() if (rel, name) not in ALLOWED]
    assert not bad, "\n".join(bad)


def test_every_exception_is_still_used():
    """An allowance whose call is gone is removed, so the list stays the whole truth."""
    used = {(rel, name) for rel, _, name in write_calls()}
    assert not set(ALLOWED) - used, sorted(set(ALLOWED) - used)


def _calls(src: str) -> list[str]:
    tree = ast.parse(src)
    imported = _imported(tree)
    return [n for node in ast.walk(tree) if isinstance(node, ast.Call) and (n := _writes(node, imported))]


def test_the_scan_sees_each_kind_of_write():
    """The scanner itself: each way of writing a file is seen, reads are not."""
    writes = ['open(p, "w")', 'open(p, mode="ab")', "open(p, m)", 'p.open("x")', "p.write_text(s)",
              "p.write_bytes(b)", "p.mkdir()", "os.replace(a, b)", "os.rename(a, b)", "os.link(a, b)",
              "os.symlink(a, b)", "os.makedirs(p)", "os.chmod(p, 0o600)", "os.utime(p)",
              "os.open(p, os.O_WRONLY | os.O_CREAT)", "os.open(p, flags)", "shutil.copy2(a, b)",
              "shutil.copyfile(a, b)", "shutil.move(a, b)", "shutil.copystat(a, b)", "tempfile.mkstemp()",
              "save_file(t, p)", "st.save_file(t, p)", "m.save_pretrained(p)", "fig.savefig(p)", "np.save(p, a)",
              "torch.save(t, p)", "p.touch()", "p.symlink_to(q)", "p.rename(q)",
              "from os import replace\nreplace(a, b)", "from shutil import copy2 as c\nc(a, b)",
              "from tempfile import mkstemp\nmkstemp()", "from os import open as o\no(p, 0)"]
    for src in writes:
        assert _calls(src), src
    reads = ['open(p)', 'open(p, "rb")', 'p.open("r")', "p.read_text()", "os.open(p, os.O_RDONLY | os.O_NONBLOCK)",
             "os.stat(p)", "tempfile.mkdtemp()", "s.replace(a, b)", "json.dumps(x)", "from os import stat\nstat(p)",
             "replace(a, b)"]
    for src in reads:
        assert not _calls(src), src
