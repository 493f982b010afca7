"""FP8 attention emulation (kvtool.eval.fp8.Fp8Attention): queries rounded only for backends that round them, with
the checkpoint q scale or vLLM 0.33's 1.0; Triton's probabilities; q scales read back; the report and refusals."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from eval_helpers import DEVICE
from kvtool.errors import InputError, UsageError
from kvtool.eval import fp8_backends as fb
from kvtool.eval import fp8 as fp8_module
from kvtool.eval.fp8 import ROUNDTRIPS, Fp8Attention, KVScales, fp8_roundtrip, read_checkpoint_scales


def _qk(heads=4, kv=2, seq=6, dim=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, heads, seq, dim, generator=g) * 3
    k = torch.randn(1, kv, seq, dim, generator=g) * 3
    v = torch.randn(1, kv, seq, dim, generator=g)
    return q, k, v


@pytest.mark.parametrize("name", fb.CHOICES)
def test_queries_rounded_only_where_the_backend_rounds_them(name):
    emu = Fp8Attention(KVScales.from_mapping({0: (0.5, 0.25)}), fb.backend(name))
    assert (emu.query is not None) == fb.backend(name).queries
    assert (emu.attention is not None) == (fb.backend(name).prob_scale is not None)
    q, k, v = _qk()
    k2, v2 = emu(0, k, v)  # K/V: the cache round trip for every backend, rounded as its kernel rounds
    rt = getattr(fp8_module, ROUNDTRIPS[fb.backend(name).kv_rounding])
    assert torch.equal(k2, rt(k, 0.5)) and torch.equal(v2, rt(v, 0.25))
    if emu.query is not None:
        got = emu.query(0, q, k)
        assert torch.equal(got, fp8_roundtrip(q, 1.0)) and not torch.equal(got, q)


def test_missing_q_scale_falls_back_to_one_not_k_scale():
    emu = Fp8Attention(KVScales.from_mapping({0: (0.5, 0.25)}), fb.backend("flash-attn"))
    q, k, _ = _qk()
    assert emu.q_scale(0, q, 2) == 1.0 == fb.Q_SCALE_FALLBACK
    assert not torch.equal(emu.query(0, q, k), fp8_roundtrip(q, 0.5))  # what the log line would suggest
    assert emu.describe()["q_scales"] == {"checkpoint_layers": 0, "fallback": 1.0, "min_scale": None,
                                          "max_scale": None}


def test_checkpoint_q_scale_is_used():
    emu = Fp8Attention(KVScales.from_mapping({0: (0.5, 0.25, 0.0078125)}), fb.backend("flashinfer"))
    q, k, _ = _qk()
    q = q * 0.01  # small queries: 1.0 would leave them subnormal in e4m3, the calibrated scale does not
    got = emu.query(0, q, k)
    assert torch.equal(got, fp8_roundtrip(q, 0.0078125))
    assert not torch.equal(got, fp8_roundtrip(q, 1.0))
    assert emu.describe()["q_scales"]["checkpoint_layers"] == 1


def test_per_head_q_scale_uses_each_kv_groups_max():
    # vLLM's compressed-tensors loader keeps max over each KV group of [num_heads] q scales
    emu = Fp8Attention(KVScales.from_mapping({0: (1.0, 1.0, [0.5, 0.25, 2.0, 4.0])}), fb.backend("flash-attn"))
    q, k, _ = _qk(heads=4, kv=2)
    s = emu.q_scale(0, q, 2)
    assert s.reshape(-1).tolist() == [0.5, 0.5, 4.0, 4.0]
    with pytest.raises(InputError, match="q_scale has 3 values"):
        Fp8Attention(KVScales.from_mapping({0: (1.0, 1.0, [1.0, 1.0, 1.0])}), fb.backend("flash-attn")).q_scale(0, q, 2)


def _reference(q, k, v, mask_bool, prob_scale=None, scaling=None):
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(2, 3) * (scaling or q.shape[-1] ** -0.5)
    s = s.masked_fill(~mask_bool, float("-inf"))
    p = torch.exp(s - s.amax(-1, keepdim=True))
    num = ((p * prob_scale).to(torch.float8_e4m3fn).float() / prob_scale) if prob_scale else p
    return ((num @ v) / p.sum(-1, keepdim=True)).transpose(1, 2)


@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
def test_triton_probabilities_rounded_times_256_normaliser_unrounded(mask_kind):
    emu = Fp8Attention(KVScales(), fb.backend("triton"))
    q, k, v = _qk(seq=7)
    causal = torch.ones(7, 7, dtype=torch.bool).tril()
    mask = {"none": None, "bool": causal[None, None],
            "additive": torch.zeros(1, 1, 7, 7).masked_fill(~causal, float("-inf"))}[mask_kind]
    out, weights = emu.attention(None, q, k, v, mask, scaling=0.3)
    assert weights is None and out.shape == (1, 7, 4, 8)
    assert torch.allclose(out, _reference(q, k, v, causal, 256.0, scaling=0.3), atol=1e-6)
    exact = _reference(q, k, v, causal, None, scaling=0.3)
    assert not torch.allclose(out, exact, atol=1e-6)  # it really rounds the probabilities
    assert torch.allclose(out, exact, atol=0.05)  # ... by e4m3's 3 mantissa bits, not more


def test_unrounded_attention_path_matches_sdpa():
    # the same function with P rounding disabled is the attention transformers computes (sdpa, GQA)
    class NoRound:
        prob_scale = 256.0
        queries = False

    emu = Fp8Attention(KVScales(), NoRound)
    q, k, v = _qk(seq=5)
    import kvtool.eval.fp8 as fp8mod

    orig = fp8mod.fp8_roundtrip
    try:
        fp8mod.fp8_roundtrip = lambda x, s, fmt="float8_e4m3fn": x
        out, _ = emu.attention(None, q, k, v, None)
    finally:
        fp8mod.fp8_roundtrip = orig
    ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                           is_causal=True).transpose(1, 2)
    assert torch.allclose(out, ref, atol=1e-5)


def test_q_scales_read_back_from_a_checkpoint(tmp_path):
    save_file({"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.0.self_attn.q_scale": torch.tensor([0.125]),
               "model.layers.1.self_attn.attn.q_scale": torch.tensor(0.0625),
               "model.layers.1.self_attn.q_proj.q_scale": torch.tensor(8.0)},  # not loaded by vLLM: ignored
              str(tmp_path / "model.safetensors"))
    s = read_checkpoint_scales(tmp_path)
    assert {i: float(t) for i, t in s.q.items()} == {0: 0.125, 1: 0.0625}
    save_file({"model.layers.0.self_attn.q_scale": torch.tensor([-1.0])}, str(tmp_path / "model.safetensors"))
    with pytest.raises(InputError, match="positive finite"):
        read_checkpoint_scales(tmp_path)


def test_cli_refuses_fp8_attention_without_an_fp8_cache(tmp_path, capsys):
    from kvtool.cli import main

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    assert main(["eval", str(tmp_path / "m"), "--kv-cache-dtype", "off", "--fp8-attention", "triton"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["kvtool: error: --fp8-attention: triton quantizes attention only with an FP8 KV cache; not with "
                   "kv_cache_dtype off"]
    assert main(["eval", str(tmp_path / "m"), "--fp8-attention", "flex"]) == 2
    assert "--fp8-attention" in capsys.readouterr().err


def test_api_refusals():
    from kvtool.eval.api import Candidate, evaluate_many

    with pytest.raises(UsageError, match="must be one of cache-only, flash-attn, flashinfer, triton, cpu, got .flex."):
        evaluate_many([Candidate("x", fp8_attention="flex")])
    with pytest.raises(UsageError, match="only with an FP8 KV cache"):
        evaluate_many([Candidate("x", kv_cache_dtype="off", fp8_attention="flash-attn")])


@pytest.mark.torch
def test_eval_reports_the_backend_and_q_scales(tiny_llama_path, tmp_path):
    from kvtool.eval.api import Candidate, evaluate_many

    rows = evaluate_many([Candidate(tiny_llama_path, "fp8", "one", label="cache"),
                          Candidate(tiny_llama_path, "fp8", {0: (0.05, 0.05, 0.05), 1: (0.05, 0.05)},
                                    label="fa", fp8_attention="flash-attn"),
                          Candidate(tiny_llama_path, "fp8", "one", label="tr", fp8_attention="triton")],
                         baseline=tiny_llama_path, texts=["def f(x):\n    return x + 1\n" * 12], max_length=32,
                         device=DEVICE, layerwise=False)
    cache, fa, tr = rows
    assert cache.fp8_attention["name"] == "cache-only" and "q_scales" not in cache.fp8_attention
    assert fa.fp8_attention["queries"] == "float8_e4m3fn" and fa.fp8_attention["probabilities"] == "model dtype"
    assert fa.fp8_attention["q_scales"]["checkpoint_layers"] == 1
    assert tr.fp8_attention["probabilities"] == "float8_e4m3fn (x256)"
    assert len({round(r.kld_mean, 9) for r in rows}) == 3  # three different computations
    assert fa.as_dict()["fp8_attention"]["name"] == "flash-attn"
    from kvtool.commands.eval import render_text

    text = render_text(tr)
    assert "attention triton emulated" in text and "q scale 1 (no q scales in the checkpoint" in text


@pytest.mark.slow
def test_attention_override_keeps_gemma3_sliding_windows(gemma3_path, monkeypatch):
    # with rounding switched off, the Triton row's own attention is transformers' attention, sliding layers
    # included: 600 tokens > Gemma-3's 512-token window, so the sliding masks really cut
    import kvtool.eval.fp8 as fp8mod
    from kvtool.runtime.kv_hooks import kv_hook
    from kvtool.runtime.torch_utils import load_model, load_tokenizer
    from kvtool.testing.text import evaluation_text

    model = load_model(gemma3_path, device=torch.device(DEVICE), dtype=torch.float32)
    assert model.config.get_text_config().sliding_window < 600
    ids = torch.tensor([load_tokenizer(gemma3_path)(evaluation_text())["input_ids"][:600]], device=DEVICE)
    with torch.inference_mode():
        ref = model(input_ids=ids, use_cache=False).logits
        monkeypatch.setattr(fp8mod, "fp8_roundtrip", lambda x, s, fmt="float8_e4m3fn": x)
        with kv_hook(model, Fp8Attention(KVScales(), fb.backend("triton"))):
            got = model(input_ids=ids, use_cache=False).logits
    assert float((got - ref).abs().max()) < 1e-3 * float(ref.abs().max())


def test_fp8_attention_without_an_fp8_cache_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import shutil

    import kvtool.eval.api as api
    from kvtool.errors import UsageError
    from kvtool.eval.api import evaluate

    def loaded(*a, **k):  # _emulation runs once the candidate is loaded
        raise AssertionError("a model was loaded before the refusal")

    monkeypatch.setattr(api, "_emulation", loaded)
    example = Path(__file__).resolve().parents[2] / "examples" / "llama-gqa-tiny"
    with pytest.raises(UsageError, match="declares none: give kv_cache_dtype fp8"):
        evaluate(str(example), str(example), fp8_attention="triton", texts=["x " * 64])
    # scale tensors in the headers are an FP8 cache: the pre-load check lets it through to the load
    from safetensors.torch import load_file

    model = tmp_path / "m"
    shutil.copytree(example, model)
    tensors = load_file(str(model / "model.safetensors"))
    save_file({**tensors, "model.layers.0.self_attn.k_scale": torch.tensor(0.5)}, str(model / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(AssertionError, match="a model was loaded"):
        evaluate(str(model), str(example), fp8_attention="triton", texts=["x " * 64])
