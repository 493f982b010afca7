"""kvtool.runtime.layerwise: one decoder layer with real weights at a time, same hidden states as transformers."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from kvtool.errors import InputError  # noqa: E402
from kvtool.runtime.layerwise import open_layerwise, run_layer  # noqa: E402

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, vocab_size=300, max_position_embeddings=256, tie_word_embeddings=True)
EXTRA = {"llama": {}, "qwen2": {}, "gemma3_text": {"sliding_window": 8, "query_pre_attn_scalar": 16},
         "gemma2": {"sliding_window": 8, "query_pre_attn_scalar": 16},  # logit softcapping, eager attention only
         "mixtral": {"num_local_experts": 2, "num_experts_per_tok": 1}}
IDS = (torch.arange(2 * 40).reshape(2, 40) * 7 + 3) % 300


def _save(folder, model_type, seed=0):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, **TINY, **EXTRA[model_type])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # non-trivial norms and biases
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(folder)
    return folder


def _reference_hidden(folder):
    """Hidden states entering each layer (and leaving the last), by transformers' own whole-model forward."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    seen = []
    hooks = [layer.register_forward_pre_hook(lambda m, a, k: seen.append(a[0] if a else k["hidden_states"]),
                                             with_kwargs=True) for layer in model.model.layers]
    with torch.no_grad():
        last = model.model(input_ids=IDS, use_cache=False, output_hidden_states=True).hidden_states[-1]
    for h in hooks:
        h.remove()
    return seen, last, model.model.norm


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gemma2", "gemma3_text"])
def test_replay_matches_transformers_with_one_layer_in_memory(tmp_path, model_type):
    src = _save(tmp_path / model_type, model_type)
    want, last, norm = _reference_hidden(src)
    with open_layerwise(src) as lm:
        assert lm.mode == "layerwise" and lm.note is None
        assert lm.real_layers() == []
        emb = lm.model.get_input_embeddings()
        h, calls = lm.capture(IDS)
        assert emb.weight.device.type == "meta"  # only the rows of the tokens used were read
        for i in range(lm.num_layers):
            torch.testing.assert_close(h, want[i], rtol=1e-5, atol=1e-5)
            with lm.materialised(i) as layer:
                assert lm.real_layers() == [i]
                h = run_layer(layer, h, calls[i])
            assert lm.real_layers() == []
        torch.testing.assert_close(norm(h), last, rtol=1e-5, atol=1e-5)
        # read: every layer once, the non-layer parameters, and one embedding row per distinct token
        from kvtool.io.reader import CheckpointReader

        with CheckpointReader(src) as r:
            layer_bytes = sum(r.info(n).nbytes for n in r.names() if ".layers." in n)
            other = sum(r.info(n).nbytes for n in r.names() if ".layers." not in n and "embed_tokens" not in n)
            row = r.info("model.embed_tokens.weight").nbytes // TINY["vocab_size"]
        assert lm.bytes_read == layer_bytes + other + row * len(set(IDS.flatten().tolist()))


def test_renamed_checkpoint_tensors_fall_back_to_the_whole_model(tmp_path):
    # mixtral checkpoints store experts one by one; transformers stacks them into one tensor at load
    src = _save(tmp_path / "mixtral", "mixtral")
    want, _, _ = _reference_hidden(src)
    with open_layerwise(src) as lm:
        assert lm.mode == "whole_model"
        assert "mlp.gate.weight" in lm.note and "converts its tensor names" in lm.note
        assert lm.real_layers() == list(range(TINY["num_hidden_layers"]))
        h, calls = lm.capture(IDS)
        for i in range(lm.num_layers):
            torch.testing.assert_close(h, want[i], rtol=1e-5, atol=1e-5)
            with lm.materialised(i) as layer:
                h = run_layer(layer, h, calls[i])


def test_whole_model_on_request(tmp_path):
    src = _save(tmp_path / "llama", "llama")
    with open_layerwise(src, layerwise=False) as lm:
        assert lm.mode == "whole_model" and "turned off" in lm.note


def test_missing_tensor_is_a_one_line_error_not_random_weights(tmp_path):
    from safetensors.torch import load_file, save_file

    src = _save(tmp_path / "llama", "llama")
    tensors = load_file(src / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(InputError) as err:
        open_layerwise(src)
    msg = str(err.value)
    assert "model.layers.1.mlp.up_proj.weight" in msg and "\n" not in msg


def test_explicit_layers_path_must_name_the_layer_list(tmp_path):
    src = _save(tmp_path / "llama", "llama")
    with open_layerwise(src, layers_path="model.layers") as lm:
        assert lm.layers_path == "model.layers" and lm.num_layers == TINY["num_hidden_layers"]
    with pytest.raises(InputError, match="not the list of decoder layers"):
        open_layerwise(src, layers_path="model.norm")
    cfg = json.loads((src / "config.json").read_text())
    assert cfg["num_hidden_layers"] == TINY["num_hidden_layers"]  # the input is only read


def test_token_outside_the_vocabulary_is_a_one_line_error(tmp_path):
    src = _save(tmp_path / "llama", "llama")
    with open_layerwise(src) as lm, pytest.raises(InputError) as err:
        lm.capture(torch.tensor([[1, 2, TINY["vocab_size"] + 5]]))
    assert f"token id {TINY['vocab_size'] + 5}" in str(err.value) and "model.embed_tokens.weight" in str(err.value)


@pytest.mark.parametrize("model_type", ["llama", "falcon"])
def test_logits_from_the_last_hidden_states_are_the_models_own(tmp_path, model_type):
    """Falcon's decoder layers return tuples (its model takes outputs[0]), llama's a tensor: the stand-in
    layer that logits_from_hidden installs returns what the model expects, with or without gradients."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "falcon":
        cfg = AutoConfig.for_model("falcon", hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_kv_heads=2, new_decoder_architecture=True, vocab_size=300, alibi=False)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp_path / model_type)
        src = tmp_path / model_type
    else:
        src = _save(tmp_path / model_type, model_type)
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(input_ids=IDS, use_cache=False).logits
    with open_layerwise(src) as lm:
        h, calls = lm.capture(IDS)
        for i in range(lm.num_layers):
            with lm.materialised(i) as layer:
                h = run_layer(layer, h, calls[i])
        with lm.head():
            torch.testing.assert_close(lm.logits_from_hidden(h), want, rtol=1e-4, atol=1e-5)
            piece = h[:, 5:9].clone().requires_grad_(True)
            part = lm.logits_from_hidden(piece, grad=True)
            torch.testing.assert_close(part.detach(), want[:, 5:9], rtol=1e-4, atol=1e-5)
            part.sum().backward()
            assert piece.grad is not None and piece.grad.abs().sum() > 0
