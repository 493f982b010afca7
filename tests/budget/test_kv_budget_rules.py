"""The vLLM rules kvcache.py and the GPU table encode: paged sizing per layer kind, the
tensor-parallel head split and refusals, and every GPU table entry."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from budget_helpers import run

from kvtool.model import kvcache
from kvtool.budget import gpus
from kvtool.budget.variants import Variant, parse
from kvtool.errors import UsageError

FULL = kvcache.LayerKV(0, "full_attention", "GQA", 8, 128, None, 2 * 8 * 128, 32)
SLIDING = kvcache.LayerKV(1, "sliding_attention", "GQA", 8, 128, 4096, 2 * 8 * 128, 32)
CHUNKED = kvcache.LayerKV(2, "chunked_attention", "GQA", 8, 128, 8192, 2 * 8 * 128, 32)
MLA = kvcache.LayerKV(3, "full_attention", "MLA", 1, 576, None, 576, 128)
MAMBA = kvcache.LayerKV(4, "mamba", "none", 0, 0, None, 0, 32)


def test_paged_tokens_by_layer_kind():
    assert FULL.paged_tokens(1000, 16, 2048) == 1008  # 63 blocks
    assert FULL.paged_tokens(1024, 16, 2048) == 1024
    assert SLIDING.paged_tokens(100_000, 16, 2048) == (-(-(4095 + 2048) // 16) + 1) * 16
    assert SLIDING.paged_tokens(100, 16, 2048) == (7 + 1) * 16  # short sequence: all of it plus one block
    assert CHUNKED.paged_tokens(100_000, 16, 2048) == 8192 + 2048
    assert CHUNKED.paged_tokens(5000, 16, 2048) == 5008
    assert MAMBA.paged_tokens(100_000, 16, 2048) == 0
    assert FULL.paged_tokens(0, 16, 2048) == 0


@given(seq=st.integers(1, 300_000), bs=st.sampled_from([1, 8, 16, 32, 64, 128]), step=st.integers(1, 16384),
       window=st.integers(1, 200_000))
def test_paged_tokens_whole_blocks_and_never_less_than_held(seq, bs, step, window):
    for layer in (FULL, kvcache.LayerKV(1, "sliding_attention", "GQA", 8, 128, window, 2048, 32),
                  kvcache.LayerKV(2, "chunked_attention", "GQA", 8, 128, window, 2048, 32)):
        got = layer.paged_tokens(seq, bs, step)
        assert got % bs == 0
        assert got >= layer.tokens_cached(seq)
        assert got <= -(-seq // bs) * bs + bs  # at most one block beyond the full sequence


@pytest.mark.parametrize("heads, kv, tp, per_gpu, replicas, refused", [
    (32, 8, 1, 8, 1, None),
    (32, 8, 2, 4, 1, None),
    (32, 8, 8, 1, 1, None),
    (32, 8, 16, 1, 2, None),
    (32, 8, 32, 1, 4, None),
    (32, 8, 3, None, None, "num_attention_heads (32)"),
    (28, 4, 7, None, None, "not a multiple of num_key_value_heads (4)"),
    (48, 12, 8, None, None, "num_key_value_heads (12) is not divisible"),
    (64, 1, 8, 1, 8, None),  # MQA: the one head lives on every GPU
])
def test_tensor_parallel_split(heads, kv, tp, per_gpu, replicas, refused):
    why = kvcache.tp_refusal(heads, kv, tp)
    if refused:
        assert why is not None and refused in why
        return
    assert why is None
    assert kvcache.kv_heads_per_gpu(kv, tp) == per_gpu
    assert kvcache.kv_replication(kv, tp) == replicas


def test_mla_under_tp_only_needs_query_heads_to_divide():
    assert kvcache.tp_refusal(128, 128, 16, mla=True) is None
    assert kvcache.tp_refusal(128, 128, 3, mla=True) is not None
    assert MLA.on_gpu(8) == MLA


def test_layer_on_gpu_keeps_at_least_one_head():
    assert FULL.on_gpu(2).kv_heads == 4 and FULL.on_gpu(2).elements_per_token == 2 * 4 * 128
    assert FULL.on_gpu(64).kv_heads == 1 and FULL.on_gpu(64).elements_per_token == 2 * 128


def test_every_gpu_table_entry_resolves_by_name_and_alias():
    data = json.loads((Path(gpus.__file__).with_name("gpus.json")).read_text())
    assert len(data["gpus"]) >= 10
    for row in data["gpus"]:
        for name in (row["name"], *row["aliases"]):
            g = gpus.resolve(name)
            assert g.name == row["name"] and g.memory_bytes == row["memory_mib"] * 2**20
            assert g.basis in ("nvidia-smi", "nominal")
    assert gpus.resolve("nvidia h200").memory_bytes == 143_771 * 2**20
    assert gpus.resolve("a100-sxm4-80gb").name == "A100-80GB"
    for required in ("H100-80GB", "H200", "A100-40GB", "A100-80GB", "L40S", "RTX-4090"):
        assert required in gpus.names()


def test_vllm_scheduler_default_depends_on_gpu():
    from kvtool.budget.batch import defaults

    step = {g: defaults(gpus.resolve(g), "0.33.0").max_num_batched_tokens
            for g in ("H100", "H200", "A100-80GB", "L40S", "80GiB", "B200", "MI300X", "GB10")}
    # A100s and GB10 stay on the small tier on purpose; >= 160 GiB steps 16,384 from 0.28
    assert step == {"H100": 8192, "H200": 8192, "A100-80GB": 2048, "L40S": 2048, "80GiB": 8192, "B200": 16384,
                    "MI300X": 16384, "GB10": 2048}
    assert defaults(gpus.resolve("B200"), "0.27.1").max_num_batched_tokens == 8192
    assert defaults(gpus.resolve("GB10"), "0.32.0").max_num_batched_tokens == 8192
    assert gpus.resolve("80GiB").basis == "user"


def test_what_if_grammar():
    assert parse("gqa:8, mqa ,fp8,gqa:4+fp8,mha", num_heads=32, is_mla=False) == [
        Variant("gqa:8", 8, None), Variant("mqa", 1, None), Variant("fp8", None, "fp8"),
        Variant("gqa:4+fp8", 4, "fp8"), Variant("mha", 32, None)]
    assert parse("fp8", num_heads=128, is_mla=True) == [Variant("fp8", None, "fp8")]
    for bad in ("gqa:0", "gqa:64", "gqa:6", "auto", "fp4"):
        with pytest.raises(UsageError):
            parse(bad, num_heads=32, is_mla=False)


def _rows(kinds: list[tuple[str, int | None]]) -> list:
    from kvtool.budget.budget import LayerRow

    rows = []
    for i, (lt, window) in enumerate(kinds):
        lay = kvcache.LayerKV(i, lt, "GQA", 8, 128, window, 2048, 32)
        rows.append(LayerRow(lay, lay, 4096, 4096, 100, 409_600, 409_600))
    return rows


@pytest.mark.parametrize("full, sliding, padding", [
    (4, 22, 2),    # Gemma-3-1B: groups of 4, 22 sliding -> 24 slots
    (3, 15, 0),    # Gemma-3-270M: 5:1, no padding
    (10, 52, 8),   # Gemma-3-27B: groups of 10, 52 sliding -> 60 slots
    (12, 12, 0),   # gpt-oss-20b alternating
    (13, 12, 1),   # gpt-oss-20b + an EAGLE full layer: 12 < 1.5 x 13, groups of 13
    (0, 32, 0),    # Mistral v0.1: one kind only
])
def test_vllm_group_padding(full, sliding, padding):
    from kvtool.budget.budget import group_padding

    rows = _rows([("full_attention", None)] * full + [("sliding_attention", 4096)] * sliding)
    pads = group_padding(rows, hybrid=True)
    assert sum(p.count for p in pads) == padding
    assert all(p.layer_type == "sliding_attention" and p.bytes_per_sequence == p.count * 409_600 for p in pads)
    assert group_padding(rows, hybrid=False) == []  # one group when the hybrid allocator is off


@pytest.mark.parametrize(("edit", "field", "said"), [
    ({"head_dim": None, "hidden_size": 5120, "num_attention_heads": 24, "num_key_value_heads": 4}, "head_dim",
     "hidden_size 5,120 does not split into 24 heads"),
    ({"num_attention_heads": None, "num_key_value_heads": None}, "num_key_value_heads", "KV head count is unknown"),
])
def test_an_unknown_head_size_is_refused_not_zero_bytes(tmp_path, capsys, edit, field, said) -> None:
    """A null head_dim whose hidden_size does not split over the heads used to give attention layers 0 B per
    token (a KV budget of nothing) with exit 0; now one exit-2 line naming the key."""
    cfg = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4,
           "num_key_value_heads": 2, "max_position_embeddings": 128, "vocab_size": 100, "torch_dtype": "bfloat16"}
    cfg.update(edit)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(cfg))
    rc, out, err = run(capsys, str(tmp_path / "m"))
    assert rc == 2 and out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"kvtool: error: {tmp_path / 'm' / 'config.json'}: {field}: ") and said in err, err
