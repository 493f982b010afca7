"""--device-map / --max-memory: accelerate's placement (GPU shards, CPU, disk offload) gives the unsharded figures.

The sharding logic is the same on a multi-GPU node; here the devices are the CPU and the disk (scripts/gpu_check.sh
checks a GPU + CPU split on the GPU machine).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvtool.errors import UsageError
from kvtool.eval.api import evaluate, parse_max_memory

from eval_helpers import mean_pooled_mqa

L, S, N = 64, 32, 200
FIGURES = ("ppl", "baseline_ppl", "ppl_ratio", "kld_mean", "top1_agreement")


@pytest.fixture(scope="module")
def pair(tiny_llama_path, tmp_path_factory):
    return tiny_llama_path, mean_pooled_mqa(tiny_llama_path, tmp_path_factory.mktemp("shard") / "mqa")


def _same(a, b):
    assert a.tokens == b.tokens
    for key in FIGURES:
        assert a.metrics[key] == pytest.approx(b.metrics[key], rel=1e-6, abs=1e-12), key


@pytest.mark.parametrize("kv", ["off", "fp8"])
def test_a_forced_cpu_and_disk_map_equals_the_unsharded_run(pair, kv):
    src, mqa = pair
    kw = dict(max_length=L, stride=S, max_tokens=N, dtype="fp32", kv_cache_dtype=kv)
    plain = evaluate(mqa, src, device="cpu", **kw)
    split = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.layers.1": "cpu", "model.norm": "cpu",
             "model.rotary_emb": "cpu", "lm_head": "disk"}
    mapped = evaluate(mqa, src, device_map=split, **kw)
    assert mapped.memory["mode"] == "device_map"
    assert mapped.memory["modules_per_device"] == {"cpu": 8, "disk": 4}  # both models, 6 entries each
    assert mapped.device == "map(cpu,disk)"
    _same(mapped, plain)


def test_max_memory_below_the_model_offloads_it_to_disk(pair):
    src, mqa = pair
    kw = dict(max_length=L, stride=S, max_tokens=N, dtype="fp32")
    plain = evaluate(mqa, src, device="cpu", **kw)
    # ~13 MB of fp32 weights per model; with the CPU as the only device accelerate offloads all or nothing
    # (a partial split needs a GPU: scripts/gpu_check.sh)
    offloaded = evaluate(mqa, src, device_map="auto", max_memory={"cpu": "7MB"}, **kw)
    resident = evaluate(mqa, src, device_map="auto", max_memory={"cpu": "1GB"}, **kw)
    assert offloaded.memory["modules_per_device"] == {"disk": 2}
    assert resident.memory["modules_per_device"] == {"cpu": 2}
    _same(offloaded, plain)
    _same(resident, plain)


def test_a_memory_limit_accelerate_cannot_see_bounds_the_cpu_share(pair, monkeypatch):
    """accelerate reads MemAvailable; a cgroup limit (here forced with KVTOOL_MEMORY_LIMIT) is passed on."""
    from kvtool.eval import memory

    src, mqa = pair
    kw = dict(max_length=L, stride=S, max_tokens=N, dtype="fp32")
    plain = evaluate(mqa, src, device="cpu", **kw)
    monkeypatch.setenv(memory.LIMIT_ENV, "7MB")
    capped = evaluate(mqa, src, device_map="auto", **kw)
    assert capped.memory["modules_per_device"] == {"disk": 2}
    _same(capped, plain)


def test_max_memory_needs_a_device_map_and_a_valid_spec(pair):
    src, _ = pair
    with pytest.raises(UsageError, match="goes with --device-map") as exc:
        evaluate(src, max_memory={"cpu": "1GB"})
    assert exc.value.option == "max_memory"
    assert parse_max_memory("0=70GiB, 1=70GiB,cpu=200GiB") == {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}
    for bad in ("70GiB", "gpu0=1GB", "cpu=lots", "=1GB"):
        with pytest.raises(UsageError) as exc:
            parse_max_memory(bad)
        assert exc.value.option == "max_memory"


def test_cli_device_map_with_max_memory(pair):
    src, mqa = pair
    cmd = [sys.executable, "-m", "kvtool", "eval", str(mqa), "--baseline", str(src), "--max-tokens", str(N),
           "--max-length", str(L), "--dtype", "fp32", "--format", "json", "--no-progress", "--max-ppl-increase", "off"]
    plain = subprocess.run(cmd + ["--device", "cpu"], capture_output=True, text=True, env=dict(os.environ))
    mapped = subprocess.run(cmd + ["--device-map", "auto", "--max-memory", "cpu=7MB"], capture_output=True, text=True,
                            env=dict(os.environ))
    assert plain.returncode == 0 and mapped.returncode == 0, mapped.stderr
    a, b = json.loads(plain.stdout), json.loads(mapped.stdout)
    assert a["memory"]["mode"] == "layerwise" and b["memory"]["mode"] == "device_map"
    assert b["kld_mean"] == pytest.approx(a["kld_mean"], rel=1e-6) and b["ppl"] == pytest.approx(a["ppl"], rel=1e-6)
    bad = subprocess.run(cmd + ["--max-memory", "cpu=7MB"], capture_output=True, text=True, env=dict(os.environ))
    assert bad.returncode == 2 and bad.stderr.strip() == ("kvtool: error: --max-memory: goes with --device-map (it "
                                                          "bounds what accelerate places on each device)")
