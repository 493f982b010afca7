"""kvtool.io.arrays: BF16 pooling on storage arrays gives the bits of the float round trip.

The reference is the path convert took before issue 18 (and still takes for other dtypes): widen
to float32, mean in float64 in row order, round to float32, then to BF16 with from_float.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtool.io import arrays
from kvtool.io.arrays import from_float, mean_groups_bf16, repeat_groups_bf16, to_float

SPECIAL = [0x0000, 0x8000, 0x0001, 0x8001, 0x007F, 0x0080, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1,
           0x7F81, 0x3F80, 0xBF80, 0x3F81, 0x4000, 0x0100]


def _reference_mean(groups: np.ndarray) -> np.ndarray:
    f = (groups.astype(np.uint32) << 16).view(np.float32)
    acc = f[:, 0].astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        for i in range(1, groups.shape[1]):
            acc += f[:, i]
        return from_float((acc / groups.shape[1]).astype(np.float32), "BF16")


def _is_nan(bits: np.ndarray) -> np.ndarray:
    return (bits & np.uint16(0x7FFF)) > np.uint16(0x7F80)


def _assert_same_bits(got: np.ndarray, ref: np.ndarray, groups: np.ndarray) -> None:
    """Equal bits, except the payload of a NaN made from two different NaNs (an input NaN, or the default
    NaN that +inf + -inf makes): which one survives an addition depends on the CPU's loop (SIMD lane or
    scalar tail) and the order of the sum, in the reference path as well. Both results are NaN."""
    differ = got != ref
    nan_in = _is_nan(groups)
    payloads = np.where(nan_in, groups, 0)
    mixed = nan_in.sum(axis=1) >= 2
    mixed &= (payloads.max(axis=1) != np.where(nan_in, groups, 0xFFFF).min(axis=1))
    made = (groups == 0x7F80).any(axis=1) & (groups == 0xFF80).any(axis=1)  # inf - inf: a NaN of the sum's own
    mixed |= made & nan_in.any(axis=1)
    allowed = _is_nan(got) & _is_nan(ref) & mixed
    assert not (differ & ~allowed).any(), np.argwhere(differ & ~allowed)[:5]


def _bits(draw_list, shape):
    return np.array(draw_list, dtype=np.uint16).reshape(shape)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 3), st.sampled_from([2, 3, 4, 8]), st.integers(1, 40), st.data())
def test_mean_groups_bf16_matches_the_float_round_trip(G, r, n, data):
    words = st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL))
    g = _bits(data.draw(st.lists(words, min_size=G * r * n, max_size=G * r * n)), (G, r, n))
    with np.errstate(invalid="ignore", over="ignore"):
        got = mean_groups_bf16(g)
    assert got.dtype == np.uint16 and got.shape == (G, n)
    _assert_same_bits(got, _reference_mean(g), g)


def test_mean_groups_bf16_across_block_boundaries(monkeypatch):
    monkeypatch.setattr(arrays, "_BLOCK", 7)  # blocks of 7 over rows of 50: partial last block
    rng = np.random.default_rng(1)
    g = from_float((rng.standard_normal((3, 4, 50)) * rng.choice([1e-30, 1e-3, 1.0, 1e30], (3, 4, 50)))
                   .astype(np.float32), "BF16")
    assert np.array_equal(mean_groups_bf16(g), _reference_mean(g))


def test_mean_groups_bf16_real_sized_rows():
    rng = np.random.default_rng(2)
    g = from_float((rng.standard_normal((2, 4, 64 * 96)) * 0.02).astype(np.float32), "BF16")
    assert np.array_equal(mean_groups_bf16(g), _reference_mean(g))


@given(st.lists(st.one_of(st.integers(0, 0xFFFF), st.sampled_from(SPECIAL)), min_size=6, max_size=6),
       st.integers(1, 4))
def test_repeat_groups_bf16_matches_the_float_round_trip(words, times):
    heads = _bits(words, (3, 2))
    ref = from_float(np.repeat(to_float(heads, "BF16"), times, axis=0), "BF16")
    assert np.array_equal(repeat_groups_bf16(heads, times), ref)


@given(st.lists(st.integers(0, 0xFFFF), min_size=1, max_size=64))
def test_to_float_widens_bf16_exactly(words):
    a = np.array(words, dtype=np.uint16)
    f = to_float(a, "BF16")
    assert f.dtype == np.float32
    assert np.array_equal(f.view(np.uint32), a.astype(np.uint32) << 16)


def test_to_float_refuses_integers():
    with pytest.raises(ValueError):
        to_float(np.zeros(2, np.int32), "I32")
