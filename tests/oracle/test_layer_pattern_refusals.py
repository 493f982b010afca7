"""Layer-pattern fields: kvtool refuses exactly the configs transformers' config class refuses (issue 39, class 8).

Generated over every layer-pattern field kvtool reads (kvtool.model.layer_types.pattern_problems): nemotron_h's
hybrid_override_pattern and layers_block_type, layer_types, sliding_window_pattern (gemma3 / cohere2). Each case
is built by transformers (`AutoConfig.for_model(**config)`) and by kvtool (`require_valid_numbers`, what every
command runs; lint's KV304 / KV305); both refuse or both accept."""

from __future__ import annotations

import itertools
import random

import pytest

pytestmark = pytest.mark.oracle
transformers = pytest.importorskip("transformers")

from kvtool.errors import InputError  # noqa: E402
from kvtool.model.numbers import require_valid_numbers  # noqa: E402
from kvtool.model.spec import build_spec  # noqa: E402

NEMOTRON = {"model_type": "nemotron_h", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "mamba_num_heads": 4, "mamba_head_dim": 16,
            "n_groups": 1, "ssm_state_size": 16, "conv_kernel": 4, "intermediate_size": 64,
            "max_position_embeddings": 256}
GEMMA3 = {"model_type": "gemma3_text", "hidden_size": 64, "num_hidden_layers": 6, "num_attention_heads": 4,
          "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128, "intermediate_size": 64,
          "max_position_embeddings": 256, "sliding_window": 32}
LLAMA = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 128, "intermediate_size": 64, "max_position_embeddings": 256}


def _patterns():
    rng = random.Random(39)
    letters = "ME*-"
    out = ["M*-E", "*", "MMMM", "", "M*Q", "m*-e", "M* E", "**\u2217"]  # \u2217: a look-alike asterisk
    out += ["".join(rng.choice(letters + "QX0 .") for _ in range(rng.randint(1, 8))) for _ in range(12)]
    out += [1184, 0, 3.5, None, True, ["M", "*"], {"M": 1}]
    return out


def _block_types():
    good = ["full_attention", "linear_attention", "moe", "mlp"]
    return [good, ["mamba", "attention"], ["full_attention", "sliding_attention"], ["full_attention", 3], [],
            "full_attention", ["M", "*"], list(itertools.islice(itertools.cycle(good), 7))]


CASES = (
    [("hybrid_override_pattern", {**NEMOTRON, "hybrid_override_pattern": p}) for p in _patterns()]
    + [("layers_block_type", {**NEMOTRON, "layers_block_type": b}) for b in _block_types()]
    + [("layers_block_type+pattern", {**NEMOTRON, "layers_block_type": ["full_attention"],
                                      "hybrid_override_pattern": "Q"})]  # transformers ignores the pattern then
    + [("layer_types", {**LLAMA, "layer_types": lt}) for lt in (
        ["full_attention"] * 4, ["full_attention"] * 3, ["full_attention", "sliding", "full_attention",
                                                          "full_attention"], ["sliding_attention"] * 4,
        ["dense"] * 4, ["mamba", "attention", "moe", "conv"])]
    + [("mlp_layer_types", {**LLAMA, "layer_types": ["full_attention"] * 4, "mlp_layer_types": m}) for m in (
        ["dense"] * 4, ["sparse", "dense", "dense", "dense"], ["dense"] * 3, ["dense", "moe", "dense", "dense"])]
    + [("mlp_layer_types-unchecked", {**LLAMA, "mlp_layer_types": ["moe"]})]  # no layer_types: never checked
    + [("sliding_window_pattern", {**GEMMA3, "sliding_window_pattern": p}) for p in (6, 1, 2, 0, "6", 2.5)]
)


def _transformers_refuses(cfg: dict) -> str | None:
    c = dict(cfg)
    try:
        transformers.AutoConfig.for_model(c.pop("model_type"), **c)
    except Exception as exc:  # noqa: BLE001 - ValueError, KeyError, TypeError, ZeroDivisionError: all refusals
        return f"{type(exc).__name__}: {exc}"
    return None


def _kvtool_refuses(cfg: dict) -> str | None:
    try:
        require_valid_numbers(build_spec(cfg), "config.json")
    except InputError as exc:
        return exc.line()
    return None


# Where kvtool refuses a config transformers builds, and why: each is a model no engine can serve as meant.
STRICTER = {
    "empty": "an empty pattern or block list builds a model with no layers (a 0-byte KV cache that 'fits')",
    "dict": "transformers iterates a JSON object's keys as letters; no config means that",
    "float": "(i + 1) % 2.5 builds layer types from a float; no model is written so",
}


def _stricter(cfg: dict) -> str | None:
    for key in ("hybrid_override_pattern", "layers_block_type"):
        v = cfg.get(key)
        if v in ("", []) and not (key == "hybrid_override_pattern" and cfg.get("layers_block_type")):
            return "empty"
        if isinstance(v, dict):
            return "dict"
    if isinstance(cfg.get("sliding_window_pattern"), float):
        return "float"
    return None


@pytest.mark.parametrize("field, cfg", CASES, ids=[f"{f}-{i}" for i, (f, _) in enumerate(CASES)])
def test_kvtool_refuses_what_transformers_refuses(field, cfg):
    theirs, ours = _transformers_refuses(cfg), _kvtool_refuses(cfg)
    why = _stricter(cfg)
    if why is not None:  # transformers builds it; kvtool refuses, and says so in its own words
        assert theirs is None and ours is not None, (why, theirs, ours)
        return
    assert (theirs is None) == (ours is None), f"transformers: {theirs}; kvtool: {ours}"
    if ours is not None and "pattern" in field:
        assert field.split("+")[0] in ours  # named by the field transformers fails on


def test_the_cases_cover_both_answers():
    answers = {_transformers_refuses(cfg) is None for _, cfg in CASES}
    assert answers == {True, False}
