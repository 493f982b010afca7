"""Mamba / linear-attention state and the hybrid attention block size (kvtool/budget/recurrent*.py) against vLLM
0.33.0's own code (verbatim excerpts under tests/data/vllm/0.33.0/, run as written where pure) and against
figures worked by hand from two real configs: Qwen3.5-27B (gated delta net) and Nemotron-H-56B (Mamba2)."""

from __future__ import annotations

import __future__
import json
import math
import types
from pathlib import Path

import pytest
from budget_helpers import run_json
from kvtest import run_without_torch

from kvtool.budget import recurrent
from kvtool.model.spec import build_spec

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "tests" / "data" / "configs"
VLLM = ROOT / "tests" / "data" / "vllm" / "0.33.0"
QWEN35 = CONFIGS / "qwen3.5-27b.json"
NEMOTRON = CONFIGS / "nemotron-h-56b-base-8k.json"
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def _excerpt(name: str) -> str:
    for path in sorted(VLLM.glob("*.txt")):
        text = path.read_text(encoding="utf-8")
        head = f"\n# --- {name} (lines"
        if head in text:
            return text.split(head, 1)[1].split("\n", 1)[1].split("\n# --- ", 1)[0]
    raise LookupError(name)


def _exec(*names: str, **ns) -> dict:
    ns.setdefault("__builtins__", __builtins__)
    for name in names:
        exec(compile(_excerpt(name), name, "exec", flags=__future__.annotations.compiler_flag), ns)  # noqa: S102
    return ns


def _divide(a: int, b: int) -> int:  # vllm.distributed.utils.divide: exact division or an error
    assert a % b == 0, (a, b)
    return a // b


def _calculator() -> type:
    ns = _exec("MambaStateShapeCalculator", divide=_divide, is_conv_state_dim_first=lambda: False)
    return ns["MambaStateShapeCalculator"]


def _spec(path: Path):
    return build_spec(json.loads(path.read_text()))


def _vllm_config(config: dict, tp: int):
    inner = types.SimpleNamespace(**config.get("text_config", config))
    return types.SimpleNamespace(
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp), speculative_config=None,
        num_speculative_tokens=0, cache_config=types.SimpleNamespace(use_replayssm=False),
        model_config=types.SimpleNamespace(hf_config=inner, hf_text_config=inner))


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
@pytest.mark.parametrize("path, method", [
    (QWEN35, "Qwen3NextForCausalLM.get_mamba_state_shape_from_config"),  # Qwen3.5's is the same call
    (NEMOTRON, "NemotronHForCausalLM.get_mamba_state_shape_from_config"),
])
def test_state_shapes_are_vllms(path, method, tp) -> None:
    """The model's own get_mamba_state_shape_from_config over MambaStateShapeCalculator, run as vLLM wrote them."""
    config = json.loads(path.read_text())
    get = _exec(method, MambaStateShapeCalculator=_calculator())[method.split(".")[1]]
    conv, ssm = get.__func__(None, _vllm_config(config, tp))[:2]
    lay = recurrent.layout(_spec(path), tp)
    assert (lay.conv_elements, lay.ssm_elements) == (math.prod(conv), math.prod(ssm))


def test_qwen3_5_reads_the_same_keys_as_qwen3_next() -> None:
    """The Qwen3.5 row restates Qwen3-Next's shape call: vLLM 0.33.0's qwen3_5.py passes the same config keys."""
    src = (VLLM / "vllm__model_executor__models__qwen3_next.py.txt").read_text()
    rows = {r["model_types"][0]: r for r in recurrent.table()["models"]}
    assert rows["qwen3_next"]["params"] == rows["qwen3_5"]["params"]
    for key in rows["qwen3_next"]["params"].values():
        assert f"hf_config.{key}" in src


@pytest.mark.parametrize("model_type, excerpt, key", [
    ("granitemoehybrid", "GraniteMoeHybridForCausalLM.get_mamba_state_shape_from_config", "mamba_n_heads"),
    ("jamba", "JambaForCausalLM.get_mamba_state_shape_from_config", "mamba_d_state"),
])
def test_other_rows_read_the_keys_vllm_reads(model_type, excerpt, key) -> None:
    """Rows without a config here: each key (or factor of a product) is one the model's vLLM code reads, and the
    row's kind is the calculator it calls."""
    row = next(r for r in recurrent.table()["models"] if model_type in r["model_types"])
    code = _excerpt(excerpt)
    assert f"{row['kind']}_state_shape(" in code and key in row["params"].values()
    for expr in row["params"].values():
        for k in expr.split("*"):
            assert f"hf_config.{k}" in code, k


@pytest.mark.parametrize("path, cls, ssm", [
    (NEMOTRON, "NemotronHForCausalLMConfig", "float32"),  # the config names none: vLLM's default
    (QWEN35, "Qwen3_5ForConditionalGenerationConfig", "float32"),  # the config's mamba_ssm_dtype
])
def test_ssm_dtype_is_what_vllm_sets(path, cls, ssm) -> None:
    """The model's verify_and_update_config, run as written, turns mamba_ssm_cache_dtype auto into the dtype
    the table row gives."""
    config = json.loads(path.read_text())
    ns = _exec(cls, VerifyAndUpdateConfig=object, logger=types.SimpleNamespace(info=print, warning=print),
               MambaDType=str)
    vc = _vllm_config(config, 1)
    vc.cache_config = types.SimpleNamespace(mamba_ssm_cache_dtype="auto")
    ns[cls].verify_and_update_config(vc)
    lay = recurrent.layout(_spec(path))
    assert vc.cache_config.mamba_ssm_cache_dtype == lay.ssm_dtype == ssm
    assert lay.ssm_bytes == DTYPE_BYTES[ssm] and lay.conv_bytes == 2  # conv state: the bf16 model dtype


def test_page_and_slots_are_mambaspecs() -> None:
    """MambaSpec.page_size_bytes (padded when padding is set) and max_memory_usage_bytes: one page per sequence
    with mamba_cache_mode none and no speculative blocks."""
    ns = _exec("MambaSpec.page_size_bytes", "MambaSpec.max_memory_usage_bytes", prod=math.prod,
               get_dtype_size=DTYPE_BYTES.__getitem__, property=lambda f: f)
    lay = recurrent.layout(_spec(NEMOTRON))
    spec = types.SimpleNamespace(shapes=((lay.conv_elements,), (lay.ssm_elements,)), dtypes=("bfloat16", "float32"),
                                 page_size_padded=None, num_speculative_blocks=0)
    assert ns["page_size_bytes"](spec) == lay.page_bytes
    spec.page_size_bytes = ns["page_size_bytes"](spec)
    vc = types.SimpleNamespace(cache_config=types.SimpleNamespace(mamba_cache_mode="none"))
    assert ns["max_memory_usage_bytes"](spec, vc) == lay.page_bytes


def test_block_rule_is_the_one_vllm_applies() -> None:
    """Platform._align_hybrid_block_size: the smallest multiple of the kernel alignment whose attention page holds
    a state page, the state page then padded to the attention page."""
    code = " ".join(_excerpt("Platform._align_hybrid_block_size").split())
    for line in ("attn_block_size = kernel_block_alignment_size * cdiv(",
                 "mamba_page_size, kernel_block_alignment_size * attn_page_size_1_token, )",
                 "attn_page_size = cache_config.block_size * attn_page_size_1_token",
                 "cache_config.mamba_page_size_padded = attn_page_size"):
        assert line in code, line
    assert recurrent.attention_block_size(65536, 4096, 16) == 16
    assert recurrent.attention_block_size(65537, 4096, 16) == 32


def test_qwen3_5_27b_by_hand(capsys) -> None:
    """48 gated-delta-net layers, 16 full-attention layers (4 KV heads x 256, bf16), mamba_ssm_dtype float32.
    conv (128 x 16 x 2 + 128 x 48) x 3 = 30,720 elements x 2 B; SSM 48 x 128 x 128 = 786,432 x 4 B;
    page 3,207,168 B. Attention 2 x 4 x 256 x 2 = 4,096 B per token: block 16 x ceil(3,207,168 / 65,536) = 784,
    padded page 784 x 4,096 = 3,211,264 B. Groups of 16 (16 attention, 48 state layers): no padding."""
    d = run_json(capsys, str(QWEN35), "--max-model-len", "32768")
    assert d["attention_block_size"] == 784
    st = d["recurrent_state"]
    assert (st["conv_elements_per_gpu"], st["ssm_elements_per_gpu"], st["page_bytes_per_gpu"]) == (
        30_720, 786_432, 3_207_168)
    assert st["padded_page_bytes_per_gpu"] == 3_211_264 and st["bytes_per_sequence"] == 48 * 3_211_264
    assert d["padding_layers"] == []
    attention = 42 * 784 * 4096 * 16  # ceil(32,768 / 784) = 42 blocks per full layer
    assert d["kv_bytes_per_sequence"] == attention + 48 * 3_211_264


def test_nemotron_h_56b_by_hand(capsys) -> None:
    """54 Mamba2 layers (256 heads x 64, 8 groups, state 256, kernel 4), 10 attention layers (8 KV heads x 128):
    conv (16,384 + 2 x 8 x 256) x 3 = 61,440 x 2 B; SSM 256 x 64 x 256 = 4,194,304 x 4 B (float32, vLLM's
    NemotronH default) = 16,900,096 B. Attention 4,096 B per token: block 16 x ceil(16,900,096 / 65,536) = 4,128,
    page 16,908,288 B. Groups of 10: 54 state layers take 60 slots, 6 of them padding."""
    d = run_json(capsys, str(NEMOTRON), "--gpu", "H200")
    assert d["attention_block_size"] == 4128
    st = d["recurrent_state"]
    assert (st["page_bytes_per_gpu"], st["padded_page_bytes_per_gpu"]) == (16_900_096, 16_908_288)
    assert d["padding_layers"] == [{"layer_type": "mamba", "count": 6, "bytes_per_sequence": 6 * 16_908_288,
                                    "bytes_per_sequence_per_gpu": 6 * 16_908_288}]
    per_seq = 8256 * 4096 * 10 + 60 * 16_908_288  # ceil(8,192 / 4,128) = 2 blocks of 4,128 tokens
    assert d["kv_bytes_per_sequence"] == per_seq
    assert d["max_concurrent_sequences"] == int(d["kv_pool_bytes_per_gpu"] // per_seq)


def test_nemotron_h_tp4_by_hand(capsys) -> None:
    """TP 4: conv 20,480 / 4 x 3 = 15,360 x 2 B, SSM 64 x 64 x 256 = 1,048,576 x 4 B: 4,225,024 B. Attention
    2 KV heads per GPU: 1,024 B per token, block 16 x ceil(4,225,024 / 16,384) = 4,128, page 4,227,072 B."""
    d = run_json(capsys, str(NEMOTRON), "--tensor-parallel-size", "4")
    st = d["recurrent_state"]
    assert d["attention_block_size"] == 4128
    assert (st["page_bytes_per_gpu"], st["padded_page_bytes_per_gpu"]) == (4_225_024, 4_227_072)
    assert d["kv_bytes_per_sequence_per_gpu"] == 8256 * 1024 * 10 + 60 * 4_227_072


def test_text_report_and_no_torch() -> None:
    """The text report names the raised block size and the state, and kv-budget imports no torch for it."""
    r = run_without_torch(["kv-budget", NEMOTRON])
    assert r.returncode == 0, r.stderr
    assert "block size 4128 (vLLM's for this hybrid; --block-size 16)" in r.stdout
    assert "of it recurrent state" in r.stdout and "mamba2 state" in r.stdout


def test_vllm_0_12_by_hand(capsys) -> None:
    """vLLM 0.12.0 keeps Nemotron-H's SSM state in bf16 (no float32 default yet): 61,440 x 2 + 4,194,304 x 2 =
    8,511,488 B; block 16 x ceil(8,511,488 / 65,536) = 2,080, page 2,080 x 4,096 = 8,519,680 B. With --block-size 100
    it keeps the multiple of 16 (the newest release takes 100 x ceil(16,900,096 / 409,600) = 4,200)."""
    d = run_json(capsys, str(NEMOTRON), "--engine", "vllm==0.12.0")
    st = d["recurrent_state"]
    assert (d["attention_block_size"], st["ssm_dtype"]) == (2080, "bfloat16")
    assert (st["page_bytes_per_gpu"], st["padded_page_bytes_per_gpu"]) == (8_511_488, 8_519_680)
    assert any("mamba_ssm" not in n and "multiple of 16" in n for n in d["notes"])
    assert run_json(capsys, str(NEMOTRON), "--engine", "vllm==0.12.0", "--block-size", "100")[
        "attention_block_size"] == 2080
    assert run_json(capsys, str(NEMOTRON), "--block-size", "100")["attention_block_size"] == 4200


def test_vllm_0_10_0_keeps_the_state_in_the_kv_dtype(capsys) -> None:
    """vLLM 0.10.0 builds the state page in the KV-cache dtype: fp8 gives 61,440 + 4,194,304 = 4,255,744 B, and
    fp8 attention (2,048 B per token) a block of 16 x ceil(4,255,744 / 32,768) = 2,080."""
    d = run_json(capsys, str(NEMOTRON), "--engine", "vllm==0.10.0", "--kv-cache-dtype", "fp8")
    st = d["recurrent_state"]
    assert (st["conv_bytes_per_element"], st["ssm_bytes_per_element"], st["page_bytes_per_gpu"]) == (1, 1, 4_255_744)
    assert d["attention_block_size"] == 2080


def test_a_state_config_missing_a_key_keeps_the_block_and_names_the_key(tmp_path, capsys) -> None:
    config = json.loads(NEMOTRON.read_text())
    del config["ssm_state_size"]
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    d = run_json(capsys, str(tmp_path / "m"))
    assert d["attention_block_size"] == 16 and d["recurrent_state"] is None
    assert any("not counted" in n and "lacks ssm_state_size" in n for n in d["notes"])


def test_a_state_model_without_a_row_says_so(tmp_path, capsys) -> None:
    config = json.loads(NEMOTRON.read_text())
    config["model_type"] = "nemotron_h_unknown"
    config["layer_types"] = ["mamba", "full_attention"] * 2
    config["num_hidden_layers"] = 4
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    d = run_json(capsys, str(tmp_path / "m"))
    assert d["recurrent_state"] is None
    assert any("not counted" in n and "recurrent_state.json" in n for n in d["notes"])


@pytest.mark.parametrize(("path", "key", "value", "shown"), [
    (NEMOTRON, "mamba_num_heads", "256", "'256'"),
    (NEMOTRON, "mamba_head_dim", None, "null"),
    (NEMOTRON, "mamba_num_heads", 2.5, "2.5"),
    (NEMOTRON, "conv_kernel", 0, "0"),
    (NEMOTRON, "mamba_num_heads", 10**15, "1000000000000000"),
    (NEMOTRON, "mamba_ssm_cache_dtype", "garbage", "'garbage'"),
    (NEMOTRON, "mamba_ssm_cache_dtype", 5, "5"),
    (QWEN35, "linear_num_value_heads", 0, "0"),
    (QWEN35, "linear_num_value_heads", "x", "'x'"),
    (QWEN35, "mamba_ssm_dtype", "float64", "'float64'"),
])
def test_a_state_key_vllm_cannot_build_is_one_line(tmp_path, capsys, path, key, value, shown) -> None:
    """A state dimension that is not a positive integer (or an SSM dtype no engine names) was silently dropped
    from the figures, or multiplied into a block of 10^16 tokens: now one exit-2 line naming file and key."""
    config = json.loads(path.read_text())
    (config.get("text_config") or config)[key] = value
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    from kvtool.cli import main

    rc = main(["kv-budget", str(tmp_path / "m")])
    out, err = capsys.readouterr()
    prefix = "text_config." if "text_config" in config else ""
    assert rc == 2 and out == ""
    assert err.startswith(f"kvtool: error: {tmp_path / 'm' / 'config.json'}: {prefix}{key}: got {shown}; "), err
    assert len(err.splitlines()) == 1


# Qwen3-Next-80B-A3B's published dimensions (no stored config here): 48 layers, every 4th full attention,
# 2 KV heads x 256, 16 key / 32 value heads of 128 in the gated delta net, conv kernel 4, bf16.
QWEN3_NEXT = {"model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "num_hidden_layers": 48,
              "full_attention_interval": 4, "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 2,
              "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
              "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4, "max_position_embeddings": 262144,
              "torch_dtype": "bfloat16", "vocab_size": 151936, "intermediate_size": 5120}


def test_qwen3_next_by_hand(tmp_path, capsys) -> None:
    """conv (128 x 16 x 2 + 128 x 32) x 3 = 24,576 x 2 B; SSM 32 x 128 x 128 = 524,288 x 2 B (Qwen3-Next has no
    SSM dtype of its own: the model's bf16); page 1,097,728 B. Attention 2 x 2 x 256 x 2 = 2,048 B per token:
    block 16 x ceil(1,097,728 / 32,768) = 544, page 1,114,112 B. 36 state + 12 attention layers, groups of 12."""
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(QWEN3_NEXT))
    d = run_json(capsys, str(tmp_path / "m"))
    st = d["recurrent_state"]
    assert (st["kind"], st["layers"], st["ssm_dtype"]) == ("gated_delta_net", 36, "bfloat16")
    assert (st["page_bytes_per_gpu"], d["attention_block_size"], st["padded_page_bytes_per_gpu"]) == (
        1_097_728, 544, 1_114_112)
    assert d["padding_layers"] == []
    # ceil(262,144 / 544) = 482 blocks of 544 tokens in each of the 12 attention layers
    assert d["kv_bytes_per_sequence"] == 482 * 544 * 2048 * 12 + 36 * 1_114_112
    lay = recurrent.layout(build_spec(QWEN3_NEXT), 2)  # T 2: every factor halves
    assert (lay.conv_elements, lay.ssm_elements) == (12_288, 262_144)


@pytest.mark.parametrize(("dtype", "width"), [("auto", 2), ("fp8", 1)])
def test_a_model_of_state_layers_only_shows_its_dtypes_width(tmp_path, capsys, dtype, width) -> None:
    """No attention layer caches an element: the header said 'bfloat16 (0 B/element)'; it shows the dtype's width."""
    config = json.loads(NEMOTRON.read_text())
    config.update(hybrid_override_pattern="MMMM", num_hidden_layers=4)
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    d = run_json(capsys, str(tmp_path / "m"), "--kv-cache-dtype", dtype)
    assert d["kv_bytes_per_element"] == width and d["recurrent_state"] is not None
