"""Observers: running max over all batches, scale = amax / 448, per-head shapes, the registry."""

from __future__ import annotations

import pytest
import torch

from kvtool.errors import UsageError
from kvtool.quantize.formats import FORMATS, roundtrip
from kvtool.quantize.observers import OBSERVERS, DEFAULT_OBSERVER, canonical, make_observer, parse_spec

E4M3 = FORMATS["e4m3"]


def _batch(heads: int, peak_head: int | None = None, peak: float = 0.0, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, heads, 8, 4, generator=g)
    if peak_head is not None:
        x[1, peak_head, 3, 2] = -peak  # the largest magnitude, negative: |x| must be used
    return x


def test_absmax_keeps_running_max_over_all_batches_not_last_nor_mean():
    obs = make_observer("absmax", num_heads=3, per_head=False, fmt=E4M3)
    batches = [_batch(3, 0, 20.0, seed=1), _batch(3, 1, 50.0, seed=2), _batch(3, 2, 30.0, seed=3)]
    for b in batches:
        obs.update(b)
    assert obs.amax().tolist() == [50.0]  # the middle batch's peak; the last batch's is 30
    assert obs.scale().tolist() == pytest.approx([50.0 / 448.0])
    assert obs.batches == 3


def test_per_head_amax_and_scale_shapes():
    obs = make_observer("absmax", num_heads=3, per_head=True, fmt=E4M3)
    obs.update(_batch(3, 0, 20.0, seed=1))
    obs.update(_batch(3, 2, 30.0, seed=2))
    amax = obs.amax()
    assert amax.shape == (3,)
    assert amax[0].item() == 20.0 and amax[2].item() == 30.0
    assert amax[1].item() < 20.0  # head 1 never saw a peak
    assert torch.allclose(obs.scale(), amax / 448.0)
    tensor_obs = make_observer("absmax", num_heads=3, per_head=False, fmt=E4M3)
    tensor_obs.update(_batch(3, 0, 20.0))
    assert tensor_obs.scale().shape == (1,)


def test_headroom_multiplies_the_scale():
    a = make_observer("absmax", num_heads=2, per_head=False, fmt=E4M3)
    b = make_observer("absmax:4", num_heads=2, per_head=False, fmt=E4M3)
    x = _batch(2, 1, 10.0)
    a.update(x)
    b.update(x)
    assert b.scale().item() == pytest.approx(4 * a.scale().item())
    assert b.scale().item() == pytest.approx(4 * 10.0 / 448.0)


def test_percentile_is_the_kth_largest_magnitude():
    obs = make_observer("percentile:90", num_heads=1, per_head=False, fmt=E4M3)
    vals = torch.arange(1, 101, dtype=torch.float32)  # |x| = 1..100
    obs.update((vals * torch.where(vals % 2 == 0, 1.0, -1.0)).reshape(1, 1, 10, 10))
    assert obs.scale().item() == pytest.approx(90.0 / 448.0)
    assert obs.amax().item() == 100.0


def test_mse_scale_never_has_more_error_than_absmax_on_its_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 2, 64, 16, generator=g) * torch.tensor([0.05, 3.0]).reshape(1, 2, 1, 1)
    x[0, 1, 0, 0] = 40.0  # one outlier
    mse = make_observer("mse", num_heads=2, per_head=True, fmt=E4M3)
    ab = make_observer("absmax", num_heads=2, per_head=True, fmt=E4M3)
    mse.update(x)
    ab.update(x)
    s_mse, s_ab = mse.scale(), ab.scale()
    assert s_mse.shape == (2,)
    assert torch.all(s_mse <= s_ab * (1 + 1e-6))

    def err(s):
        return ((roundtrip(x, s.reshape(1, 2, 1, 1), E4M3) - x) ** 2).sum(dim=(0, 2, 3))

    assert torch.all(err(s_mse) <= err(s_ab) * (1 + 1e-6))


@pytest.mark.parametrize("name", sorted(OBSERVERS))
def test_every_registered_observer_gives_positive_finite_scales(name):
    entry = OBSERVERS[name]
    spec = name if entry.arg is None or entry.default_arg is not None else f"{name}:99"
    for per_head in (False, True):
        obs = make_observer(spec, num_heads=3, per_head=per_head, fmt=E4M3)
        obs.update(_batch(3, 1, 7.0))
        obs.update(torch.zeros(1, 3, 5, 4))
        s = obs.scale()
        assert s.dtype == torch.float32 and s.shape == ((3,) if per_head else (1,))
        assert torch.isfinite(s).all() and (s > 0).all()


def test_a_head_that_only_wrote_zeros_gets_scale_one():
    obs = make_observer("absmax", num_heads=2, per_head=True, fmt=E4M3)
    x = torch.zeros(1, 2, 4, 4)
    x[0, 0] = 2.0
    obs.update(x)
    assert obs.scale().tolist() == pytest.approx([2.0 / 448.0, 1.0])


@pytest.mark.parametrize("spec", ["minmax", "percentile", "percentile:abc", "percentile:20", "mse:3", "absmax:0.5", ""])
def test_bad_observer_specs_are_usage_errors(spec):
    with pytest.raises(UsageError) as e:
        parse_spec(spec)
    assert e.value.option == "observer" and e.value.field is None  # the CLI spells it --observer


def test_canonical_spells_out_defaults_and_the_cli_default_matches():
    from kvtool.options.quantize_kv import DEFAULT_OBSERVER as CLI_DEFAULT

    assert canonical("absmax") == "absmax:1"
    assert canonical("percentile:99.9") == "percentile:99.9"
    assert canonical("mse") == "mse"
    assert CLI_DEFAULT == DEFAULT_OBSERVER
    parse_spec(DEFAULT_OBSERVER)


def test_wrong_head_count_is_refused():
    obs = make_observer("absmax", num_heads=3, per_head=True, fmt=E4M3)
    with pytest.raises(ValueError):
        obs.update(torch.zeros(1, 4, 2, 2))


def test_absmax_pow2_rounds_the_headroom_scale_up_to_a_power_of_two():
    obs = make_observer("absmax-pow2:2", num_heads=2, per_head=True, fmt=E4M3)
    x = torch.zeros(1, 2, 4, 4)
    x[0, 0, 0, 0] = 10.0  # 2 * 10 / 448 = 0.0446 -> 2^-4 = 0.0625
    x[0, 1, 0, 0] = 224.0  # 2 * 224 / 448 = 1.0 exactly -> 1.0
    obs.update(x)
    assert obs.scale().tolist() == [0.0625, 1.0]
    # a power-of-two scale maps every normal FP8 value onto the same grid as scale 1.0
    g = torch.Generator().manual_seed(0)
    v = torch.randn(1000, generator=g) * 3
    v = v[(v.abs() >= 2**-6) & (v.abs() <= 448 * 0.0625)]  # normal, unclipped under both scales
    s = obs.scale()[0]
    assert torch.equal(roundtrip(v, s, E4M3), roundtrip(v, 1.0, E4M3))


def test_place_except_moves_everything_but_the_decoder_layers():
    from kvtool.quantize.calibrate import place_except

    class Inner(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = torch.nn.Embedding(4, 2)
            self.layers = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(2)])
            self.register_buffer("inv_freq", torch.ones(2))

    class Outer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = torch.nn.Linear(2, 4, bias=False)
            self.lm_head.weight = self.model.embed.weight  # tied

    m = Outer()
    place_except(m, m.model.layers, torch.device("meta"))
    assert m.model.embed.weight.device.type == "meta" and m.model.inv_freq.device.type == "meta"
    assert m.lm_head.weight.device.type == "meta"
    assert all(p.device.type == "cpu" for p in m.model.layers.parameters())
