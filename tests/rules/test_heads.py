"""KV1xx: KV heads, tensor-parallel divisibility (vLLM's rules), head_dim, rotary dimension."""

from __future__ import annotations

import pytest
from rules_helpers import LLAMA, codes, only


def _vllm_accepts(h: int, kv: int, tp: int) -> bool:
    """vLLM's start-up checks, restated: ModelConfig.verify_with_parallel_config and QKVParallelLinear."""
    if h % tp:
        return False  # "Total number of attention heads must be divisible by tensor parallel size"
    if tp >= kv:
        return tp % kv == 0  # divide(tp_size, total_num_kv_heads): KV heads replicated
    return kv % tp == 0  # divide(total_num_kv_heads, tp_size)


@pytest.mark.parametrize("h", [1, 4, 6, 8, 9, 12, 15, 28, 32, 40, 64])
def test_tp_rules_match_vllm(h: int) -> None:
    for kv in [d for d in range(1, h + 1) if h % d == 0]:
        for tp in range(2, 17):
            cfg = {**LLAMA, "hidden_size": h * 4, "num_attention_heads": h, "num_key_value_heads": kv}
            got = {c for c in codes(cfg, tensor_parallel_size=tp) if c in ("KV103", "KV104")}
            assert (not got) == _vllm_accepts(h, kv, tp), (h, kv, tp, got)
            assert ("KV103" in got) == bool(h % tp), (h, kv, tp, got)


def test_tp_messages_name_fields_and_working_sizes() -> None:
    cfg = {**LLAMA, "hidden_size": 60, "num_attention_heads": 15, "num_key_value_heads": 5}  # SmolLM2-360M shape
    (q,) = only(cfg, "KV103", tensor_parallel_size=8)
    assert q.path == "num_attention_heads" and "15" in q.message and "[1, 5, 15]" in q.message
    (k,) = only(cfg, "KV104", tensor_parallel_size=8)
    assert k.path == "num_key_value_heads" and "8 must be a multiple of 5" in k.message


def test_tp_not_checked_without_option_and_mha_reports_once() -> None:
    mha = {**LLAMA, "hidden_size": 48, "num_attention_heads": 12, "num_key_value_heads": 12}
    assert not {"KV103", "KV104"} & set(codes(mha))
    got = codes(mha, tensor_parallel_size=8)
    assert got.count("KV103") == 1 and "KV104" not in got


def test_mla_tp_checks_query_heads_only() -> None:
    from rules_helpers import DEEPSEEK

    assert "KV104" not in codes({**DEEPSEEK, "num_key_value_heads": 3}, tensor_parallel_size=2)
    assert "KV103" in codes({**DEEPSEEK, "num_attention_heads": 6}, tensor_parallel_size=4)


def test_head_dim_info_and_error() -> None:
    (info,) = only({**LLAMA, "head_dim": 8}, "KV105")
    assert info.severity == "info" and "hidden_size / num_attention_heads = 16 / 4 = 4" in info.message
    assert not only({**LLAMA, "head_dim": 4}, "KV105")
    (err,) = only({**LLAMA, "hidden_size": 18}, "KV106")
    assert err.severity == "error" and err.path == "hidden_size" and "4.500" in err.message
    mistral = {**LLAMA, "model_type": "mistral", "architectures": ["MistralForCausalLM"]}
    assert not only({**mistral, "hidden_size": 18, "head_dim": 4}, "KV106")
    # LlamaConfig.validate_architecture refuses hidden % heads whatever head_dim says
    (llama_err,) = only({**LLAMA, "hidden_size": 18, "head_dim": 4}, "KV106")
    assert "validate_architecture" in llama_err.message


@pytest.mark.parametrize("extra,odd", [
    ({"head_dim": 5, "hidden_size": 20}, True),
    ({"head_dim": 16, "hidden_size": 64, "partial_rotary_factor": 0.3125}, True),  # 5 dims
    ({"head_dim": 16, "hidden_size": 64, "partial_rotary_factor": 0.25}, False),  # 4 dims
    ({"head_dim": 16, "hidden_size": 64, "partial_rotary_factor": 1.5}, True),  # not in (0, 1]
])
def test_rotary_dim_even(extra: dict, odd: bool) -> None:
    cfg = {**LLAMA, "model_type": "stablelm", **extra}
    assert bool(only(cfg, "KV107")) == odd
