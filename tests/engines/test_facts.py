"""kvtool.engines.facts: every row well-formed and cited; effects name their release range."""

from __future__ import annotations

import json

import pytest

from kvtool.engines import facts as F
from kvtool.engines.detect import DETECTORS
from kvtool.model.spec import build_spec

LLAMA31 = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
           "num_hidden_layers": 2, "intermediate_size": 512, "vocab_size": 1000, "max_position_embeddings": 131072,
           "rope_theta": 500000.0, "torch_dtype": "bfloat16",
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 8192}}


def test_rows_are_cited_and_use_known_detectors() -> None:
    rows = F.facts()
    assert len(rows) >= 20
    for f in rows:
        assert f.citation.file and f.citation.function and f.citation.release, f.id
        assert f.effect == "arithmetic" or f.detector in DETECTORS, f.id
        assert f.range_text().startswith(f.engine + " ")


def test_rope_type_without_type_is_refused_before_443_only() -> None:
    spec = build_spec(json.loads(json.dumps(LLAMA31)))
    old = F.effects(spec, "transformers", ("4.42.4",))
    assert [e.code for e in old] == ["KV010"]
    assert old[0].message().startswith("transformers < 4.43.0 refuses rope_type 'llama3' without 'type'")
    assert "_rope_scaling_validation" in old[0].message()
    assert F.effects(spec, "transformers", ("4.43.0", "5.24.0")) == []


def test_rope_parameters_only_is_read_with_the_class_default_by_4x() -> None:
    cfg = {k: v for k, v in LLAMA31.items() if k not in ("rope_theta", "rope_scaling")}
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 500000.0}
    spec = build_spec(cfg)
    (e,) = F.effects(spec, "transformers", ("4.57.6",))
    assert e.code == "KV213" and "theta 10000" in e.text and "theta 500000" in e.text
    assert F.effects(spec, "transformers", ("5.0.0",)) == []


@pytest.mark.parametrize("version,expected", [("4.50.3", ["KV010"]), ("4.51.0", [])])
def test_a_model_type_newer_than_the_release_is_refused(version: str, expected: list) -> None:
    spec = build_spec({**LLAMA31, "model_type": "qwen3", "head_dim": 64, "rope_scaling": None})
    assert [e.code for e in F.effects(spec, "transformers", (version,))] == expected


def test_arithmetic_switch_follows_the_release_range() -> None:
    assert "yarn_from_original" in F.arithmetic("vllm", "0.29.0")
    assert F.arithmetic("vllm", "0.30.0") == frozenset()


def test_a_malformed_row_is_refused() -> None:
    good = {"id": "x", "engine": "transformers", "releases": "<4.43", "effect": "refuses", "detector": "dtype_only",
            "says": "s", "citation": {"file": "f", "function": "g", "release": "4.42.4"}}
    assert F._row(good, "t").id == "x"
    for bad in ({**good, "engine": "tgi"}, {**good, "effect": "breaks"}, {**good, "detector": "nope"},
                {**good, "extra": 1}, {**good, "effect": "arithmetic"}):
        with pytest.raises(ValueError):
            F._row(bad, "t")


def test_every_shipped_range_is_a_pep440_specifier_set() -> None:
    # rows are not parsed at load (lint imports packaging only when a detector hits): this is their check
    from packaging.specifiers import SpecifierSet

    for fact in F.facts():
        assert str(SpecifierSet(fact.releases)) and fact.range_text().startswith(fact.engine), fact.id


@pytest.mark.parametrize("model_type", [["qwen3_5"], {"a": 1}, 7, None])
def test_detectors_take_a_model_type_of_any_json_value(model_type) -> None:
    # a hostile config: every vLLM fact's detector runs on it without an exception (kv_scales_declared hashed it)
    cfg = {**json.loads(json.dumps(LLAMA31)), "model_type": model_type,
           "quantization_config": {"kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False}}}
    F.effects(build_spec(cfg), "vllm", ("0.33.0", "0.27.1"))
    F.effects(build_spec(cfg), "transformers", ("4.38.0", "4.45.0", "5.24.0"))  # every detector runs, any release
