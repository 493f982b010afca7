"""kv-budget as users run it: weights from safetensors headers, GPU fit and exit codes, errors,
--plot, hub ids, and no torch / transformers import."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from budget_helpers import GIB, config, run, run_json

from kvtest import write_config, write_safetensors

TINY = {
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
    "max_position_embeddings": 256, "torch_dtype": "float16", "tie_word_embeddings": False,
}


@pytest.fixture
def tiny(tmp_path):
    folder = tmp_path / "tiny"
    write_config(folder, TINY)
    # Two shards of known size: 128x64 + 64x64 fp16 and 4096 fp32 values.
    write_safetensors(folder / "a.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float16),
                                                 "lm_head.weight": np.zeros((64, 64), np.float16)})
    write_safetensors(folder / "b.safetensors", {"x": np.zeros(4096, np.float32)})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {
        "model.embed_tokens.weight": "a.safetensors", "lm_head.weight": "a.safetensors", "x": "b.safetensors"}}))
    return folder


def test_weights_from_safetensors_headers_and_the_pool(tiny, capsys):
    # vLLM loads float32 tensors in 16 bits (dtype auto), so the 4096 fp32 values count 2 bytes each.
    weights = 128 * 64 * 2 + 64 * 64 * 2 + 4096 * 2
    # 2 layers x 2 KV heads x head_dim 16 x K,V x 2 bytes = 256 B per token; 256 tokens = 65,536 B a sequence.
    d = run_json(capsys, str(tiny), "--gpu-memory", "2MiB", "--gpu-memory-utilization", "0.5")
    assert d["weight_source"] == "safetensors" and d["weight_bytes"] == weights
    assert any("float32 tensors counted at 2 bytes" in n for n in d["notes"])
    assert d["kv_bytes_per_token"] == 2 * 2 * 16 * 2 * 2
    pool = 2 * 2**20 * 0.5 - weights
    assert d["kv_pool_bytes_per_gpu"] == pool
    assert d["max_concurrent_sequences"] == int(pool // (256 * 256))
    assert d["gpu"] == {"name": "2MiB", "memory_bytes": 2 * 2**20, "memory_basis": "user",
                        "gpu_memory_utilization": 0.5, "reserve_bytes": 0, "kv_budget_bytes": 2**20}


def test_reserve_and_tp_shrink_the_pool(tiny, capsys):
    weights = 128 * 64 * 2 + 64 * 64 * 2 + 4096 * 2
    d = run_json(capsys, str(tiny), "--gpu-memory", "2MiB", "--reserve", "100KiB", "-tp", "2")
    assert d["weight_bytes_per_gpu"] == weights / 2
    assert d["kv_pool_bytes_per_gpu"] == pytest.approx(2 * 2**20 * 0.9 - 100 * 1024 - weights / 2)
    assert d["kv_bytes_per_token_per_gpu"] == 2 * 1 * 16 * 2 * 2


def test_batch_that_does_not_fit_exits_1_and_one_that_fits_exits_0(tiny, capsys):
    ok = run_json(capsys, str(tiny), "--gpu-memory", "2MiB", "--batch", "3")
    assert ok["fits"] is True and ok["max_concurrent_sequences"] >= 3
    too_many = ok["max_concurrent_sequences"] + 1
    rc, out, _ = run(capsys, str(tiny), "--gpu-memory", "2MiB", "--concurrency", str(too_many))
    assert rc == 1
    assert f"does not fit: {too_many} sequences of 256 tokens asked, at most {too_many - 1} fit" in out


def test_weights_alone_over_budget_say_does_not_fit(tiny, capsys):
    rc, out, _ = run(capsys, str(tiny), "--gpu-memory", "20KiB")
    assert rc == 1
    assert "does not fit: the weights alone exceed the GPU budget" in out
    assert "KV pool" in out and "none: weights need" in out


def test_text_report_shows_layers_what_if_and_fit(capsys):
    rc, out, _ = run(capsys, config("gemma-3-1b-it"), "--gpu", "L4", "--what-if", "fp8,mha+fp8")
    assert rc == 0
    assert "sliding_attention" in out and "full_attention" in out and "MQA" in out
    assert "5,11,17,23" in out
    assert "-50.0%" in out  # fp8 halves bf16
    assert "+100.0%" in out  # 4 KV heads at 1 byte = 2x one head at 2 bytes
    assert "fits: 1 sequence of 32,768 tokens on 1 x L4" in out
    assert "L4: 22.49 GiB x 0.9" in out


@pytest.mark.parametrize("args, where", [
    (["--kv-cache-dtype", "fp4"], "--kv-cache-dtype"),
    (["--gpu", "H900"], "--gpu-memory"),
    (["--gpu", "-3GiB"], "--gpu-memory"),
    (["--gpu", "H100", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization"),
    (["--reserve", "1GiB"], "--gpu-memory"),
    (["--gpu", "H100", "--reserve", "lots"], "--reserve"),
    (["--what-if", "gqa:5"], "--what-if"),
    (["--what-if", "gqa:x"], "--what-if"),
    (["--what-if", "moe"], "--what-if"),
    (["--batch", "0"], "--batch"),
    (["--block-size", "0"], "--block-size"),
    (["--format", "yaml"], "--format"),
    (["--plot", "out.txt"], "--plot"),
])
def test_bad_options_are_one_line_exit_2(args, where, capsys):
    rc, out, err = run(capsys, config("llama-3.1-8b"), *args)
    assert rc == 2 and out == ""
    assert err.startswith("kvtool: error: ") and where in err and err.count("\n") == 1


def test_gqa_what_if_on_mla_is_refused(capsys):
    rc, _, err = run(capsys, config("deepseek-v3"), "--what-if", "mqa")
    assert rc == 2 and "MLA" in err and "--what-if" in err


def test_missing_model_and_missing_length(tmp_path, capsys):
    rc, _, err = run(capsys, str(tmp_path / "nope"))
    assert rc == 2 and "nope: no such file or folder" in err
    cfg = dict(TINY)
    del cfg["max_position_embeddings"]
    write_config(tmp_path / "nolen", cfg)
    # llama's table defaults max_position_embeddings, so use a model type without a default
    cfg["model_type"] = "kvtool_unknown"
    write_config(tmp_path / "nolen2", cfg)
    rc, _, err = run(capsys, str(tmp_path / "nolen2"))
    assert rc == 2 and "--max-model-len" in err
    ok = run_json(capsys, str(tmp_path / "nolen2"), "--max-model-len", "100")
    assert ok["max_model_len"] == 100
    assert any("no architecture table for model_type 'kvtool_unknown'" in n for n in ok["notes"])


def test_input_is_never_modified(tiny, tmp_path, capsys):
    pytest.importorskip("matplotlib")  # --plot: the `plot` extra, like the plot tests below
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny.iterdir()}
    rc, _, _ = run(capsys, str(tiny), "--gpu", "T4", "--plot", str(tmp_path / "p.png"))
    assert rc == 0
    assert before == {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tiny.iterdir()}


def test_plot_writes_a_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "kv.png"
    rc, _, err = run(capsys, config("gpt-oss-20b"), "--gpu", "L40S", "--what-if", "fp8,mqa", "--plot", str(out))
    assert rc == 0, err
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["kv.png"]  # no temporary left behind


def test_plot_without_matplotlib_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    rc, out, err = run(capsys, config("llama-3.1-8b"), "--plot", str(tmp_path / "kv.png"))
    assert rc == 2 and out == ""
    assert "--plot: needs matplotlib" in err
    assert not (tmp_path / "kv.png").exists()


def test_plot_into_a_missing_folder_exits_2(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rc, _, err = run(capsys, config("llama-3.1-8b"), "--plot", str(tmp_path / "no" / "kv.png"))
    assert rc == 2 and "folder does not exist" in err


def test_kv_cache_scheme_makes_auto_fp8(tmp_path, capsys):
    cfg = dict(TINY, quantization_config={"quant_method": "compressed-tensors",
                                          "kv_cache_scheme": {"num_bits": 8, "type": "float"}})
    write_config(tmp_path / "q", cfg)
    d = run_json(capsys, str(tmp_path / "q"))
    assert d["kv_cache_dtype"] == "fp8" and d["kv_bytes_per_token"] == 2 * 2 * 16 * 1 * 2


def test_hub_id_reads_config_and_header_metadata_only(tmp_path, capsys, monkeypatch):
    hf = pytest.importorskip("huggingface_hub")
    calls = []

    def fake_download(repo_id, filename, **kw):
        calls.append((repo_id, filename))
        return config("llama-3.1-8b")

    def no_safetensors(repo_id, **kw):
        raise RuntimeError("offline")

    monkeypatch.setattr(hf, "hf_hub_download", fake_download)
    monkeypatch.setattr(hf, "get_safetensors_metadata", no_safetensors)
    d = run_json(capsys, "meta-llama/Llama-3.1-8B", "--max-model-len", "8192")
    assert calls == [("meta-llama/Llama-3.1-8B", "config.json")]
    assert d["kv_bytes_per_token"] == 131_072 and d["weight_source"] == "estimate"


def test_kv_budget_imports_neither_torch_nor_transformers(tmp_path):
    code = (
        "import sys, json\n"
        "from kvtool.cli import main\n"
        f"rc = main(['kv-budget', {config('gemma-3-1b-it')!r}, '--gpu', 'H100', '--what-if', 'fp8', '--format', 'json'])\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers'))\n"
        "print(json.dumps({'rc': rc, 'heavy': heavy}))\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    last = json.loads(res.stdout.strip().splitlines()[-1])
    assert last == {"rc": 0, "heavy": []}, res.stderr


def test_json_has_the_documented_keys(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--what-if", "gqa:2", "--max-model-len", "2048")
    for key in ("kv_bytes_per_token", "kv_bytes_per_sequence", "kv_bytes_total", "weight_bytes",
                "max_concurrent_sequences", "layers", "what_if", "kv_pool_bytes_per_gpu", "tensor_parallel_size"):
        assert key in d
    assert d["max_concurrent_sequences"] is None and d["fits"] is None
    assert d["position_encoding"] == "rope"
    assert d["kv_bytes_total"] == d["kv_bytes_per_sequence"] == 131_072 * 2048
    assert d["what_if"][0]["kv_bytes_per_sequence"] == d["kv_bytes_per_sequence"] / 4
    assert d["kv_bytes_total"] < GIB


def test_a_model_without_kv_layers_is_limited_by_its_state(tmp_path, capsys):
    # Nemotron-H with every attention layer turned into Mamba: nothing to cache per token, but 64 Mamba2 states
    # per sequence. TP 8: conv 20,480 / 8 x 3 = 7,680 x 2 B + SSM 32 x 64 x 256 = 524,288 x 4 B = 2,112,512 B.
    cfg = json.loads(open(config("nemotron-h-56b-base-8k")).read())
    cfg["hybrid_override_pattern"] = cfg["hybrid_override_pattern"].replace("*", "M")
    write_config(tmp_path / "m", cfg)
    d = run_json(capsys, str(tmp_path / "m"), "--gpu", "B200", "-tp", "8")
    assert d["kv_bytes_per_token"] == 0 and d["fits"] is True and d["attention_block_size"] == 16
    assert d["kv_bytes_per_sequence_per_gpu"] == 64 * 2_112_512
    assert d["max_concurrent_sequences"] == int(d["kv_pool_bytes_per_gpu"] // (64 * 2_112_512))
    rc, out, _ = run(capsys, str(tmp_path / "m"), "--gpu", "B200", "-tp", "8")
    assert rc == 0 and "of it recurrent state" in out and "KV pool tokens" not in out


def test_a_config_without_layer_count_exits_2(tmp_path, capsys):
    write_config(tmp_path / "m", {"model_type": "llama", "hidden_size": 64})
    rc, _, err = run(capsys, str(tmp_path / "m"))
    assert rc == 2 and "num_hidden_layers" in err and err.count("\n") == 1


def test_alibi_model_reports_its_positions(capsys):
    # bloom-shrunk (real BLOOM key set, shrunk sizes): 1 layer, 16 heads of 2048 / 16 = 128, ALiBi, MHA.
    d = run_json(capsys, config("bloom-shrunk"), "--max-model-len", "2048")
    assert d["position_encoding"] == "alibi"
    assert [(layer["kind"], layer["kv_heads"], layer["head_dim"]) for layer in d["layers"]] == [("MHA", 16, 128)]
    assert d["kv_bytes_per_token"] == 2 * 16 * 128 * 2
    rc, out, _ = run(capsys, config("bloom-shrunk"), "--max-model-len", "2048")
    assert "positions: ALiBi" in out.splitlines()[0]


@pytest.mark.parametrize("dtype, quant, layer_bytes", [
    ("float32", None, 2),  # served in 16 bits, like the weights vLLM loads
    ("bfloat16", {"quant_method": "gptq", "bits": 4}, 0.5),
    ("bfloat16", {"quant_method": "fp8"}, 1),
    ("bfloat16", {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 8}}}}, 1),
])
def test_weight_estimate_without_safetensors(tmp_path, capsys, dtype, quant, layer_bytes):
    cfg = dict(TINY, torch_dtype=dtype)
    if quant:
        cfg["quantization_config"] = quant
    write_config(tmp_path / "m", cfg)
    d = run_json(capsys, str(tmp_path / "m"))
    # 2 layers x (attention 64x64 + 2 x 64x32 + 64x64, gated MLP 3 x 64x128); embeddings and head 2 x 128x64.
    layers = 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)
    embed = 2 * 128 * 64
    assert d["weight_params_estimate"] == layers + embed
    assert d["weight_bytes"] == int(embed * 2 + layers * layer_bytes)
    assert d["weight_source"] == "estimate"


def test_unreadable_shard_is_refused(tiny, capsys):
    (tiny / "b.safetensors").write_bytes(b"\x00\x01")  # truncated: no header
    rc, out, err = run(capsys, str(tiny))
    assert rc == 2 and not out and len(err.strip().splitlines()) == 1
    assert "b.safetensors" in err and "shorter than the 8-byte header length" in err
