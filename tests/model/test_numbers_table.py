"""kvtool/model/numbers.py: every bound in the table, the accessors that hide invalid values, and `show`."""

from __future__ import annotations

import glob
import math
from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.model.numbers import (
    QUANTITY_BOUNDS,
    ROPE_PARAM_BOUNDS,
    problem,
    require_valid_numbers,
    show,
)
from kvtool.model.spec import build_spec

LLAMA = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 8, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 32, "max_position_embeddings": 256, "rope_theta": 10000.0}
ALL = {**{f"q:{k}": b for k, b in QUANTITY_BOUNDS.items()}, **{f"r:{k}": b for k, b in ROPE_PARAM_BOUNDS.items()}}


@pytest.mark.parametrize("name", sorted(ALL))
def test_bound_edges(name) -> None:
    b = ALL[name]
    inside = [b.high] if b.low_open else [b.low, b.high]
    for v in inside:
        v = int(v) if b.kind == "int" else v
        assert problem(v, b) is None, (name, v)
    over = b.high + 1 if b.kind == "int" else b.high * 2 + 1
    below = b.low if b.low_open else b.low - 1
    for v in (over, below, math.nan, math.inf, -math.inf, True, "1", [], {}):
        if isinstance(v, list) and b.listable:
            continue  # an empty id list is KV504's business
        assert problem(v, b) is not None, (name, v)
    if b.kind == "int":
        assert problem(b.low + 0.5 if not b.low_open else b.high - 0.5, b) is not None  # 2.5 is no count


def test_show_never_formats_a_huge_int() -> None:
    assert show(10 ** 5000).startswith("an integer of ")  # str() would raise past 4300 digits
    assert show(math.nan) == "NaN" and show(-math.inf) == "-Infinity" and show(True) == "true"
    assert show("x" * 100).endswith("...'") and show({}) == "a JSON object"


@pytest.mark.parametrize("key,value,field", [
    ("num_key_value_heads", 0, "num_kv_heads"), ("num_hidden_layers", 10**9, "num_layers"),
    ("num_attention_heads", math.nan, "num_heads"), ("hidden_size", True, "hidden_size"),
    ("max_position_embeddings", -math.inf, "max_position"), ("rope_theta", 1e308, "rope_theta"),
])
def test_spec_hides_invalid_values(key, value, field) -> None:
    spec = build_spec({**LLAMA, key: value})
    assert field in spec.invalid and spec.invalid[field].key == key
    assert spec.number(field) is None
    with pytest.raises(InputError) as e:
        require_valid_numbers(spec, "x/config.json")
    assert e.value.line().startswith(f"x/config.json: {key}: got ")


def test_layers_1e9_build_no_layer_list() -> None:
    spec = build_spec({**LLAMA, "num_hidden_layers": 10**9})
    assert spec.num_layers is None and len(spec.layer_types) < 10


def test_wrapped_text_config_keys_are_prefixed() -> None:
    spec = build_spec({"model_type": "qwen3_vl", "text_config": {**LLAMA, "model_type": "qwen3_vl_text",
                                                                 "num_key_value_heads": -2}})
    assert spec.invalid["num_kv_heads"].key == "text_config.num_key_value_heads"


def test_rope_dict_values_are_checked() -> None:
    spec = build_spec({**LLAMA, "rope_scaling": {"rope_type": "yarn", "factor": math.inf, "beta_fast": "32",
                                                 "original_max_position_embeddings": 2.5}})
    keys = {b.key for b in spec.invalid.values()}
    assert keys == {"rope_scaling.factor", "rope_scaling.beta_fast", "rope_scaling.original_max_position_embeddings"}


def test_rope_settings_must_be_objects() -> None:
    spec = build_spec({**LLAMA, "rope_parameters": [None]})
    assert spec.invalid["rope_parameters"].need.startswith("a JSON object")


def test_token_ids_are_lint_only() -> None:
    spec = build_spec({**LLAMA, "pad_token_id": "</s>"})
    assert "pad_token_id" in spec.invalid
    require_valid_numbers(spec, "config.json")  # commands do not use token ids: no refusal


def test_every_real_config_is_inside_the_bounds() -> None:
    """The bounds are for impossible values: none of the public configs may trip them."""
    from kvtool.io.jsonfile import load_json_object

    files = sorted(glob.glob(str(Path(__file__).parents[1] / "data" / "configs" / "*.json")))
    files += sorted(glob.glob("/work/shared/configs/*.json"))  # the wider corpus, where present
    assert files
    for f in files:
        data = load_json_object(Path(f)).data
        assert not build_spec(data).invalid, (f, {k: v.message for k, v in build_spec(data).invalid.items()})


def test_docs_table_is_current() -> None:
    """docs/input-limits.md carries the bound table as bounds_markdown() renders it."""
    from kvtool.model.numbers import bounds_markdown

    doc = (Path(__file__).parents[2] / "docs" / "input-limits.md").read_text(encoding="utf-8")
    assert bounds_markdown() in doc, "regenerate the table in docs/input-limits.md from kvtool.model.numbers"
