"""kvtool.datasets: the built-in pydoc text split, written to files, and --calib-dataset choices."""

from __future__ import annotations

import pytest

from kvtool.datasets import (CALIBRATION_LABEL, calibration_text, calibration_texts, check_calibration_source,
                             evaluation_text, main, write_text_files)
from kvtool.errors import UsageError


def test_calibration_and_evaluation_are_disjoint_topics():
    from pydoc_data.topics import topics

    calib, ev = calibration_text(), evaluation_text()
    assert len(ev) > 100_000 and len(calib) > 300_000
    in_calib = [name for name, text in topics.items() if text in calib]
    assert len(in_calib) == len(topics) - (len(topics) + 3) // 4  # every fourth topic (sorted by name) is held out
    # no paragraph of the evaluation text occurs in the calibration text (pydoc repeats some)
    calib_paragraphs = {p.strip() for p in calib.split("\n\n")}
    shared = [p for p in ev.split("\n\n") if len(p.strip()) > 40 and p.strip() in calib_paragraphs]
    assert shared == []


def test_write_text_files_is_idempotent(tmp_path):
    c, e = write_text_files(tmp_path)
    assert c.read_text(encoding="utf-8") == calibration_text() and e.read_text(encoding="utf-8") == evaluation_text()
    e.write_text("kept")
    assert write_text_files(tmp_path)[1].read_text() == "kept"  # existing files are reused, not rewritten


def test_write_text_files_accepts_a_string_and_creates_the_folder(tmp_path):
    calib, ev = write_text_files(str(tmp_path / "text"))  # the README's helper, called the obvious way
    assert calib.parent == tmp_path / "text" and calib.read_text(encoding="utf-8") == calibration_text()
    assert ev.name == "eval.txt"


def test_module_writes_the_files(tmp_path, capsys):
    assert main([str(tmp_path / "t")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "t" / "calib.txt"), str(tmp_path / "t" / "eval.txt")]
    assert main([]) == 2


def test_default_calibration_dataset_is_builtin():
    texts, label = calibration_texts(None)
    assert texts == [calibration_text()] and label == CALIBRATION_LABEL
    assert calibration_texts("pydoc") == (texts, label)


@pytest.mark.parametrize("files,dataset,needle", [
    (["a.txt"], "pydoc", "not both"),
    ([], "wikitext7", "unknown dataset 'wikitext7'"),
])
def test_calibration_source_refusals(files, dataset, needle):
    with pytest.raises(UsageError, match=needle) as info:
        check_calibration_source(files, dataset)
    assert info.value.option == "calib_dataset"


def test_testing_text_is_the_same_module():
    from kvtool.testing import text

    assert text.write_text_files is write_text_files and text.evaluation_text is evaluation_text


def test_mixes_name_their_sources_and_model_written_text_needs_the_model():
    from kvtool.datasets import MODEL_WRITTEN, calibration_parts

    assert calibration_parts(None) == ("pydoc",) and calibration_parts("pydoc+self") == ("pydoc", MODEL_WRITTEN)
    check_calibration_source(None, "self")  # a known name
    with pytest.raises(UsageError, match="only convert --method aware") as info:
        calibration_texts("pydoc+self")  # quantize-kv has no model to write it
    assert info.value.option == "calib_dataset"


def test_the_mixed_dataset_is_pydoc_and_two_packaged_public_domain_texts():
    from kvtool.datasets import CALIBRATION_MIXES, MERGE_CALIBRATION, OFFLINE_MIXES, PACKAGED_TEXTS, packaged_text

    assert MERGE_CALIBRATION == "mixed" and CALIBRATION_MIXES["mixed"] == ("pydoc", "devil", "jargon")
    texts, label = calibration_texts("mixed")
    assert texts[0] == calibration_text() and texts[1:] == [packaged_text("devil"), packaged_text("jargon")]
    assert "Devil's Dictionary" in label and "Jargon File" in label
    assert "ABASEMENT" not in texts[1][:200]  # a seeded sample, not the alphabet's first entries
    for source in PACKAGED_TEXTS:
        text = packaged_text(source)
        assert 80_000 < len(text) < 120_000 and "\ufffd" not in text
        assert "00-database" not in text and "{" not in text  # dictd headers and cross-reference braces are gone
    assert set(OFFLINE_MIXES) == {"mixed", "pydoc"}  # no network, no model: what recipes may name


def test_every_mix_names_known_sources():
    from kvtool.datasets import CALIBRATION_MIXES, DATASETS, MODEL_WRITTEN, PACKAGED_TEXTS

    for parts in CALIBRATION_MIXES.values():
        assert set(parts) <= {"pydoc", MODEL_WRITTEN, *PACKAGED_TEXTS, *DATASETS}
