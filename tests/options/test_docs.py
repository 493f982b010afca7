"""The option tables in the docs are generated from the declared options."""

from __future__ import annotations

from kvtool.options import docs, load_all
from kvtool.options.fields import fields_of


def test_the_docs_tables_are_current():
    for path, text in docs.expected().items():
        assert path.exists() and path.read_text(encoding="utf-8") == text, \
            f"{path} is stale: run python -m kvtool.options --write"


def test_the_fallback_page_exists_only_while_a_command_page_lacks_its_markers(tmp_path):
    assert docs.obsolete() == []
    (tmp_path / "options.md").write_text("old tables\n")
    for cmd in load_all():
        (tmp_path / f"{cmd}.md").write_text(f"# {cmd}\n\n<!-- options:{cmd} -->\n<!-- /options:{cmd} -->\n")
    files = docs.expected(tmp_path)
    assert tmp_path / "options.md" not in files and docs.obsolete(tmp_path) == [tmp_path / "options.md"]
    assert "| Flag | Recipe key |" in files[tmp_path / "rope.md"]


def test_every_operation_has_one_table_listing_every_field():
    files = docs.expected()
    for cmd, cls in load_all().items():
        holding = [t for t in files.values() if docs.has_markers(t, cmd)]
        assert len(holding) == 1, cmd
        table = docs.table(cls)
        assert table in holding[0]
        for f in fields_of(cls):
            assert f.spec.help.replace("|", "\\|") in table, f.name


def test_a_table_row_shows_flag_recipe_key_type_and_default():
    from kvtool.options.rope import RopeOptions

    rows = {r.split(" | ")[0].strip("| "): r for r in docs.table(RopeOptions).splitlines()}
    assert rows["`--layer-type`"].startswith("| `--layer-type` | `layer_type` | text | `full_attention` | ")
    assert "| `--in-place` |  | flag |  |" in rows["`--in-place`"]
    assert rows["SRC"].startswith("| SRC |  | text | required |")
