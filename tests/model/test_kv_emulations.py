"""kvtool/model/kv_emulations.json: every row well formed, keyed by a --kv-cache-dtype, naming a codec of the
registry and an oracle test that exists; the loader refuses a malformed row naming the field. No torch."""

from __future__ import annotations

import copy
import dataclasses
import json
import re
from pathlib import Path

import pytest

from kvtool.model import kv_dtypes, kv_emulations

ROOT = Path(__file__).resolve().parents[2]


def _data() -> dict:
    return json.loads(kv_emulations.FILE.read_text(encoding="utf-8"))


def test_every_row_is_a_kv_cache_dtype_and_names_a_codec_of_the_registry():
    from kvtool.eval.codecs import CODECS  # torch-free: the registry imports its codecs when asked

    rows = kv_emulations.table()
    assert {"fp8", "fp8_e4m3", "fp8_e5m2"} <= set(rows)
    for name, r in rows.items():
        assert kv_dtypes.get(name) is not None, name
        assert r.codec in CODECS, name
        assert r.citation.release == kv_emulations.release() == kv_dtypes.release()
    assert rows["fp8"].alias_of == "fp8_e4m3" and rows["fp8"].params == rows["fp8_e4m3"].params
    assert rows["fp8_e5m2"].params["format"] == "float8_e5m2" and rows["fp8_e4m3"].params["format"] == "float8_e4m3fn"


def test_every_oracle_is_a_test_that_exists_and_says_exact_or_assumed_as_the_row_does():
    for name, r in kv_emulations.table().items():
        path, func = r.oracle.split("::")
        text = (ROOT / path).read_text(encoding="utf-8")
        m = re.search(rf"^def {re.escape(func)}\(.*?\):\n\s+\"\"\"(.*?)\"\"\"", text, re.M | re.S)
        assert m, f"{name}: {r.oracle} is no test with a docstring"
        assert r.match in m.group(1).lower(), f"{name}: {r.oracle}'s docstring does not say {r.match}"


def test_cited_files_exist_in_the_vllm_release():
    src = Path("/work/vllm-src") / kv_emulations.release()
    for name, r in kv_emulations.table().items():
        excerpt = r.citation.excerpt
        if excerpt:
            assert (ROOT / "tests/data/vllm" / r.citation.release / excerpt).is_file(), name
        if src.is_dir():
            assert (src / r.citation.file).is_file(), name


@pytest.mark.parametrize("edit, field", [
    (lambda e: e["fp8_e5m2"].update(scales="sometimes"), "emulations.fp8_e5m2.scales"),
    (lambda e: e["fp8_e5m2"]["reads"].update(first="maybe"), "emulations.fp8_e5m2.reads.first"),
    (lambda e: e["fp8_e5m2"]["reads"].update(first=None, later=None, why="x"), "emulations.fp8_e5m2.reads.first"),
    (lambda e: e["fp8_e5m2"]["reads"].update(later=0), "emulations.fp8_e5m2.reads.later"),
    (lambda e: e["fp8_e5m2"]["reads"].update(citation={"file": "x.py"}), "emulations.fp8_e5m2.reads.citation"),
    (lambda e: e["fp8_e5m2"].pop("reads"), "emulations.fp8_e5m2.reads"),
    (lambda e: e["fp8_e5m2"].update(match="close"), "emulations.fp8_e5m2.match"),
    (lambda e: e["fp8_e5m2"].update(codec="nope"), "emulations.fp8_e5m2.codec"),
    (lambda e: e["fp8_e5m2"].update(citation={"file": "x.py"}), "emulations.fp8_e5m2.citation"),
    (lambda e: e["fp8_e5m2"].update(citation="vllm/x.py"), "emulations.fp8_e5m2.citation"),
    (lambda e: e["fp8_e5m2"].update(match="exact"), "emulations.fp8_e5m2.assumption"),
    (lambda e: e["fp8_e5m2"].pop("oracle"), "emulations.fp8_e5m2.oracle"),
    (lambda e: e["fp8_e5m2"].update(colour="red"), "emulations.fp8_e5m2.colour"),
    (lambda e: e["fp8_e5m2"].update(fp8_attention="cpu"), "emulations.fp8_e5m2.fp8_attention"),
    (lambda e: e["fp8_e5m2"].update(fp8_attention=[]), "emulations.fp8_e5m2.fp8_attention"),
    (lambda e: e.update(fp9={"alias_of": "fp8_e4m3"}), "emulations.fp9"),
    (lambda e: e.update(fp8={"alias_of": "fp8_e6m1"}), "emulations.fp8.alias_of"),
    (lambda e: e["fp8"].update(codec="fp8"), "emulations.fp8.alias_of"),
])
def test_a_malformed_row_is_refused_naming_its_field(edit, field):
    from kvtool.eval.codecs import CODECS

    data = copy.deepcopy(_data())
    edit(data["emulations"])
    with pytest.raises(ValueError, match=re.escape(f"kv_emulations.json: {field}")):
        kv_emulations.parse(data, codecs=tuple(CODECS))


def test_the_shipped_table_parses_with_the_registry():
    from kvtool.eval.codecs import CODECS

    assert kv_emulations.parse(_data(), codecs=tuple(CODECS))[1] == kv_emulations.table()


def test_rows_are_frozen():
    r = kv_emulations.get("fp8_e5m2")
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.codec = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        r.params["format"] = "x"  # type: ignore[index]


def test_fp8_attention_lists_name_declared_backends():
    """A row's fp8_attention list names --fp8-attention choices (kvtool.eval.fp8_backends; the torch-free loader
    cannot import the feature to check it); fp8_e5m2 takes vLLM's CPU build and cache-only, not the GPU rows."""
    from kvtool.eval.fp8_backends import CHOICES

    for name, r in kv_emulations.table().items():
        if isinstance(r.fp8_attention, tuple):
            assert set(r.fp8_attention) <= set(CHOICES), name
    e5 = kv_emulations.get("fp8_e5m2")
    assert kv_emulations.takes_fp8_attention(e5, "cpu") and not kv_emulations.takes_fp8_attention(e5, "triton")
    assert all(kv_emulations.takes_fp8_attention(kv_emulations.get("fp8_e4m3"), n) for n in CHOICES)


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["not_emulated"].pop("fp8_inc"), "not_emulated.fp8_inc: missing"),
    (lambda d: d["not_emulated"].update(fp8_e5m2=d["not_emulated"]["auto"]), "not_emulated.fp8_e5m2: an emulated"),
    (lambda d: d["not_emulated"].update(fp9=d["not_emulated"]["auto"]), "not_emulated.fp9: not a --kv-cache-dtype"),
    (lambda d: d["not_emulated"]["fp8_inc"].pop("why"), "not_emulated.fp8_inc.first / later null only together"),
    (lambda d: d.pop("not_emulated"), "not_emulated:"),
])
def test_every_kv_cache_dtype_has_its_reads_once(edit, field):
    """The table holds what vLLM reads for each of kv_dtypes.json's names exactly once: an emulated dtype's in its
    row, the others' in not_emulated."""
    data = copy.deepcopy(_data())
    _, rows = kv_emulations.parse(data)
    assert set(kv_emulations.parse_reads(data, rows)) == set(kv_dtypes.names())
    edit(data)
    with pytest.raises(ValueError, match=re.escape(f"kv_emulations.json: {field}")):
        kv_emulations.parse_reads(data, rows)
