"""KV001-KV003 and the KV90x schema rules: messages, dedupe with semantic rules, every schema valid."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from jsonschema import Draft202012Validator

from kvtool.model.architectures import all_architectures, schemas_dir
from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions
from kvtool.rules.schema import SCHEMA_CODES, describe, schema_for, validator_for

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rules_helpers import LLAMA, lint_dict  # noqa: E402

ISSUE_SCHEMAS = ("llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2",
                 "gemma3_text", "phi", "phi3", "deepseek_v2", "deepseek_v3", "falcon", "gpt2", "gpt_neox", "bloom",
                 "mpt", "starcoder2", "gpt_bigcode", "olmo", "olmo2", "internlm2", "cohere", "granite", "exaone",
                 "minicpm", "gpt_oss", "smollm3", "generic")


def schema_findings(config):
    return [(f.code, f.path, f.message) for f in lint_dict(config) if f.code in SCHEMA_CODES]


@pytest.mark.parametrize("model_type", ISSUE_SCHEMAS)
def test_issue_schemas_exist_and_are_valid_2020_12(model_type):
    path = schemas_dir() / f"{model_type}.json"
    schema = json.loads(path.read_text())
    Draft202012Validator.check_schema(schema)
    assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"
    assert schema["additionalProperties"] is True  # real configs carry many extra keys
    props = schema["properties"]
    for key in ("rope_scaling", "rope_parameters", "torch_dtype", "dtype"):
        assert key in props, key


def test_every_table_has_a_schema():
    for arch in all_architectures().values():
        name, _ = schema_for(arch.model_type)
        assert name == f"{arch.model_type}.json"


def test_unknown_model_type_falls_back_to_generic():
    assert schema_for("baichuan")[0] == "generic.json"
    assert validator_for("llama") is validator_for("llama")  # compiled once


@pytest.mark.parametrize("patch,code,path,needle", [
    ({"num_attention_heads": "4"}, "KV901", "num_attention_heads", "expected integer, found string"),
    ({"tie_word_embeddings": "false"}, "KV901", "tie_word_embeddings", "expected boolean"),
    ({"eos_token_id": [2, "x"]}, "KV901", "eos_token_id[1]", "expected integer"),
    ({"rope_scaling": [1]}, "KV901", "rope_scaling", "expected null or object, found array"),
    ({"rms_norm_eps": -1e-5}, "KV902", "rms_norm_eps", "must be > 0"),
    ({"num_hidden_layers": 0}, "KV902", "num_hidden_layers", "must be >= 1"),
    ({"attention_dropout": 2}, "KV902", "attention_dropout", "must be <= 1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": -2}}, "KV902", "rope_scaling.factor", "must be > 0"),
    ({"hidden_act": "swiglu"}, "KV903", "hidden_act", "not one of gelu"),
    ({"rope_scaling": {"factor": 2.0}}, "KV904", "rope_scaling", "none of rope_type / type / rope_theta"),
    ({"architectures": []}, "KV905", "architectures", "non-empty"),
])
def test_schema_messages_name_key_and_constraint(patch, code, path, needle):
    found = schema_findings({**LLAMA, **patch})
    assert any(c == code and p == path and needle in m and "schemas/llama.json" in m for c, p, m in found), found


def test_missing_core_keys_in_any_spelling():
    cfg = {k: v for k, v in LLAMA.items() if k != "num_attention_heads"}
    assert ("KV904", "num_attention_heads") in [(c, p) for c, p, _ in schema_findings(cfg)]
    found = schema_findings({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "vocab_size": 10})
    assert [(c, p) for c, p, _ in found] == [("KV904", "n_layer")]
    assert "none of n_layer / num_hidden_layers is set" in found[0][2]
    assert not schema_findings({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "num_hidden_layers": 2,
                                "vocab_size": 10})


def test_extra_keys_and_both_rope_layouts_are_accepted():
    ok = {**LLAMA, "my_private_key": {"anything": [1, "x"]},
          "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192},
          "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert not schema_findings(ok)
    assert not schema_findings({**LLAMA, "rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}})


def test_wrapper_paths_are_prefixed():
    cfg = {"model_type": "llava", "text_config": {**LLAMA, "hidden_act": "nope"}}
    found = schema_findings(cfg)
    assert [(c, p) for c, p, _ in found] == [("KV903", "text_config.hidden_act")]
    assert found[0][2].startswith("text_config.hidden_act")


def test_semantic_rule_wins_on_the_same_key(tmp_path):
    """num_key_value_heads 0 is KV101's (heads) and KV902's (schema): lint keeps the specific one."""
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 0}))
    codes = [f.code for f in lint_one(str(d), LintOptions()).findings]
    assert "KV101" in codes and "KV902" not in codes
    # ...unless the semantic rule is not selected
    from kvtool.rules.registry import Selection

    codes = [f.code for f in lint_one(str(d), LintOptions(selection=Selection(select=("KV9",)))).findings]
    assert codes == ["KV902"]


def test_model_type_notes():
    assert ("KV001", "model_type") in [(f.code, f.path) for f in lint_dict({**LLAMA, "model_type": "baichuan"})]
    missing = [f for f in lint_dict({k: v for k, v in LLAMA.items() if k != "model_type"}) if f.code == "KV001"]
    assert missing and "missing" in missing[0].message
    wrapped = [f for f in lint_dict({"model_type": "qwen3_vl", "text_config": {**LLAMA, "model_type": "qwen3_vl_text"}})
               if f.code == "KV003"]
    assert wrapped and wrapped[0].path == "text_config" and "'qwen3_vl' wrapper" in wrapped[0].message


def test_nonstandard_json_names_the_keys(tmp_path):
    d = tmp_path / "m"
    d.mkdir()
    text = json.dumps({**LLAMA, "limits": [0.0, 1.0], "eps": 0.5}).replace("1.0]", "Infinity]").replace("0.5", "NaN")
    (d / "config.json").write_text(text)
    f = [x for x in lint_one(str(d), LintOptions()).findings if x.code == "KV002"]
    assert len(f) == 1 and "Infinity, NaN" in f[0].message and "limits[1]" in f[0].message and "eps" in f[0].message


def test_describe_is_total_over_a_wrong_model():
    """A config of another family against llama's schema: every error gets a code and a one-line message."""
    v = validator_for("llama")
    cfg = {"model_type": "llama", "num_hidden_layers": "x", "hidden_size": -1, "num_attention_heads": None,
           "vocab_size": [], "rope_scaling": {"type": 3}, "layer_types": [1], "hidden_act": 7}
    for err in v.iter_errors(cfg):
        code, path, msg = describe(err)
        assert code in SCHEMA_CODES and msg and "\n" not in msg
