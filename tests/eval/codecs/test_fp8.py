"""The fp8 codec (kvtool/eval/codecs/fp8.py): e4m3 and e5m2 as vLLM's cache writers store them."""

from __future__ import annotations

import pytest
import torch

from kvtool.errors import InputError
from kvtool.eval import codecs
from kvtool.eval.codecs import fp8
from kvtool.model import kv_dtypes, kv_emulations


def _rt(x, name, scale=None, role="k"):
    r = kv_emulations.get(name)
    return codecs.get(r.codec)(x, role=role, params=dict(r.params), row=kv_dtypes.get(name), scale=scale)


def test_registry_imports_the_codec_lazily_and_refuses_an_unknown_name():
    assert codecs.get("fp8") is fp8.roundtrip
    with pytest.raises(KeyError, match="no KV codec 'zz'"):
        codecs.get("zz")


@pytest.mark.parametrize("name, dtype, top", [("fp8_e4m3", torch.float8_e4m3fn, 448.0),
                                              ("fp8", torch.float8_e4m3fn, 448.0),
                                              ("fp8_e5m2", torch.float8_e5m2, 57344.0)])
def test_round_trip_is_saturating_round_to_nearest_in_the_rows_format(name, dtype, top):
    """Assumed match: torch's cast rounds to nearest even, as CUDA's cvt.rn.satfinite does (the row's assumption)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 5, 16, generator=g) * 40
    x[0, 0, 0, :4] = torch.tensor([top * 3, -top * 3, top, float(torch.finfo(dtype).tiny) / 4])
    scale = torch.tensor(0.5)
    got = _rt(x, name, scale)
    want = ((x / 0.5).clamp(-top, top).to(dtype).float() * 0.5)
    assert got.dtype == x.dtype and got.shape == x.shape and torch.equal(got, want)
    assert float(got.abs().max()) == top * 0.5  # saturated, never inf / nan
    # every value is one the format holds (scaled), and the nearest one
    assert torch.equal((got / 0.5).to(dtype).float(), got / 0.5)


def test_e4m3_rows_give_what_the_existing_emulation_gave():
    x = torch.randn(1, 2, 7, 8, dtype=torch.bfloat16) * 300
    s = torch.tensor([0.25, 2.0])
    assert torch.equal(_rt(x, "fp8_e4m3", s), fp8.fp8_roundtrip(x, s.reshape(1, 2, 1, 1)))
    from kvtool.eval.fp8 import KVScales

    hook = KVScales.from_mapping({0: (s, 1.0)}).hook()
    k, v = hook(0, x, x)
    assert torch.equal(k, _rt(x, "fp8_e4m3", s)) and torch.equal(v, _rt(x, "fp8_e4m3", torch.tensor(1.0), "v"))


def test_e5m2_keeps_range_and_loses_precision_against_e4m3():
    x = torch.linspace(-1000, 1000, 4001).reshape(1, 1, 1, -1)
    e4, e5 = _rt(x, "fp8_e4m3"), _rt(x, "fp8_e5m2")
    assert float(e4.abs().max()) == 448.0 and float(e5.abs().max()) == 1024.0  # 1000 -> 1024: e5m2 steps by 128 over 512..1024
    small = x.abs() < 400
    assert float((e5 - x)[small].abs().max()) > float((e4 - x)[small].abs().max())


def test_per_head_scales_apply_to_their_head_and_a_wrong_size_is_refused():
    """Per-head (attn_head) scales, shape [kv_heads]: head h is divided by scale[h]."""
    x = torch.full((1, 3, 2, 4), 10.0)
    s = torch.tensor([1.0, 0.01, 100.0])
    got = _rt(x, "fp8_e4m3", s)
    assert float(got[0, 0, 0, 0]) == 10.0 and float(got[0, 1, 0, 0]) == float(torch.tensor(448.0) * 0.01)  # 1000 saturates
    assert fp8.granularity(s) == "per head" and fp8.granularity(torch.tensor([2.0])) == "per tensor"
    with pytest.raises(InputError, match="v_scale has 2 values; expected 1 or one per KV head"):
        _rt(x, "fp8_e4m3", torch.tensor([1.0, 2.0]), role="v")


def test_each_batch_row_is_independent():
    x = torch.randn(4, 2, 3, 8) * 100
    whole = _rt(x, "fp8_e5m2", torch.tensor(0.7))
    for b in range(4):
        assert torch.equal(whole[b:b + 1], _rt(x[b:b + 1], "fp8_e5m2", torch.tensor(0.7)))
