"""FP8 emulation on an MLA checkpoint: the cached latent and rotated rope key go through e4m3, one scale per layer
(kvtool.eval.fp8_mla), and nothing else changes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from eval_helpers import DEVICE
from kvtool.errors import UsageError
from kvtool.eval.fp8 import FP8_MAX, fp8_roundtrip
from kvtool.eval.fp8_mla import Fp8Latent, MLAScales, read_mla_scales

pytestmark = pytest.mark.torch
TEXT = ["def f(x):\n    return x + 1\n" * 12]


@pytest.fixture(scope="module")
def mla_model(tiny_deepseek_path):
    from kvtool.runtime.torch_utils import load_model

    return load_model(tiny_deepseek_path, device=torch.device(DEVICE), dtype=torch.float32).eval()


def _ids(model, n=24, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (1, n), generator=g).to(DEVICE)


def _record(model, ids, hook):
    """Each layer's (input to the hook, output of the hook) and the attention inputs, from one forward."""
    from kvtool.runtime.kv_hooks import kv_hook

    seen, inputs = {}, {}

    def fn(layer, c, k_pe):
        out = hook(layer, c, k_pe)
        seen[layer] = (c.clone(), k_pe.clone(), out[0].clone(), out[1].clone())
        return out

    fn.latent = fn
    handles = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, kw, i=i: inputs.__setitem__(i, (kw["hidden_states"].clone(), kw["position_embeddings"])),
        with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        with torch.inference_mode(), kv_hook(model, fn):
            logits = model(input_ids=ids, use_cache=False).logits
    finally:
        for h in handles:
            h.remove()
    return seen, inputs, logits


@torch.no_grad()
def test_the_hook_rounds_the_normed_latent_and_the_rotated_rope_key(mla_model):
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    hook = Fp8Latent(MLAScales({0: 0.05}, source="given"))
    seen, inputs, _ = _record(mla_model, _ids(mla_model), hook.latent)
    assert sorted(seen) == [0, 1]
    for layer, (c, k_pe, c8, k8) in seen.items():
        attn = mla_model.model.layers[layer].self_attn
        h, (cos, sin) = inputs[layer]
        # by hand from the weights: kv_a_proj_with_mqa, split, RMSNorm times its weight; the rope key rotated
        a = h @ attn.kv_a_proj_with_mqa.weight.T
        latent, rope = a.split([attn.kv_lora_rank, attn.qk_rope_head_dim], dim=-1)
        normed = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + attn.kv_a_layernorm.variance_epsilon)
        normed = normed * attn.kv_a_layernorm.weight
        rope = rope.unsqueeze(1)
        _, rotated = apply_rotary_pos_emb_interleave(rope, rope, cos, sin)
        assert c.shape == (1, 1, 24, attn.kv_lora_rank) and k_pe.shape == (1, 1, 24, attn.qk_rope_head_dim)
        torch.testing.assert_close(c[:, 0], normed, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(k_pe, rotated, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(k_pe[..., 1:, :], rope[..., 1:, :])  # stored after rotary, not before
        scale = 0.05 if layer == 0 else 1.0  # the layer's own scale; 1.0 without one
        assert torch.equal(c8, fp8_roundtrip(c, scale)) and torch.equal(k8, fp8_roundtrip(k_pe, scale))
        assert not torch.equal(c8, c) and not torch.equal(k8, k_pe)


def test_only_the_latent_is_rounded(mla_model, monkeypatch):
    # with the round trip as identity the hooked model is the model: the per-head K/V (attention interface) and
    # the queries are left alone; with it, the logits move
    import kvtool.eval.fp8_mla as fm

    ids = _ids(mla_model)
    with torch.inference_mode():
        ref = mla_model(input_ids=ids, use_cache=False).logits
    hook = Fp8Latent(MLAScales())
    _, _, rounded = _record(mla_model, ids, hook.latent)
    assert float((rounded - ref).abs().max()) > 1e-4
    before = mla_model.config._attn_implementation
    monkeypatch.setattr(fm, "fp8_roundtrip", lambda x, s, fmt="float8_e4m3fn": x)
    _, _, same = _record(mla_model, ids, hook.latent)
    assert torch.equal(same, ref)
    assert mla_model.config._attn_implementation == before
    assert all("expand_kv" not in vars(layer.self_attn) for layer in mla_model.model.layers)  # unhooked after


def test_a_latent_beyond_e4m3_saturates_at_448_as_vllm_s_cache_kernel(mla_model):
    # a kv_a_layernorm weight of 2000 puts one latent dim far beyond 448 at scale 1.0: vLLM's cache kernel
    # converts with __NV_SATFINITE (clamped to +-448, never NaN or inf)
    attn = mla_model.model.layers[0].self_attn
    w = attn.kv_a_layernorm.weight
    old = w.detach().clone()
    try:
        with torch.no_grad():
            w[3] = 2000.0
        seen, _, logits = _record(mla_model, _ids(mla_model), Fp8Latent(MLAScales()).latent)
    finally:
        with torch.no_grad():
            w.copy_(old)
    c, _, c8, _ = seen[0]
    assert float(c[..., 3].abs().max()) > FP8_MAX
    big = c.abs() > FP8_MAX
    assert torch.equal(c8[big], torch.sign(c[big]) * FP8_MAX)
    assert torch.isfinite(logits).all()


def test_checkpoint_scales_under_the_names_vllm_s_deepseek_loader_maps(tiny_deepseek_path, tmp_path):
    import shutil

    model = tmp_path / "m"
    shutil.copytree(tiny_deepseek_path, model)
    tensors = load_file(str(model / "model.safetensors"))
    save_file({**tensors,
               "model.layers.0.self_attn.mla_attn.mla_attn.k_scale": torch.tensor(0.25),  # vLLM's own name
               "model.layers.0.self_attn.k_proj.k_scale": torch.tensor(9.0),  # loses: vLLM's own name is first
               "model.layers.1.self_attn.k_scale": torch.tensor(0.5),  # remaps to .attn.k_scale: dropped, 1.0
               "model.layers.1.self_attn.kv_scale": torch.tensor(0.5)}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    scales = read_mla_scales(model)
    assert scales.k == {0: 0.25} and scales.source == "checkpoint"
    only_modelopt = tmp_path / "n"
    shutil.copytree(tiny_deepseek_path, only_modelopt)
    save_file({**tensors, "model.layers.1.self_attn.k_proj.k_scale": torch.tensor(2.0)},
              str(only_modelopt / "model.safetensors"), metadata={"format": "pt"})
    assert read_mla_scales(only_modelopt).k == {1: 2.0}

    from kvtool.eval.api import Candidate, evaluate_many

    ckpt, one = evaluate_many([Candidate(model, "fp8", "checkpoint", label="ckpt"),
                               Candidate(model, "fp8", "one", label="one")], baseline=model, texts=TEXT,
                              max_length=32, device=DEVICE, layerwise=False)
    assert ckpt.kv_scales["layers"] == 1 and ckpt.kv_scales["min_scale"] == 0.25
    assert one.kv_scales["layers"] == 0 and one.kv_scales["source"] == "one"
    assert ckpt.kld_mean != one.kld_mean


@pytest.mark.parametrize("layerwise", [False, True])
def test_eval_fp8_differs_by_a_small_kld_and_says_what_it_emulated(tiny_deepseek_path, layerwise):
    from kvtool.commands.eval import render_text
    from kvtool.eval.api import Candidate, evaluate_many

    off, fp8 = evaluate_many([Candidate(tiny_deepseek_path, "off", label="off"),
                              Candidate(tiny_deepseek_path, "fp8", label="fp8")], baseline=tiny_deepseek_path,
                             texts=TEXT, max_length=32, device=DEVICE, layerwise=layerwise)
    assert off.kld_mean == 0 and off.kv_scales is None
    assert 0 < fp8.kld_mean < 1e-2
    d = fp8.as_dict()
    assert d["kv_cache_dtype"] == "fp8_e4m3"
    assert d["kv_scales"]["cache"] == "mla_latent" and d["kv_scales"]["max_scale"] == 1.0
    assert d["fp8_attention"]["vllm"].startswith("TRITON_MLA") and d["fp8_attention"]["queries"] == "model dtype"
    assert any("update_kv_cache" in c for c in d["fp8_attention"]["cited"])
    text = render_text(fp8)
    assert "scale 1.0 in every layer" in text and "MLA: the cached latent (kv_c_normed) and rotated k_pe" in text


def test_the_layerwise_and_whole_model_paths_agree(tiny_deepseek_path):
    from kvtool.eval.api import Candidate, evaluate_many

    rows = [evaluate_many([Candidate(tiny_deepseek_path, "fp8")], baseline=tiny_deepseek_path, texts=TEXT,
                          max_length=32, device=DEVICE, layerwise=lw)[0] for lw in (False, True)]
    assert rows[0].kld_mean == pytest.approx(rows[1].kld_mean, rel=1e-4, abs=1e-9) and rows[0].kld_mean > 0


def test_fp8_attention_is_refused_for_mla_before_the_model_loads(tiny_deepseek_path, monkeypatch, capsys):
    import kvtool.eval.api as api
    from kvtool.cli import main

    def loaded(*a, **k):
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(api, "_emulation", loaded)
    for name in ("flash-attn", "flashinfer", "triton"):
        assert main(["eval", str(tiny_deepseek_path), "--kv-cache-dtype", "fp8", "--fp8-attention", name]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"kvtool: error: --fp8-attention: {name} is not emulated for MLA checkpoints: only cache-only "
                       "(vLLM's TRITON_MLA keeps the query in the model dtype; FlashMLA / FlashInfer-MLA / "
                       "CUTLASS-MLA also round the absorbed decode query, which kvtool does not emulate)"]
    with pytest.raises(UsageError, match="not emulated for MLA"):
        api.evaluate(str(tiny_deepseek_path), fp8_attention="triton", texts=TEXT)  # auto: refused all the same


def test_scales_given_to_the_api(mla_model):
    assert MLAScales.from_given({0: (0.5, 0.25), 1: (2.0, 2.0, 1.0)}).k == {0: 0.5, 1: 2.0}  # k only: no v in MLA
    with pytest.raises(UsageError, match="one latent scale, not 2"):
        MLAScales.from_given({0: ([0.1, 0.2], 0.5)})
    from kvtool.eval.api import Candidate, _Loaded, _emulation

    loaded = _Loaded("m", mla_model, None, None, json.loads(mla_model.config.to_json_string()))
    emu = _emulation(Candidate(mla_model, "fp8", {1: (0.125, 1.0)}), loaded)
    hook, scales = emu.hook, emu.scales
    assert emu.kv["dtype"] == "fp8_e4m3" and emu.kv["reads"].startswith("K/V read back from the cache")
    assert isinstance(hook, Fp8Latent) and scales.k == {1: 0.125} and scales.source == "given"
    with pytest.raises(UsageError, match="not emulated for MLA"):
        _emulation(Candidate(mla_model, "fp8", fp8_attention="flash-attn"), loaded)
