"""kvtool.eval.layerwise: evaluation one decoder layer at a time gives the whole model's figures."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.eval import layerwise as lw
from kvtool.eval.api import Candidate, evaluate, evaluate_many
from kvtool.runtime.layerwise import LayerwiseModel

from eval_helpers import DEVICE, copy_tokenizer, mean_pooled_mqa, with_kv_scales

L, S, N = 64, 24, 300
FIGURES = ("ppl", "ppl_se", "baseline_ppl", "ppl_ratio", "ppl_ratio_se", "kld_mean", "kld_se", "top1_agreement",
           "dp_mean", "dp_rms")


def _tiny(folder, tokenizer_from, vocab: int, model_type: str = "llama", seed: int = 1):
    """A 4-layer random model of `model_type` sharing tokenizer_from's tokenizer (non-trivial norms)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {"llama": {"tie_word_embeddings": False},
             # gemma3: tied head, scaled embedding, sliding-window and global layers; a final logit softcap
             "gemma3_text": {"sliding_window": 16, "query_pre_attn_scalar": 8, "tie_word_embeddings": True,
                             "final_logit_softcapping": 3.0}}[model_type]
    cfg = AutoConfig.for_model(model_type, vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=512,
                               bos_token_id=1, eos_token_id=2, **extra)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    copy_tokenizer(tokenizer_from, folder)
    return folder


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    root = tmp_path_factory.mktemp("lw")
    src = _tiny(root / "src", smollm2_path, len(smollm2_tokenizer))
    return src, mean_pooled_mqa(src, root / "mqa")


def _same(a, b, rel=1e-6):
    for key in FIGURES:
        x, y = a.metrics.get(key), b.metrics.get(key)
        assert (x is None) == (y is None), key
        if x is not None:
            assert x == pytest.approx(y, rel=rel, abs=1e-12), key
    assert a.tokens == b.tokens


@pytest.mark.parametrize("kv", ["off", "fp8"])
def test_candidate_against_baseline_equals_the_whole_model(four_layers, kv):
    src, mqa = four_layers
    kw = dict(max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32", kv_cache_dtype=kv)
    layered = evaluate(mqa, src, **kw)
    whole = evaluate(mqa, src, layerwise=False, **kw)
    assert layered.memory["mode"] == "layerwise" and whole.memory == {"mode": "whole_model"}
    assert layered.kv_cache_dtype == whole.kv_cache_dtype == ("fp8_e4m3" if kv == "fp8" else "float32")
    assert layered.kld_mean > 0  # the MQA copy differs: the comparison is not trivially equal
    _same(layered, whole)


def test_several_candidates_with_checkpoint_scales(four_layers, tmp_path):
    src, _ = four_layers
    scaled = with_kv_scales(src, tmp_path / "scaled", {i: (8.0 * (i + 1), 8.0) for i in range(4)})
    cands = [Candidate(src, "off", label="original"), Candidate(src, "fp8", "one", label="one"),
             Candidate(scaled, label="checkpoint scales")]
    kw = dict(max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32")
    layered = evaluate_many(cands, src, **kw)
    whole = evaluate_many(cands, src, layerwise=False, **kw)
    # the original shares the baseline's path; the scaled copy is another folder: 3 paths, not 4
    assert layered[0].forwards_per_window == 3 and whole[0].forwards_per_window == 4
    assert layered[0].kld_mean == 0.0 and layered[0].top1_agreement == 1.0
    assert layered[2].kv_scales["source"] == "checkpoint" and layered[2].kv_scales["layers"] == 4
    assert layered[2].kld_mean > layered[1].kld_mean  # scales far too large for these K/V: coarse, a real difference
    for a, b in zip(layered, whole):
        _same(a, b)


def test_segments_and_logit_chunks_do_not_change_the_figures(four_layers, monkeypatch):
    src, mqa = four_layers
    kw = dict(max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32", batch_size=2, kv_cache_dtype="fp8")
    one = evaluate(mqa, src, **kw)
    monkeypatch.setattr(lw, "SEGMENT_BYTES", 2 * L * 32 * 4 * 2)  # two paths x one batch of 2 windows
    monkeypatch.setattr(lw, "CHUNK_ELEMENTS", 7 * 49152)  # a few positions per chunk
    many = evaluate(mqa, src, **kw)
    assert one.memory["segments"] == 1 and many.memory["segments"] == one.windows // 2 + one.windows % 2
    assert many.memory["layer_reads"] == many.memory["segments"] * 8
    _same(many, one, rel=1e-5)  # the LM head on fewer rows at a time: float rounding only


def test_one_decoder_layer_and_no_head_while_layers_run(four_layers, monkeypatch):
    src, mqa = four_layers
    seen = []
    real = LayerwiseModel.materialised

    def spy(self, i):
        cm = real(self, i)

        class Wrapped:
            def __enter__(inner):
                layer = cm.__enter__()
                head = self.model.get_output_embeddings().weight
                seen.append((i, tuple(self.real_layers()), head.device.type,
                             self.model.get_input_embeddings().weight.device.type))
                return layer

            def __exit__(inner, *exc):
                return cm.__exit__(*exc)

        return Wrapped()

    monkeypatch.setattr(LayerwiseModel, "materialised", spy)
    evaluate(mqa, src, max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32")
    assert len(seen) == 8  # 4 layers of each model, once
    assert all(layers == (i,) and head == "meta" and emb == "meta" for i, layers, head, emb in seen)


def test_tied_head_with_softcapping_and_sliding_window(tmp_path, smollm2_path, smollm2_tokenizer):
    src = _tiny(tmp_path / "gemma3", smollm2_path, len(smollm2_tokenizer), "gemma3_text")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["final_logit_softcapping"] and cfg["tie_word_embeddings"]
    kw = dict(max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32", kv_cache_dtype="fp8")
    layered, whole = evaluate(src, src, **kw), evaluate(src, src, layerwise=False, **kw)
    assert layered.memory["mode"] == "layerwise"
    assert layered.kld_mean > 0  # fp8 against the plain baseline
    _same(layered, whole)


def test_loaded_modules_and_device_maps_run_whole(four_layers, smollm2_tokenizer):
    from transformers import AutoModelForCausalLM

    src, _ = four_layers
    module = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    r = evaluate(module, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=100)
    assert r.memory == {"mode": "whole_model"}
    from kvtool.errors import UsageError

    with pytest.raises(UsageError, match="model folders") as exc:
        evaluate(module, tokenizer=smollm2_tokenizer, layerwise=True)
    assert exc.value.option == "layerwise"
    with pytest.raises(UsageError, match="does not go with") as exc:
        evaluate(src, device_map="auto", layerwise=True)
    assert exc.value.option == "device_map"


def test_renamed_tensors_fall_back_to_the_whole_model_and_say_so(tmp_path, smollm2_path, smollm2_tokenizer):
    from kvtest import unprefixed_copy

    src = _tiny(tmp_path / "src", smollm2_path, len(smollm2_tokenizer))
    renamed = unprefixed_copy(src, tmp_path / "renamed")
    kw = dict(max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32")
    r = evaluate(renamed, src, **kw)
    assert r.memory["mode"] == "layerwise+whole_model" and "module's name" in r.memory["note"]
    assert r.kld_mean == pytest.approx(0.0, abs=1e-9)


@pytest.mark.slow
def test_smollm2_layer_by_layer_equals_the_whole_model(smollm2_path):
    kw = dict(max_length=256, stride=128, max_tokens=768, device=DEVICE, dtype="fp32")
    cands = [Candidate(smollm2_path, "fp8", "one", label="fp8 scale 1.0")]
    layered = evaluate_many(cands, smollm2_path, **kw)[0]
    whole = evaluate_many(cands, smollm2_path, layerwise=False, **kw)[0]
    assert layered.memory["mode"] == "layerwise" and layered.tokens == 767
    assert 0 < layered.kld_mean < 0.05
    _same(layered, whole, rel=1e-5 if DEVICE == "cpu" else 1e-4)  # CUDA sums in another order (H200: 6e-5 on KLD)
