"""Hostile round 3, class 5 (issue 39): eval, lint and vLLM agree on which FP8 scales are loaded.

Generated: scale tensors under every spelling and module (attention or not) on a tiny FP8 llama. lint (through the
harness, in a subprocess) reports KV806 exactly for the tensors kvtool's one function says vLLM drops, KV807 for
shapes the loader refuses; eval's reader keeps exactly the ones it loads."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from harness import run_kvtool

from kvtool.model import kv_scale_names as ksn

SRC = Path(__file__).resolve().parents[1] / "data" / "rules" / "KV801" / "pass_modelopt"
MODULES = ["self_attn", "self_attn.attn", "self_attn.k_proj", "self_attn.mla_attn.mla_attn", "mlp",
           "input_layernorm", "self_attn.q_proj"]
ENDS = ["k_scale", "q_scale", "kv_scale", "prob_scale", "output_scale"]
CASES = [f"model.layers.1.{m}.{e}" for m in MODULES for e in ENDS]


def _folder(tmp_path: Path, extra: dict) -> Path:
    from safetensors.numpy import load_file, save_file

    m = tmp_path / "m"
    shutil.copytree(SRC, m)
    base = load_file(str(SRC / "model.safetensors"))
    save_file({**base, **extra}, str(m / "model.safetensors"))
    return m


def _codes(m: Path) -> dict[str, set[str]]:
    r = run_kvtool(["lint", m, "--format", "json"])
    assert r.rc in (0, 1) and "Traceback" not in r.stderr, r.stderr
    out: dict[str, set[str]] = {}
    for f in json.loads(r.stdout)["models"][0]["findings"]:
        out.setdefault(f["code"], set()).add(f["path"])
    return out


@pytest.mark.parametrize("name", CASES)
def test_lint_flags_exactly_what_vllm_drops(tmp_path, name):
    m = _folder(tmp_path, {name: np.array(0.5, dtype=np.float32)})
    params = ksn.scale_params([f"model.layers.{i}.self_attn" for i in (0, 1)], "mha")
    dropped = ksn.vllm_target(name, params) is None
    codes = _codes(m)
    flagged = name in codes.get("KV806", set())
    if ksn.looks_like_scale(name):
        assert flagged == dropped, (name, codes)
    else:
        assert not flagged


@pytest.mark.parametrize("name, shape, bad", [
    ("model.layers.1.self_attn.q_scale", (4,), True), ("model.layers.1.self_attn.q_scale", (1,), False),
    ("model.layers.1.self_attn.attn.prob_scale", (2,), True), ("model.layers.1.self_attn.k_scale", (2, 1, 1), True),
    ("model.layers.1.self_attn.k_scale", (), False), ("model.layers.1.self_attn.kv_scale", (3,), True),
])
def test_lint_flags_shapes_the_loader_refuses(tmp_path, name, shape, bad):
    m = _folder(tmp_path, {name: np.full(shape, 0.5, dtype=np.float32)})
    assert ("KV807" in _codes(m)) == bad


@pytest.mark.torch
def test_eval_reads_exactly_what_vllm_loads(tmp_path):
    pytest.importorskip("torch")
    from kvtool.eval.fp8 import read_checkpoint_scales

    extra = {n: np.array(0.25 + i / 100, dtype=np.float32) for i, n in enumerate(CASES) if n.endswith("k_scale")}
    m = _folder(tmp_path, extra)
    s = read_checkpoint_scales(m)
    params = ksn.scale_params([f"model.layers.{i}.self_attn" for i in (0, 1)], "mha")
    loaded_k = [n for n in extra if ksn.vllm_target(n, params) == ("model.layers.1.self_attn", "k")]
    assert 1 in s.k and loaded_k
    got = float(s.k[1].reshape(-1)[0])
    assert any(abs(got - float(extra[n])) < 1e-6 for n in loaded_k)
    # no dropped scale (the mlp one, the MLA spelling on this MHA model) is ever the one read
    for n in extra:
        if ksn.vllm_target(n, params) is None:
            assert abs(got - float(extra[n])) > 1e-6, n
