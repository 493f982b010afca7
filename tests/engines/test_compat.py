"""kvtool.engines.compat and `kvtool lint --compat`: one row per release line, grouped."""

from __future__ import annotations

import json

from kvtool.cli import main
from kvtool.engines import compat
from kvtool.engines.releases import known
from kvtool.model.spec import build_spec

from test_facts import LLAMA31


def test_rows_cover_every_minor_release_once() -> None:
    rows = compat.rows(build_spec(dict(LLAMA31)))
    for engine in ("transformers", "vllm"):
        lines = compat.line_releases(engine)
        mine = [r for r in rows if r.engine == engine]
        assert mine[0].first == lines[0] and mine[-1].last == lines[-1] == known()[engine][-1]
        covered = [v for r in mine for v in lines[lines.index(r.first):lines.index(r.last) + 1]]
        assert covered == list(lines)


def test_verdicts_name_what_changes() -> None:
    rows = compat.rows(build_spec(dict(LLAMA31)))
    tf = [r for r in rows if r.engine == "transformers"]
    assert tf[0].releases == "4.38-4.42" and tf[0].verdict == "refuses"
    assert "two fields" in tf[0].text() and tf[0].text().startswith("refuses: rope_type 'llama3'")
    assert tf[-1].releases == "4.43-5.25" and tf[-1].text() == compat.AS_WRITTEN


def test_lint_compat_prints_one_screen(tmp_path, capsys) -> None:
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA31, "dtype": "bfloat16", "torch_dtype": None}))
    assert main(["lint", "--compat", "--isolated", str(tmp_path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert len(out) <= 24
    assert any(line.strip().startswith("transformers 4.38-4.42") and "refuses" in line for line in out)
    assert main(["lint", "--compat", "--isolated", "--format", "json", str(tmp_path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["models"][0]["compat"][0]["verdict"] == "refuses"


def test_lint_compat_bad_input_exits_2(tmp_path, capsys) -> None:
    assert main(["lint", "--compat", "--isolated", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.startswith("kvtool: error: ")


def test_read_as_written_of_a_config() -> None:
    assert compat.read_as_written(dict(LLAMA31)) == {"transformers": "4.43-5.25", "vllm": "0.5-0.33"}
    none = {**LLAMA31, "model_type": "qwen3_5_text", "head_dim": 64}
    assert compat.read_as_written(none)["transformers"] == "5.2-5.25"


def test_checkpoints_kvtool_writes_say_which_releases_read_them(tmp_path) -> None:
    """convert's kvtool.json records the release lines that read the written config as written."""
    pytest = __import__("pytest")
    pytest.importorskip("torch")
    from tests.convert.test_convert_cli import llama, run

    src = llama(tmp_path / "src")
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", "4") == 0
    prov = json.loads((tmp_path / "out" / "kvtool.json").read_text())
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert prov["engines_read_as_written"] == compat.read_as_written(written)
    assert set(prov["engines_read_as_written"]) == {"transformers", "vllm"}
