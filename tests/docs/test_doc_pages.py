"""The docs hold together: relative links in README.md, docs/*.md and bench/README.md resolve (file and anchor),
each command has its page with an Options section, the README stays short and keeps the Quick start CI relies on,
and the docs index lists every page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "bench" / "README.md"]
COMMANDS = ["lint", "kv-budget", "convert", "rope", "quantize-kv", "eval", "apply"]
LINK = re.compile(r"!?\[([^\]]*)\]\(([^)\s]+)\)")


def _prose(text: str) -> list[str]:
    """The lines of a markdown file, with those inside fenced code blocks blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
            line = ""
        out.append("" if fenced else line)
    return out


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors of a markdown file (lowercase, punctuation dropped, spaces to hyphens, -1 -2 for
    repeats), plus explicit <a id=...> / name= anchors."""
    seen: dict[str, int] = {}
    out = set()
    text = path.read_text(encoding="utf-8")
    for line in _prose(text):
        m = re.match(r"#{1,6} +(.*?) *#* *$", line)
        if not m:
            continue
        title = LINK.sub(lambda k: k.group(1), m.group(1)).replace("`", "").lower()
        slug = re.sub(r"[^\w\- ]", "", title).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    out |= set(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", text))
    return out


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link outside code (a link-like text inside `code` is an example)."""
    out = []
    for n, line in enumerate(_prose(path.read_text(encoding="utf-8")), 1):
        code = [m.span() for m in re.finditer(r"`[^`]*`", line)]
        for m in LINK.finditer(line):
            if not any(a < m.start() < b for a, b in code) and not re.match(r"[a-z][a-z0-9+.-]*:", m.group(2)):
                out.append((n, m.group(2)))
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_relative_link_points_at_an_existing_file_and_anchor(page: Path) -> None:
    broken = []
    for n, target in links(page):
        file, _, anchor = target.partition("#")
        dest = (page.parent / file).resolve() if file else page
        if not dest.exists():
            broken.append(f"{page.relative_to(REPO)}:{n}: {target}: no such file")
        elif anchor and (dest.suffix != ".md" or anchor not in anchors(dest)):
            broken.append(f"{page.relative_to(REPO)}:{n}: {target}: no heading with that anchor")
    assert not broken, "\n".join(broken)


def test_the_link_check_sees_links_and_anchors() -> None:
    readme = {t for _, t in links(REPO / "README.md")}
    assert "docs/lint.md" in readme and "docs/README.md" in readme
    assert "#how-the-numbers-are-computed" in {t for _, t in links(REPO / "docs" / "kv-budget.md")}
    assert "staging-folders" in anchors(REPO / "docs" / "exit-codes.md")
    assert "kvtool-convert---method-aware-calibrated-kv-head-merging-without-retraining" in anchors(
        REPO / "docs" / "convert.md")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_every_command_has_a_page_with_its_options_markers(cmd: str) -> None:
    text = (REPO / "docs" / f"{cmd}.md").read_text(encoding="utf-8")
    start, end = f"<!-- options:{cmd} -->", f"<!-- /options:{cmd} -->"
    assert text.count(start) == 1 and text.count(end) == 1, cmd
    assert text.index("\n## Options\n") < text.index(start) < text.index(end)
    between = text[text.index("\n## Options\n"):text.index(start)]
    assert between.strip() == "## Options", "the markers open the Options section"
    assert text.startswith(f"# `kvtool {cmd}`"), "the page's title names the command"


def test_the_readme_is_short_and_keeps_the_quick_start() -> None:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    # one example per command, and one per feature a command grew (MLA, engine releases, served eval, KV dtypes)
    assert len(text.splitlines()) < 350
    quick = text[text.index("## Quick start"):text.index("## Commands")]
    assert "pip install -e . && kvtool lint examples/*/" in quick and "\nbash .ci/run " in quick
    assert "torch==2.13.0" in quick
    for cmd in COMMANDS:  # one example per command, linking its page
        assert f"### [`kvtool {cmd}`](docs/{cmd}.md)" in text
        assert f"$ kvtool {cmd} " in text


def test_the_docs_index_lists_every_page() -> None:
    listed = {t.partition("#")[0] for _, t in links(REPO / "docs" / "README.md")}
    pages = {p.name for p in (REPO / "docs").glob("*.md")} - {"README.md"}
    assert not pages - listed, f"docs/README.md does not list {sorted(pages - listed)}"


TOP = sorted(p.name for p in REPO.iterdir() if p.is_dir() and not p.name.startswith((".git", ".whl", ".gpu"))
             and not p.name.endswith(".egg-info") and p.name != "__pycache__")
TESTS = REPO / "tests"
TEST_DIRS = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and p.name not in {"__pycache__", "data"})
# a repo path: a top folder of this repository, then a file with an extension (or a glob of them), or a folder
# ending in "/"; an optional ::test_name after a .py file. /tmp/x/docs/a.md, vllm/config.py and SRC/config.json
# are not ours
REPO_PATH = re.compile(r"(?<![\w/.~$-])((?:%s)/[\w./*-]*)(?:::(\w+))?" % "|".join(re.escape(t) for t in TOP))
# a test cited by its folder under tests/ (docs/safety.md: `hostile/test_signals.py::test_...`)
TEST_PATH = re.compile(r"(?<![\w/.~$-])((?:%s)/test_\w*\.py)(?:::(\w+))?" % "|".join(map(re.escape, TEST_DIRS)))


def _path(text: str) -> str | None:
    """A match without its sentence's punctuation, if it names a file (with an extension) or a folder (a final /)."""
    text = text.rstrip(".-")
    return text if text.endswith("/") or re.search(r"\.[A-Za-z0-9]+$", text.rpartition("/")[2]) else None


def repo_paths(page: Path) -> list[tuple[int, str, str | None]]:
    """(line, path, test name or None) of every path into this repository that a page names, code blocks included."""
    out = []
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        out += [(n, path, m.group(2)) for m in REPO_PATH.finditer(line) if (path := _path(m.group(1)))]
        out += [(n, f"tests/{m.group(1)}", m.group(2)) for m in TEST_PATH.finditer(line)]
    return out


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(REPO)) for p in PAGES])
def test_every_repo_path_a_page_names_exists(page: Path) -> None:
    missing = []
    for n, path, name in repo_paths(page):
        found = sorted(REPO.glob(path)) if "*" in path else [REPO / path] if (REPO / path).exists() else []
        if not found:
            missing.append(f"{page.relative_to(REPO)}:{n}: {path}: no such file")
        elif name and not any(re.search(rf"^\s*(?:async )?def {name}\b", f.read_text(encoding="utf-8"), re.M)
                              for f in found if f.suffix == ".py"):
            missing.append(f"{page.relative_to(REPO)}:{n}: {path}::{name}: no such function")
    assert not missing, "\n".join(missing)


def test_the_path_check_sees_paths_and_misses() -> None:
    dev = {p for _, p, _ in repo_paths(REPO / "docs" / "DEVELOPING.md")}
    assert {"kvtool/commands/argv.py", "tests/options/test_argv.py", "kvtool/convert/", "schemas/wrappers.json",
            "scripts/gpu_check.sh"} <= dev, sorted(dev)
    line = "`kvtool/commands/echo.py`, /tmp/out/docs/x.md, vllm/config/model.py, tests/hostile/test_*.py, kvtool/io"
    found = [p for m in REPO_PATH.finditer(line) if (p := _path(m.group(1)))]
    assert found == ["kvtool/commands/echo.py", "tests/hostile/test_*.py"], found
    assert not (REPO / found[0]).exists() and sorted(REPO.glob(found[1]))
    assert [(p, t) for _, p, t in repo_paths(REPO / "docs" / "safety.md") if t][:1], "no path::test seen"


def test_every_python_file_the_package_cites_exists() -> None:
    """A docstring or comment in kvtool/ that names a test or a module (tests/rules/test_output_check.py checks
    ...) names one that exists, with the function when it names one (docs/CMD.md-style templates are no .py)."""
    missing = []
    for src in sorted((REPO / "kvtool").rglob("*.py")):
        for n, path, name in repo_paths(src):
            if not path.endswith(".py"):
                continue
            found = sorted(REPO.glob(path)) if "*" in path else [REPO / path] if (REPO / path).exists() else []
            if not found:
                missing.append(f"{src.relative_to(REPO)}:{n}: {path}: no such file")
            elif name and not any(re.search(rf"^\s*(?:async )?def {name}\b", f.read_text(encoding="utf-8"), re.M)
                                  for f in found):
                missing.append(f"{src.relative_to(REPO)}:{n}: {path}::{name}: no such function")
    assert not missing, "\n".join(missing)
