"""kvtool.eval.memory: sizes from the headers, available memory, and the refusal before loading."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvtool.errors import InputError, UsageError
from kvtool.eval import memory
from kvtool.eval.memory import GiB, Need

from eval_helpers import mean_pooled_mqa


def test_sizes_come_from_the_headers_at_the_evaluation_dtype(tiny_llama_path):
    from kvtool.model.checkpoint import open_checkpoint

    tensors = open_checkpoint(tiny_llama_path).tensors
    fp32, bf16 = memory.weight_sizes(tensors, 4), memory.weight_sizes(tensors, 2)
    layer0 = sum(t.numel for n, t in tensors.items() if n.startswith("model.layers.0."))
    embed = tensors["model.embed_tokens.weight"].numel
    assert fp32.layers == 2 and fp32.largest_layer == 4 * layer0 and fp32.largest_other == 4 * embed
    assert fp32.total == 4 * sum(t.numel for t in tensors.values()) == 2 * bf16.total


def test_layer_by_layer_needs_the_largest_layer_or_every_models_head():
    a = memory.WeightSizes(total=100, largest_layer=30, largest_other=20, layers=3)
    b = memory.WeightSizes(total=100, largest_layer=25, largest_other=20, layers=3)
    assert memory.layerwise_need([a], 5).total == 35
    assert memory.layerwise_need([a, b], 5).weights == 40  # both heads at once beat one layer
    assert memory.whole_need([a, b], 5).total == 205


def test_cgroup_headroom_v2_v1_and_unlimited(tmp_path):
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1073741824\n")
    (v2 / "memory.current").write_text("268435456\n")
    assert memory._cgroup_headroom(v2) == 768 * 2**20
    (v2 / "memory.max").write_text("max\n")
    assert memory._cgroup_headroom(v2) is None
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**30))
    (v1 / "memory" / "memory.usage_in_bytes").write_text(str(2**31))  # over the limit: nothing left
    assert memory._cgroup_headroom(v1) == 0
    (v1 / "memory" / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    assert memory._cgroup_headroom(v1) is None
    assert memory._cgroup_headroom(tmp_path / "none") is None


def test_available_memory_is_measured_or_forced(monkeypatch):
    monkeypatch.delenv(memory.LIMIT_ENV, raising=False)
    have, source = memory.available_bytes()
    assert 0 < have < 2**62 and source in ("MemAvailable", "cgroup limit")
    monkeypatch.setenv(memory.LIMIT_ENV, "3GiB")
    assert memory.available_bytes() == (3 * GiB, memory.LIMIT_ENV)
    monkeypatch.setenv(memory.LIMIT_ENV, "lots")
    with pytest.raises(UsageError) as exc:
        memory.available_bytes()
    assert exc.value.field == memory.LIMIT_ENV


@pytest.mark.parametrize("weights,acts,limit,layerwise,want", [
    (8 * GiB, 1 * GiB, 6 * GiB, True, "--dtype bf16 halves the weights (about 5.00 GiB)"),
    (8 * GiB, 1 * GiB, 4 * GiB, True, "no option makes one layer fit"),
    (1 * GiB, 5 * GiB, 4 * GiB, True, "a smaller --max-length or --batch-size shrinks"),
    (8 * GiB, 3 * GiB, 6 * GiB, True, "--dtype bf16 with a smaller --max-length or --batch-size"),
    (8 * GiB, 1 * GiB, 6 * GiB, False, "--device-map auto"),
])
def test_the_refusal_names_what_makes_it_fit(monkeypatch, weights, acts, limit, layerwise, want):
    monkeypatch.setenv(memory.LIMIT_ENV, str(limit))
    need = Need(weights, acts, "one decoder layer at a time")
    with pytest.raises(InputError) as exc:
        memory.refuse_if_too_big(need, file="m", elem_bytes=4, layerwise_possible=layerwise)
    assert want in exc.value.message and exc.value.field == "memory"
    assert f"needs about {memory.gib(weights + acts)}" in exc.value.message
    monkeypatch.setenv(memory.LIMIT_ENV, str(weights + acts))
    memory.refuse_if_too_big(need, file="m", elem_bytes=4, layerwise_possible=layerwise)  # fits: no error


def test_whole_model_refused_before_loading_names_layer_by_layer(tiny_llama_path, monkeypatch):
    from kvtool.eval.api import evaluate

    monkeypatch.setenv(memory.LIMIT_ENV, "1MB")  # the tiny llama's fp32 weights are ~13 MB
    loads = []
    import kvtool.runtime.torch_utils as tu

    monkeypatch.setattr(tu, "load_model", lambda *a, **k: loads.append(a) or (_ for _ in ()).throw(AssertionError))
    with pytest.raises(InputError, match="every weight resident.*one decoder layer at a time") as exc:
        evaluate(tiny_llama_path, max_tokens=50, max_length=32, dtype="fp32", layerwise=False)
    assert exc.value.file == str(tiny_llama_path) and loads == []


def test_cli_refuses_in_one_line_before_loading(tiny_llama_path):
    cmd = [sys.executable, "-m", "kvtool", "eval", str(tiny_llama_path), "--max-tokens", "100", "--max-length", "64",
           "--device", "cpu", "--dtype", "fp32", "--no-progress"]
    env = {**os.environ, memory.LIMIT_ENV: "2MB"}  # below the fp32 embedding / LM head (6.3 MB)
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert p.returncode == 2 and p.stdout == ""
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith(f"kvtool: error: {tiny_llama_path}: memory: evaluating (one decoder layer at a time) "
                               "needs about ")
    assert "1.9 MiB is available (KVTOOL_MEMORY_LIMIT); " in lines[0]


def test_a_fallback_to_the_whole_model_is_checked_and_names_device_map(tmp_path, tiny_llama_path, monkeypatch):
    from kvtest import unprefixed_copy
    from kvtool.eval.api import evaluate

    renamed = unprefixed_copy(tiny_llama_path, tmp_path / "renamed")
    monkeypatch.setenv(memory.LIMIT_ENV, "8MB")  # one layer and the embedding fit; the whole ~13 MB does not
    with pytest.raises(InputError, match=r"every weight resident.*--device-map auto") as exc:
        evaluate(renamed, max_tokens=50, max_length=32, dtype="fp32")
    assert exc.value.field == "memory"


def test_a_loaded_candidate_is_not_double_counted(tiny_llama_path, tmp_path, monkeypatch):
    """Two folders whole: their weights add up (both are held at once)."""
    from kvtool.eval.api import evaluate

    mqa = mean_pooled_mqa(tiny_llama_path, tmp_path / "mqa")
    from kvtool.model.checkpoint import open_checkpoint

    one = memory.weight_sizes(open_checkpoint(tiny_llama_path).tensors, 4).total
    monkeypatch.setenv(memory.LIMIT_ENV, str(int(one * 1.5)))  # one fits, both do not
    with pytest.raises(InputError, match="every weight resident") as exc:
        evaluate(mqa, tiny_llama_path, max_tokens=50, max_length=32, dtype="fp32", layerwise=False)
    assert exc.value.file == str(mqa)
