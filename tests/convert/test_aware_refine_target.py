"""What --refine-steps fits each layer to (refine_target): the original model's output at that layer, on its own
hidden states, by default; the original layer on the converted model's inputs with refine_target=layer."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.convert.aware.attention import LayerInputs, Proj, head_contexts  # noqa: E402
from kvtool.convert.aware.calibration import run_layerwise  # noqa: E402
from kvtool.convert.aware.merge import MergeSettings, merge_layer  # noqa: E402
from kvtool.convert.aware.method import REFINE_TARGETS, AwareMerge  # noqa: E402
from kvtool.errors import UsageError  # noqa: E402
from kvtool.runtime.layerwise import open_layerwise  # noqa: E402

H, KV, HD, D, B, T = 4, 2, 8, 24, 4, 32


def _layer(seed=0):
    """A random layer, its inputs x and the original stream's inputs: x moved as earlier merges move it."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    x_orig = x + 0.3 * torch.randn(B, T, D, generator=g, dtype=torch.float64)
    src = Proj(*(torch.randn(*shape, generator=g, dtype=torch.float64)
                 for shape in ((H * HD, D), (KV * HD, D), (KV * HD, D), (D, H * HD))))
    ang = torch.outer(torch.arange(T, dtype=torch.float64), 0.3 ** torch.arange(HD // 2, dtype=torch.float64))
    emb = torch.cat((ang, ang), dim=-1)
    return x, x_orig, src, emb.cos()[None], emb.sin()[None]


def _output(x, cos, sin, p):
    inp = LayerInputs(x, cos, sin, HD ** -0.5)
    return head_contexts(inp, p.to(torch.float64), H, HD) @ p.o.to(torch.float64).T


def _err(got, want):
    return float((got - want).pow(2).mean() / want.pow(2).mean())


def test_refinement_fits_the_original_streams_output_when_given():
    x, x_orig, src, cos, sin = _layer()
    settings = MergeSettings(H, KV, 1, HD, refine_steps=48)
    own, _ = merge_layer(LayerInputs(x, cos, sin, HD ** -0.5), src, settings)
    fit, _ = merge_layer(LayerInputs(x, cos, sin, HD ** -0.5, x_target=x_orig), src, settings)
    goal = _output(x_orig, cos, sin, src)  # what the original model's layer gives on its own stream
    layer = _output(x, cos, sin, src)  # what the original layer gives on the converted model's inputs
    # each refinement is closer to its own target than the other one is
    assert _err(_output(x, cos, sin, fit), goal) < 0.9 * _err(_output(x, cos, sin, own), goal)
    assert _err(_output(x, cos, sin, own), layer) < 0.9 * _err(_output(x, cos, sin, fit), layer)


def test_the_closed_form_merge_ignores_the_original_stream():
    x, x_orig, src, cos, sin = _layer(1)
    settings = MergeSettings(H, KV, 1, HD)
    own, rep = merge_layer(LayerInputs(x, cos, sin, HD ** -0.5), src, settings)
    same, rep2 = merge_layer(LayerInputs(x, cos, sin, HD ** -0.5, x_target=x_orig), src, settings)
    for f, t in own.tensors().items():
        assert torch.equal(t, same.tensors()[f]), f
    assert rep.err_final == rep2.err_final


def _whole_model_attention_inputs(src, ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    seen = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda m, args, kwargs: seen.__setitem__(m.layer_idx, kwargs["hidden_states"]), with_kwargs=True)
        for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def test_the_calibration_hands_each_layer_the_original_models_own_input(tmp_path):
    from aware_helpers import tiny_model

    src = tiny_model(tmp_path / "src", "llama", tmp_path, seed=5)
    ids = (torch.arange(2 * 40).reshape(2, 40) * 17 + 3) % 49152
    settings = MergeSettings(num_heads=4, num_kv_heads=2, target_kv_heads=1, head_dim=16)
    seen = {}

    def layer_fn(i, inp, p):
        seen[i] = inp
        return merge_layer(inp, p, settings)[0]

    with open_layerwise(src) as lm:
        assert run_layerwise(lm, ids, layer_fn, 4, target_original=True) is None  # the stream is not returned
        plain = {}

        def keep(i, inp, p):
            plain[i] = inp
            return p

        run_layerwise(lm, ids, keep, 4)
    want = _whole_model_attention_inputs(src, ids)
    assert sorted(seen) == sorted(want) == [0, 1]
    for i, inp in seen.items():
        torch.testing.assert_close(inp.x_target, want[i], rtol=1e-5, atol=1e-5)
        assert plain[i].x_target is None
    torch.testing.assert_close(seen[0].x, seen[0].x_target)
    assert _err(seen[1].x, seen[1].x_target) > 1e-4  # layer 1's input left the merged layer 0


def test_the_target_reaches_the_provenance_and_changes_the_refined_result(tmp_path, smollm2_path):
    from aware_helpers import convert, tiny_model
    from safetensors.torch import load_file

    src = tiny_model(tmp_path / "src", "llama", smollm2_path, seed=2)
    rows, weights = {}, {}
    for name, opts in (("free", []), ("original", ["--refine-steps", "4"]),
                       ("layer", ["--refine-steps", "4", "--method-opt", "refine_target=layer",
                                  "--method-opt", f"refine_lr={REFINE_TARGETS['original']}"])):
        assert convert(src, tmp_path / name, "--to", "mqa", "--method", "aware", "--calib-tokens", "256",
                       "--seq-len", "64", *opts) == 0
        rows[name] = json.loads((tmp_path / name / "kvtool.json").read_text())["method_details"]
        weights[name] = load_file(tmp_path / name / "model.safetensors")
    assert "refine_target" not in rows["free"]  # nothing is refined, so nothing is fitted to a target
    assert rows["original"]["refine_target"] == "original" and rows["layer"]["refine_target"] == "layer"
    assert rows["original"]["refine_lr"] == rows["layer"]["refine_lr"] == REFINE_TARGETS["original"]
    # with the same step, layer 0 sees the same inputs either way; layer 1 is fitted to different outputs
    k0, k1 = "model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.k_proj.weight"
    assert torch.equal(weights["original"][k0], weights["layer"][k0])
    assert not torch.equal(weights["original"][k1], weights["layer"][k1])


@pytest.mark.parametrize("value", ["stream", "", 1])
def test_unknown_targets_are_refused(value):
    with pytest.raises(UsageError, match="refine_target") as exc:
        AwareMerge(refine_target=value)
    assert exc.value.option == "method_opt"
