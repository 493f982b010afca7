"""quantize-kv calibrates layer by layer (kvtool.runtime.layerwise): one decoder layer's weights in memory at a
time, and exactly the scales the whole model gives (same observers, same data)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from kvtest import running_kv_amax  # noqa: E402

from kvtool.runtime.layerwise import open_layerwise  # noqa: E402
from kvtool.quantize.calibrate import calibrate_layers  # noqa: E402
from kvtool.quantize.formats import FORMATS  # noqa: E402

E4M3 = FORMATS["e4m3"]
LAYERS, KV = 3, 2
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=LAYERS, num_attention_heads=4,
            num_key_value_heads=KV, head_dim=16, max_position_embeddings=256, tie_word_embeddings=True)
EXTRA = {"llama": {},
         # sliding layers (window 8 < the 40-token sequences) around one full-attention layer
         "gemma3_text": {"sliding_window": 8, "query_pre_attn_scalar": 16,
                         "layer_types": ["sliding_attention", "full_attention", "sliding_attention"]},
         # the base model's forward scales the embeddings before layer 0
         "granite": {"embedding_multiplier": 3.0, "attention_multiplier": 0.25, "residual_multiplier": 0.5},
         # experts stored one by one, stacked by transformers at load: not readable layer by layer
         "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1}}
# two batches of different shapes, as tokenize_windows makes them (full windows, then the shorter rest)
BATCHES = [(torch.arange(2 * 40).reshape(2, 40) * 7 + 3) % 300, (torch.arange(23).reshape(1, 23) * 11 + 5) % 300]


def _save(folder, model_type, vocab=300, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, **TINY, **EXTRA[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # non-trivial norms, and K/V values of different sizes per layer and head
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "k_proj" in name or "v_proj" in name:
                p.mul_(1 + 4 * torch.rand(p.shape[0], 1))
    model.save_pretrained(folder)
    return folder


def _calibrate(src, layerwise: bool, observer: str, strategy: str, spy=None):
    with open_layerwise(src, dtype=torch.float32, attn="sdpa", layerwise=layerwise) as lm:
        assert lm.mode == ("layerwise" if layerwise else "whole_model")
        hooks = spy(lm) if spy else []
        try:
            return calibrate_layers(lm, BATCHES, observer=observer, strategy=strategy, fmt=E4M3, num_kv_heads=KV)
        finally:
            for h in hooks:
                h.remove()


def _full_forward_amax(src):
    """Running max |K| / |V| per layer and KV head from transformers' ordinary whole-model forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32, attn_implementation="sdpa").eval()
    return running_kv_amax(model, BATCHES)


def _assert_same(a, b):
    assert sorted(a.k) == sorted(b.k) == list(range(LAYERS))
    for i in range(LAYERS):
        for x, y in ((a.k[i], b.k[i]), (a.v[i], b.v[i]), (a.k_amax[i], b.k_amax[i]), (a.v_amax[i], b.v_amax[i])):
            assert x.dtype == y.dtype == torch.float32 and x.shape == y.shape
            assert torch.equal(x, y), (i, x, y)


@pytest.mark.parametrize("model_type", ["llama", "gemma3_text", "granite"])
def test_layer_by_layer_scales_equal_the_whole_models(tmp_path, model_type):
    src = _save(tmp_path / model_type, model_type)
    lw = _calibrate(src, True, "absmax-pow2:2", "attn_head")
    whole = _calibrate(src, False, "absmax-pow2:2", "attn_head")
    _assert_same(lw, whole)
    assert whole.notes == ["the whole model was loaded, not one layer at a time: layer-by-layer loading was turned off"]
    assert lw.notes == []
    # and both are what the ordinary forward writes to the cache, the running maximum over both batches
    ref = _full_forward_amax(src)
    for i in range(LAYERS):
        torch.testing.assert_close(lw.k_amax[i], ref[(i, "k")], rtol=1e-6, atol=0)
        torch.testing.assert_close(lw.v_amax[i], ref[(i, "v")], rtol=1e-6, atol=0)
    assert len({float(lw.k_amax[i].max()) for i in range(LAYERS)}) == LAYERS  # the layers differ


def test_attn_out_search_gives_the_same_choice_and_errors_layer_by_layer(tmp_path):
    src = _save(tmp_path / "llama", "llama")
    lw = _calibrate(src, True, "attn-out:2", "tensor")
    whole = _calibrate(src, False, "attn-out:2", "tensor")
    _assert_same(lw, whole)
    assert sorted(lw.search) == sorted(whole.search) == [(i, r) for i in range(LAYERS) for r in ("k", "v")]
    for key, (cands, errors) in lw.search.items():
        assert torch.equal(cands, whole.search[key][0])
        torch.testing.assert_close(errors, whole.search[key][1], rtol=1e-9, atol=0)
        assert errors.min() > 0  # the candidates were tried on real weights, not on an empty layer


def test_calibration_holds_one_decoder_layer_at_a_time(tmp_path):
    """Every attention call of the calibration (the observed pass and attn-out's candidate reruns) sees
    exactly one decoder layer with real weights, its own, and the input embedding never loaded whole."""
    src = _save(tmp_path / "gemma3_text", "gemma3_text")
    seen = []

    def spy(lm):
        from kvtool.runtime.kv_hooks import attention_modules

        def record(mod, args, kwargs):
            seen.append((mod.layer_idx, lm.real_layers(), lm.model.get_input_embeddings().weight.device.type))

        return [m.register_forward_pre_hook(record, with_kwargs=True) for m in attention_modules(lm.model)]

    r = _calibrate(src, True, "attn-out:2", "tensor", spy=spy)
    assert sorted(r.k) == list(range(LAYERS))
    # per layer: 2 batches observed, then 9 K and 9 V candidates, each over the 2 batches
    assert [s[0] for s in seen] == [i for i in range(LAYERS) for _ in range(2 + 2 * 9 * 2)]
    for layer, real, emb in seen:
        assert real == [layer] and emb == "meta"


def _with_tokenizer(src, smollm2_path):
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    return src


def test_cli_writes_the_same_checkpoint_layer_by_layer_and_records_how(tmp_path, smollm2_path, calib_text_file):
    from kvtool.cli import main
    from kvtool.io.reader import CheckpointReader
    from kvtool.quantize.run import QuantizeOptions, quantize_kv

    src = _with_tokenizer(_save(tmp_path / "src", "llama", vocab=49152, seed=1), smollm2_path)
    before = {p.name: p.stat().st_mtime_ns for p in src.iterdir()}
    assert main(["quantize-kv", str(src), str(tmp_path / "lw"), "--calib-text", str(calib_text_file),
                 "--calib-tokens", "160", "--seq-len", "64", "--no-eval", "--device", "cpu"]) == 0
    res = quantize_kv(str(src), str(tmp_path / "whole"),
                      QuantizeOptions(src=str(src), dst=str(tmp_path / "whole"), calib_text=[str(calib_text_file)], calib_tokens=160, seq_len=64,
                                      no_eval=True, device="cpu", layerwise=False))
    assert {p.name: p.stat().st_mtime_ns for p in src.iterdir()} == before
    assert res.calibration.notes and "whole model" in res.calibration.notes[0]
    prov = {k: json.loads((tmp_path / k / "kvtool.json").read_text()) for k in ("lw", "whole")}
    assert prov["lw"]["calibration"]["model"] == {"mode": "layerwise"}
    assert prov["whole"]["calibration"]["model"] == {"mode": "whole_model",
                                                     "note": "layer-by-layer loading was turned off"}
    assert prov["lw"]["scales"] == prov["whole"]["scales"] and len(prov["lw"]["scales"]) == 3 * LAYERS  # k, v and q
    assert prov["lw"]["amax"] == prov["whole"]["amax"]
    with CheckpointReader(tmp_path / "lw") as a, CheckpointReader(tmp_path / "whole") as b:
        assert a.names() == b.names()
        for n in a.names():
            assert torch.equal(a.get(n), b.get(n)), n


def test_whole_model_fallback_says_so_and_the_report_reuses_the_model(tmp_path, smollm2_path, calib_text_file,
                                                                      eval_text_file, monkeypatch):
    from kvtool.quantize import run as run_mod
    from kvtool.quantize.report import render

    src = _with_tokenizer(_save(tmp_path / "src", "mixtral", vocab=49152, seed=2), smollm2_path)

    def no_second_load(*a, **k):
        raise AssertionError("the quality report loaded the model again")

    monkeypatch.setattr("kvtool.runtime.torch_utils.load_model", no_second_load)
    res = run_mod.quantize_kv(str(src), str(tmp_path / "out"),
                              run_mod.QuantizeOptions(src=str(src), dst=str(tmp_path / "out"),
                                                      calib_text=[str(calib_text_file)], calib_tokens=96, seq_len=48,
                                                      eval_text=[str(eval_text_file)], eval_tokens=64, device="cpu"))
    held = json.loads((tmp_path / "out" / "kvtool.json").read_text())["calibration"]["model"]
    assert held["mode"] == "whole_model" and "converts its tensor names" in held["note"]
    assert sorted(res.calibration.k) == list(range(LAYERS))
    assert [r.label for r in res.quality][:2] == ["original", "fp8 scale 1.0"]
    assert "note: the whole model was loaded, not one layer at a time" in render(res)
