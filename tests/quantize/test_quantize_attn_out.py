"""The output-aware observer `attn-out`: its candidates keep the headroom, it keeps the candidate
with the smallest attention-output error, and calibrate() measures that error correctly."""

from __future__ import annotations

import pytest
import torch

from kvtool.quantize.formats import FORMATS, roundtrip
from kvtool.quantize.observers import make_observer

E4M3 = FORMATS["e4m3"]


def _observer(amax: list[float], spec: str = "attn-out", per_head: bool = True):
    obs = make_observer(spec, num_heads=len(amax), per_head=per_head, fmt=E4M3)
    x = torch.zeros(1, len(amax), 2, 2)
    for h, a in enumerate(amax):
        x[0, h, 1, 0] = -a
    obs.update(x)
    return obs, x


@pytest.mark.parametrize("spec, headroom", [("attn-out", 2.0), ("attn-out:1", 1.0), ("attn-out:4", 4.0)])
def test_candidates_never_clip_up_to_the_headroom_and_span_one_octave(spec, headroom):
    amax = [0.37, 10.0, 151.0]
    obs, _ = _observer(amax, spec)
    cands = obs.candidates()
    assert cands.shape == (9, 3)
    base = torch.tensor(amax) * headroom / 448.0
    # every candidate stores values up to headroom x the calibrated maximum without clipping
    assert torch.all(cands >= base * (1 - 1e-6))
    assert torch.all(cands < 2 * base)
    top = (torch.tensor(amax) * headroom)[None, :].expand(9, 3)
    assert torch.all((top / cands) <= 448.0 * (1 + 1e-6))
    assert torch.all((roundtrip(top, cands, E4M3) - top).abs() <= top / 16)  # rounded, not clipped
    # the first candidate is absmax-pow2's power of two (it wins ties); the others are 8 grid offsets
    pow2 = make_observer(f"absmax-pow2:{headroom:g}", num_heads=3, per_head=True, fmt=E4M3)
    pow2.update(_observer(amax, spec)[1])
    assert torch.equal(cands[0], pow2.scale())
    ratios = cands[1:] / cands[1]
    assert torch.allclose(ratios[:, 0], torch.exp2(torch.arange(8) / 8.0))


def test_choose_keeps_the_lowest_error_candidate_and_the_power_of_two_on_ties():
    obs, _ = _observer([3.0])
    cands = obs.candidates()
    obs.choose(torch.tensor([5.0, 4.0, 4.0, 1.0, 2.0, 9.0, 9.0, 9.0, 1.5], dtype=torch.float64))
    assert torch.equal(obs.scale(), cands[3])
    tie, _ = _observer([3.0])
    tie.choose(torch.ones(9, dtype=torch.float64))
    assert torch.equal(tie.scale(), cands[0])
    fresh, _ = _observer([3.0])  # no search (e.g. an observer used outside calibrate): the power of two
    assert torch.equal(fresh.scale(), cands[0])
    with pytest.raises(ValueError):
        fresh.choose(torch.ones(3))


def _tiny_model(cfg: dict, outlier: float):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures",
                                                                                      "torch_dtype")},
                                         attn_implementation="sdpa")).eval()
    with torch.no_grad():
        # one V channel with a large, nearly constant value (as real models have): its grid placement matters
        attn = model.model.layers[0].self_attn
        attn.v_proj.bias = torch.nn.Parameter(torch.zeros(attn.v_proj.out_features))
        attn.v_proj.bias[5] = outlier
    return model


def test_calibrate_picks_the_candidate_with_the_smallest_attention_output_error(tiny_llama_config):
    """An independent measurement (full forward, only layer 0 quantized, its attention output
    captured) ranks the candidates exactly as calibrate() did, and its pick is the argmin."""
    from kvtool.runtime.kv_hooks import kv_hook
    from kvtool.quantize.calibrate import calibrate

    model = _tiny_model(tiny_llama_config, outlier=13.3)
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(3, 128, (2, 32), generator=g), torch.randint(3, 128, (1, 20), generator=g)]
    r = calibrate(model, batches, layers_path="model.layers", observer="attn-out", strategy="tensor", fmt=E4M3,
                  device=torch.device("cpu"), num_kv_heads=2)
    assert sorted(r.search) == [(0, "k"), (0, "v"), (1, "k"), (1, "v")]
    attn = model.model.layers[0].self_attn
    outs: list[torch.Tensor] = []
    handle = attn.register_forward_hook(lambda m, a, o: outs.append(o[0].detach().clone()))
    quant = {"k": None, "v": None}

    def fn(layer, k, v):
        if layer == 0:
            k = k if quant["k"] is None else roundtrip(k, quant["k"], E4M3)
            v = v if quant["v"] is None else roundtrip(v, quant["v"], E4M3)
        return k, v

    def attn_error() -> float:
        outs.clear()
        with torch.inference_mode(), kv_hook(model, fn):
            for b in batches:
                model(input_ids=b, use_cache=False)
        return sum(float((o - ref).double().pow(2).sum()) for o, ref in zip(outs, reference))

    try:
        with torch.inference_mode():
            for b in batches:
                model(input_ids=b, use_cache=False)
        reference = list(outs)
        cands_v, errors_v = r.search[(0, "v")]
        quant["k"] = r.k[0]  # V is searched with K at its chosen scale
        mine = []
        for c in cands_v:
            quant["v"] = c
            mine.append(attn_error())
    finally:
        handle.remove()
    mine = torch.tensor(mine, dtype=torch.float64)
    assert torch.allclose(mine, errors_v, rtol=1e-4)
    assert torch.equal(r.v[0], cands_v[int(torch.argmin(mine))])
    assert mine.max() > 1.5 * mine.min()  # the outlier channel makes the grid placement matter
    for i in r.k:  # every chosen scale keeps 2x headroom over the calibrated maximum
        assert torch.all(r.k[i] * 448 >= 2 * r.k_amax[i] * (1 - 1e-6))
        assert torch.all(r.v[i] * 448 >= 2 * r.v_amax[i] * (1 - 1e-6))


def test_attn_head_strategy_searches_one_offset_per_layer(tiny_llama_config):
    from kvtool.quantize.calibrate import calibrate

    model = _tiny_model(tiny_llama_config, outlier=7.0)
    batches = [torch.randint(3, 128, (2, 24), generator=torch.Generator().manual_seed(2))]
    r = calibrate(model, batches, layers_path="model.layers", observer="attn-out", strategy="attn_head", fmt=E4M3,
                  device=torch.device("cpu"), num_kv_heads=2)
    for (layer, role), (cands, errors) in r.search.items():
        assert cands.shape == (9, 2) and errors.shape == (9,)
        chosen = (r.k if role == "k" else r.v)[layer]
        assert chosen.shape == (2,)
        assert torch.equal(chosen, cands[int(torch.argmin(errors))])
