"""kvtool.convert.aware.calibration_data: what `--method aware` calibrates on, built and inspected without
loading a model (SmolLM2's tokenizer; text sources only)."""

from __future__ import annotations

import hashlib

import torch

from kvtool.convert.aware.calibration_data import CalibrationData
from kvtool.datasets import calibration_texts


def test_the_mix_gives_each_source_its_share_of_whole_sequences(smollm2_path):
    from transformers import AutoTokenizer

    data = CalibrationData.build(smollm2_path, None, "mixed", 96, 32)
    texts, _ = calibration_texts("mixed")
    assert tuple(data.ids.shape) == (3, 32) and data.ids.dtype == torch.int64
    assert [s.text for s in data.sources] == texts  # pydoc, The Devil's Dictionary, The Jargon File, in turn
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    for row, text in zip(data.ids, texts):  # row i is the opening of source i
        opening = tok.decode(row, skip_special_tokens=True)[:60].strip()
        assert opening and opening in text, opening
    assert data.written == {} and len(data.used) == 3
    for used, text in zip(data.used, texts):  # each source read only as far as its share: 32 tokens of a long text
        assert len(used.ids) == 32 and not used.exhausted and used.chars < len(text)


def test_the_provenance_names_the_sources_and_hashes_what_was_used(smollm2_path):
    data = CalibrationData.build(smollm2_path, None, "mixed", 96, 32)
    prov = data.provenance()
    assert (prov["calib_tokens"], prov["seq_len"]) == (96, 32) and "self_written" not in prov
    assert prov["calib_text"] == " + ".join(s.label for s in data.sources) and "Devil" in prov["calib_text"]
    texts, _ = calibration_texts("mixed")
    shas = [hashlib.sha256(t[:u.chars].encode("utf-8")).hexdigest() for t, u in zip(texts, data.used)]
    assert prov["calib_text_sha256"] == hashlib.sha256(" ".join(shas).encode()).hexdigest()  # of what was used
    assert prov["calib_ids_sha256"] == hashlib.sha256(data.ids.numpy().astype("<i8").tobytes()).hexdigest()
    again = CalibrationData.build(smollm2_path, None, "mixed", 96, 32)
    assert torch.equal(again.ids, data.ids) and again.provenance() == prov  # deterministic: same data, same record


def test_a_short_calibration_names_only_the_sources_it_reached(smollm2_path):
    data = CalibrationData.build(smollm2_path, None, "mixed", 64, 32)
    assert tuple(data.ids.shape) == (2, 32)
    assert len(data.sources) == 2 and "Jargon" not in data.provenance()["calib_text"]


def test_a_text_file_is_one_source(smollm2_path, tmp_path):
    f = tmp_path / "calib.txt"
    f.write_text("The quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    data = CalibrationData.build(smollm2_path, str(f), None, 48, 16)
    assert tuple(data.ids.shape) == (3, 16) and len(data.sources) == 1 and str(f) in data.sources[0].label
