"""LayerwiseModel.head / logits_from_hidden: the model's own output computation on given hidden states."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from kvtool.errors import InputError  # noqa: E402
from kvtool.runtime.layerwise import open_layerwise, run_layer  # noqa: E402

IDS = (torch.arange(2 * 24).reshape(2, 24) * 11 + 5) % 200
CONFIGS = {
    "llama": dict(tie_word_embeddings=False),
    # tied head and a final logit softcap: the head must read the embedding and apply the cap
    "gemma3_text": dict(tie_word_embeddings=True, sliding_window=8, query_pre_attn_scalar=16,
                        final_logit_softcapping=2.0),
}


def _save(folder, model_type):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=200,
                               max_position_embeddings=128, **CONFIGS[model_type])
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(folder)
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_logits_from_replayed_layers_equal_the_models(tmp_path, model_type):
    ref = _save(tmp_path / model_type, model_type)
    with torch.no_grad():
        want = ref(input_ids=IDS, use_cache=False).logits
    with open_layerwise(tmp_path / model_type) as lm:
        hidden, calls = lm.capture(IDS)
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer, torch.no_grad():
                hidden = run_layer(layer, hidden, calls[i])
        head = lm.model.get_output_embeddings()
        assert head.weight.device.type == "meta"
        with lm.head():
            assert head.weight.device.type == "cpu"
            full = lm.logits_from_hidden(hidden)
            part = lm.logits_from_hidden(hidden[:, 5:9])  # positions are independent: any slice
        assert head.weight.device.type == "meta" and lm.real_layers() == []
        if model_type == "gemma3_text":
            assert float(full.abs().max()) <= 2.0  # the softcap was applied
    torch.testing.assert_close(full, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(part, want[:, 5:9], rtol=1e-5, atol=1e-6)


def test_an_untied_head_missing_from_the_checkpoint_is_a_one_line_error(tmp_path):
    from safetensors.torch import load_file, save_file

    _save(tmp_path / "m", "llama")
    path = tmp_path / "m" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with open_layerwise(tmp_path / "m") as lm:
        with pytest.raises(InputError, match="lacks 'lm_head.weight'") as exc:
            with lm.head():
                pass
        assert exc.value.field == "lm_head.weight"
