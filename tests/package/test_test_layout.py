"""tests/ mirrors kvtool/: a test of kvtool/<package>/ sits in tests/<package>/ (tests/convert/mla/ for
kvtool/convert/mla/), a test of a top-level module kvtool/<module>.py is tests/test_<module>.py, and the few folders
that test no one package say why below (docs/DEVELOPING.md, "Where a test goes")."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
KVTOOL = TESTS.parent / "kvtool"
ELSEWHERE = {  # folders of tests/ that mirror no kvtool package, and what they test
    "hostile": "hostile inputs, each through every command in a subprocess (docs/safety.md)",
    "oracle": "kvtool against transformers' and vLLM's own code, across packages",
    "docs": "README.md and docs/*.md: links, paths, runnable examples",
    "package": "the package as a whole: layering, extension points, this layout",
    "bench": "the scripts under bench/",
}


def misplaced(tests: Path = TESTS, kvtool: Path = KVTOOL) -> list[str]:
    out = []
    for f in sorted(tests.rglob("test_*.py")):
        rel = f.relative_to(tests)
        if rel.parts[0] == "data" or rel.parts[0] in ELSEWHERE:
            continue
        if len(rel.parts) == 1:
            if not (kvtool / f"{rel.stem[len('test_'):]}.py").is_file():
                out.append(f"{rel}: at the root of tests/, but kvtool/{rel.stem[len('test_'):]}.py does not exist")
        elif not (kvtool.joinpath(*rel.parts[:-1]) / "__init__.py").is_file():
            out.append(f"{rel}: kvtool/{'/'.join(rel.parts[:-1])} is no package")
    return out


def test_every_test_file_sits_where_the_package_it_tests_sits() -> None:
    assert not misplaced(), "\n".join(misplaced())
    assert all((TESTS / name).is_dir() for name in ELSEWHERE), "a folder listed in ELSEWHERE is gone"


def test_the_layout_check_sees_a_misplaced_file(tmp_path: Path) -> None:
    (tmp_path / "kvtool" / "io").mkdir(parents=True)
    (tmp_path / "kvtool" / "io" / "__init__.py").write_text("")
    (tmp_path / "kvtool" / "console.py").write_text("")
    for rel in ("io/test_writer.py", "test_console.py", "test_cli_lint.py", "commands/test_lint.py"):
        (tmp_path / "tests" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "tests" / rel).write_text("")
    found = misplaced(tmp_path / "tests", tmp_path / "kvtool")
    assert [line.split(":")[0] for line in found] == ["commands/test_lint.py", "test_cli_lint.py"], found
