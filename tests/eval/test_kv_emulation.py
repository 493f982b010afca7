"""kvtool/eval/kv_emulation.py: the hook built from a row of kv_emulations.json."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtool.eval import kv_emulation
from kvtool.eval.codecs import fp8
from kvtool.eval.fp8 import KVScales
from kvtool.model import kv_dtypes


def test_hook_applies_the_rows_codec_with_the_layers_checkpoint_scales():
    scales = KVScales.from_mapping({0: (0.5, 2.0), 1: ([0.1, 0.2], 1.0)})
    fn = kv_emulation.build("fp8_e5m2", scales, num_layers=2)
    k = torch.randn(1, 2, 3, 8) * 50
    v = torch.randn(1, 2, 3, 8) * 50
    k0, v0 = fn(0, k, v)
    assert torch.equal(k0, fp8.fp8_roundtrip(k, 0.5, "float8_e5m2"))
    assert torch.equal(v0, fp8.fp8_roundtrip(v, 2.0, "float8_e5m2"))
    k1, _ = fn(1, k, v)
    assert torch.equal(k1, fp8.fp8_roundtrip(k, torch.tensor([0.1, 0.2]).reshape(1, 2, 1, 1), "float8_e5m2"))
    k2, v2 = fn(2, k, v)  # a layer without scales: 1.0
    assert torch.equal(k2, fp8.fp8_roundtrip(k, 1.0, "float8_e5m2"))
    assert fn.emulation.name == "fp8_e5m2"


def test_fp8_alias_is_e4m3_and_matches_the_existing_hook():
    scales = KVScales.from_mapping({0: (0.5, 2.0)})
    k = torch.randn(2, 2, 3, 8) * 300
    a = kv_emulation.build("fp8", scales, 4)(0, k, k)
    b = scales.hook()(0, k, k)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_boundary_layers_stay_in_the_model_dtype(monkeypatch):
    """vLLM keeps the first and last boundary_layers in the model dtype (KvDtype.boundary_layers)."""
    rows = dict(kv_dtypes.table())
    rows["fp8_e5m2"] = dataclasses.replace(rows["fp8_e5m2"], boundary_layers=2)
    monkeypatch.setattr(kv_dtypes, "get", rows.get)
    fn = kv_emulation.build("fp8_e5m2", None, num_layers=6)
    assert fn.kept_layers == {0, 1, 4, 5}
    k = torch.randn(1, 1, 2, 8) * 33
    for layer in range(6):
        out, _ = fn(layer, k, k)
        assert torch.equal(out, k) == (layer in {0, 1, 4, 5}), layer
    assert kv_emulation.kept_layers("fp8_e5m2", 3) == {0, 2}  # at most half the layers each side
    assert kv_emulation.kept_layers("fp8_e5m2", ["full_attention", "mamba"] * 3) == set()  # hybrid: none


def test_unknown_dtype_is_refused():
    with pytest.raises(KeyError, match="does not emulate kv_cache_dtype 'nvfp4x'"):
        kv_emulation.build("nvfp4x")
