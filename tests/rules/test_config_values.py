"""KV5xx: dtype, vocabulary vs tokenizer, special-token ids, ALiBi with RoPE keys, context-length keys."""

from __future__ import annotations

import json

from kvtest import write_config
from rules_helpers import FIXTURES, LLAMA, only

from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions


def test_dtype() -> None:
    (f,) = only({**LLAMA, "torch_dtype": "bf16"}, "KV501")
    assert f.path == "torch_dtype" and "'bf16'" in f.message
    assert not only({**LLAMA, "torch_dtype": "torch.bfloat16"}, "KV501")
    (c,) = only({**LLAMA, "dtype": "float16", "torch_dtype": "bfloat16"}, "KV502")
    assert c.severity == "warning" and "'float16'" in c.message and "'bfloat16'" in c.message


def test_special_ids_in_config_and_generation_config(tmp_path) -> None:
    (f,) = only({**LLAMA, "eos_token_id": [2, 40]}, "KV504")
    assert "[40]" in f.message and "0..31" in f.message
    assert only({**LLAMA, "bos_token_id": -1}, "KV504")
    assert only({**LLAMA, "eos_token_id": []}, "KV504")
    assert not only({**LLAMA, "pad_token_id": None}, "KV504")
    write_config(tmp_path, LLAMA)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 99, "pad_token_id": 0}))
    (g,) = [x for x in lint_one(str(tmp_path), LintOptions()).findings if x.code == "KV504"]
    assert g.file.endswith("generation_config.json") and "99" in g.message


def test_tokenizer_larger_than_vocab(tmp_path) -> None:
    write_config(tmp_path, LLAMA)
    tok = {"model": {"type": "BPE", "vocab": {"a": 0, "b": 1}}, "added_tokens": [{"id": 35, "content": "<x>"}]}
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    (f,) = [x for x in lint_one(str(tmp_path), LintOptions()).findings if x.code == "KV503"]
    assert "vocab_size = 32 but tokenizer.json has ids up to 35" in f.message


def test_alibi_models_with_rope_keys() -> None:
    mpt = json.loads((FIXTURES / "KV505" / "pass_mpt" / "config.json").read_text())
    (f,) = only({**mpt, "rope_theta": 500000.0}, "KV505")
    assert "attn_config.alibi" in f.message and "rope_theta" in f.message
    bloom = {"model_type": "bloom", "n_embed": 16, "n_head": 4, "n_layer": 2, "vocab_size": 32,
             "rope_scaling": {"type": "linear", "factor": 2.0}}
    assert only(bloom, "KV505")
    falcon_rope = {"model_type": "falcon", "hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                   "vocab_size": 32, "alibi": False, "rope_theta": 10000.0}
    assert not only(falcon_rope, "KV505")


def test_context_keys_warning_names_smallest() -> None:
    cmdr = json.loads((FIXTURES / "KV506" / "fail_command_r_real" / "config.json").read_text())
    (f,) = only(cmdr, "KV506")
    assert f.severity == "warning" and "vLLM uses the smallest, 8192" in f.message and f.path == "model_max_length"


def test_resaved_alibi_config_with_default_rope_attributes_is_clean() -> None:
    falcon_rw = {"model_type": "falcon", "hidden_size": 16, "num_attention_heads": 4, "num_hidden_layers": 2,
                 "vocab_size": 32, "alibi": True, "multi_query": False, "rope_theta": 10000.0, "rope_scaling": None,
                 "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}
    assert not only(falcon_rw, "KV505")
    (f,) = only({**falcon_rw, "rope_theta": 500000.0}, "KV505")
    assert "alibi" in f.message and f.path == "rope_theta"


def test_added_tokens_decoder_beyond_vocab(tmp_path) -> None:
    write_config(tmp_path, LLAMA)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"added_tokens_decoder": {"0": {"content": "<unk>"}, "33": {"content": "<|im_end|>"}}}))
    (f,) = [x for x in lint_one(str(tmp_path), LintOptions()).findings if x.code == "KV503"]
    assert "added_tokens_decoder has ids up to 33" in f.message


def test_number_bounds_kv906_and_who_reports_a_key(tmp_path) -> None:
    """KV906 reports what no other rule does (10^9 layers); a specific error on the key replaces it, and a
    warning (KV002's NaN token) does not hide the error the schema reports."""

    def lint(**over):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        write_config(folder, {**LLAMA, **over})
        return [(f.code, f.path, f.severity) for f in lint_one(str(folder), LintOptions()).findings]

    assert ("KV906", "num_hidden_layers", "error") in lint(num_hidden_layers=10**9)
    heads = lint(num_key_value_heads=0)
    assert ("KV101", "num_key_value_heads", "error") in heads and not [c for c in heads if c[0] == "KV906"]
    nan = lint(num_attention_heads=float("nan"))
    assert ("KV002", "num_attention_heads", "warning") in nan
    assert [c for c in nan if c[2] == "error" and c[1] == "num_attention_heads"], nan
