"""KV4xx: MLA dimensions (the GLM-5.2 defect) and MoE fields."""

from __future__ import annotations

import json

from rules_helpers import DEEPSEEK, FIXTURES, codes, only


def _real(code: str, case: str) -> dict:
    return json.loads((FIXTURES / code / case / "config.json").read_text())


def test_glm52_head_dim_conflict_is_an_error_and_glm5_is_clean() -> None:
    (f,) = only(_real("KV403", "fail_glm52"), "KV403")
    assert f.severity == "error" and f.path == "head_dim"
    assert "head_dim = 192" in f.message and "qk_rope_head_dim = 64" in f.message and "46739" in f.message
    glm5 = codes(_real("KV403", "pass_glm5"))
    assert not {c for c in glm5 if c.startswith("KV4")}, glm5


def test_mla_dims() -> None:
    (f,) = only({**DEEPSEEK, "kv_lora_rank": -16}, "KV401")
    assert f.path == "kv_lora_rank" and "-16" in f.message
    assert not only({**DEEPSEEK, "q_lora_rank": 24}, "KV401")
    (odd,) = only({**DEEPSEEK, "qk_rope_head_dim": 9}, "KV402")
    assert "9" in odd.message
    (qk,) = only({**DEEPSEEK, "qk_head_dim": 20}, "KV403")
    assert "8 + 8 = 16" in qk.message


def test_mla_rules_ignore_non_mla_models() -> None:
    from rules_helpers import LLAMA

    assert not {c for c in codes({**LLAMA, "head_dim": 4}) if c.startswith("KV4")}


def test_moe_top_k_and_shared() -> None:
    (k,) = only({**DEEPSEEK, "num_experts_per_tok": 9}, "KV411")
    assert "num_experts_per_tok = 9 exceeds n_routed_experts = 8" in k.message
    (s,) = only({**DEEPSEEK, "n_shared_experts": 1.5}, "KV412")
    assert s.path == "n_shared_experts"


def test_moe_layer_placement_and_groups() -> None:
    (f,) = only({**DEEPSEEK, "first_k_dense_replace": 3}, "KV413")
    assert "first_k_dense_replace = 3 exceeds num_hidden_layers = 2" in f.message
    assert not only({**DEEPSEEK, "first_k_dense_replace": 2}, "KV413")  # all dense: legal
    (g,) = only({**DEEPSEEK, "n_group": 3}, "KV414")
    assert "n_routed_experts = 8 is not divisible by n_group = 3" in g.message
    (t,) = only({**DEEPSEEK, "topk_group": 0}, "KV414")
    assert "between 1 and n_group = 2" in t.message
