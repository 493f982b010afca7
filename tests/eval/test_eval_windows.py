"""Windows over one token stream: every token 1..N-1 scored exactly once (no model needed)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st

from kvtool.errors import UsageError
from kvtool.eval.windows import batches, check_window, windows


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 3000), max_length=st.integers(2, 600), data=st.data())
def test_each_token_scored_once(n, max_length, data):
    stride = data.draw(st.integers(1, max_length - 1))
    ws = windows(n, max_length, stride)
    scored = [t for w in ws for t in range(w.first_target, w.end)]
    assert scored == list(range(1, n))  # in order, no gaps, no repeats, token 0 never
    for i, w in enumerate(ws):
        assert 0 <= w.begin < w.first_target <= w.end <= n  # each target has >= 1 token of context
        assert w.length == min(max_length, n)  # full windows, the last slid back
        if i:
            assert w.first_target - w.begin >= max_length - stride  # guaranteed context


def test_hf_guide_layout():
    # the first window scores L-1 targets, then S per window; the last slides back to keep L tokens
    ws = windows(1000, 256, 128)
    assert [(w.begin, w.end, w.n_scored) for w in ws[:3]] == [(0, 256, 255), (128, 384, 128), (256, 512, 128)]
    assert ws[-1].end == 1000 and ws[-1].begin == 1000 - 256
    assert sum(w.n_scored for w in ws) == 999


def test_short_stream_is_one_window():
    assert [(w.begin, w.end, w.n_scored) for w in windows(10, 256, 128)] == [(0, 10, 9)]
    assert windows(1, 256, 128) == [] and windows(0, 8, 4) == []


@pytest.mark.parametrize("max_length,stride", [(1, 1), (64, 64), (64, 0), (64, 100)])
def test_bad_window_options(max_length, stride):
    with pytest.raises(UsageError):
        check_window(max_length, stride)


def test_batches_group_equal_shapes():
    ws = windows(1000, 256, 128)  # shapes: first (255 scored), middles (128), last (different)
    groups = list(batches(ws, 3))
    assert [w for g in groups for w in g] == ws
    for g in groups:
        assert len(g) <= 3 and len({(w.length, w.n_scored) for w in g}) == 1
    assert len(groups[0]) == 1  # the first window scores more targets: alone


@pytest.mark.parametrize(("name", "value"), [("max_length", 4), ("max_tokens", 1), ("stride", 0), ("batch_size", 0)])
def test_the_library_checks_refuse_with_the_declarations_line(name, value):
    """kvtool.eval.evaluate's keywords go through the same declaration as the command and a recipe (issue 30)."""
    from kvtool.eval.windows import check_settings
    from kvtool.options.eval import EvalOptions

    with pytest.raises(UsageError) as declared:
        EvalOptions(model="m", **{name: value})
    kw = dict(max_length=64, stride=None, max_tokens=None, batch_size=None, max_memory=None, device_map=None)
    with pytest.raises(UsageError) as library:
        check_settings(**{**kw, name: value})
    assert (library.value.option, library.value.message) == (name, declared.value.message)
    assert declared.value.message.startswith("must be at least ")


def test_eval_emulates_the_rows_of_the_emulation_table_and_refuses_the_rest():
    from kvtool.model import kv_dtypes, kv_emulations
    from kvtool.options.eval import KV_CACHE_DTYPES, EvalOptions

    assert kv_dtypes.emulated() == tuple(n for n in kv_dtypes.names() if n in kv_emulations.table())
    assert {"fp8", "fp8_e4m3", "fp8_e5m2"} <= set(kv_dtypes.emulated())
    assert KV_CACHE_DTYPES == ("auto", *kv_dtypes.emulated(), "off")
    for name in kv_dtypes.names():
        if name == "auto" or name in kv_emulations.table():
            assert EvalOptions(model="m", kv_cache_dtype=name).kv_cache_dtype == name
            continue
        with pytest.raises(UsageError) as exc:
            EvalOptions(model="m", kv_cache_dtype=name)
        assert exc.value.message == f"must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}"