"""`--distill-steps`: end-to-end distillation streamed layer by layer (kvtool/convert/aware/distill.py)
computes what autograd computes on the whole model, lowers the KL it measures, and keeps the start
when it cannot."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.convert.aware import distill as distill_mod  # noqa: E402
from kvtool.convert.aware.calibration import run_layerwise  # noqa: E402
from kvtool.convert.aware.merge import merge_layer  # noqa: E402
from kvtool.convert.aware.modules import install_proj, read_proj, trainable_params  # noqa: E402
from kvtool.runtime.kv_hooks import attention_modules  # noqa: E402
from kvtool.runtime.layerwise import open_layerwise  # noqa: E402

from tests.convert.test_aware_layerwise import H, IDS, LAYERS, SETTINGS, _tiny  # noqa: E402


def _merged(lm):
    """(merged projections per layer, the original stream's last hidden states) of a calibration pass."""
    merged = {}
    final = run_layerwise(lm, IDS, lambda i, inp, src: merge_layer(inp, src, SETTINGS)[0], H,
                          on_merged=merged.__setitem__, keep_original=True)
    return merged, final


def _whole(src):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()


def test_binned_kl_is_the_full_kl_with_every_token_and_a_lower_bound_with_fewer():
    g = torch.Generator().manual_seed(0)
    t_logits, s_logits = torch.randn(6, 40, generator=g) * 3, torch.randn(6, 40, generator=g) * 3
    t, s = torch.log_softmax(t_logits, -1), torch.log_softmax(s_logits, -1)
    full = float((t.exp() * (t - s)).sum())
    for k in (40, 10, 1):
        idx = t.topk(k, -1).indices
        top, rest = distill_mod._binned(t, idx)
        binned = float(distill_mod._kl(s_logits, idx, top, rest))
        if k == 40:
            assert binned == pytest.approx(full, rel=1e-5)
        else:
            assert 0 < binned < full


def test_teacher_bins_are_the_original_models_top_tokens(tmp_path):
    src = _tiny(tmp_path / "src", seed=3)
    with open_layerwise(src) as lm:
        _, final = _merged(lm)
        teacher = distill_mod.teacher_targets(lm, final, k=16)
    with torch.no_grad():
        want = torch.log_softmax(_whole(src)(input_ids=IDS).logits, -1)
    top = want.topk(16, -1)
    assert torch.equal(teacher.idx, top.indices)
    torch.testing.assert_close(teacher.logp, top.values, rtol=1e-4, atol=1e-5)
    rest = want.scatter(-1, top.indices, float("-inf")).logsumexp(-1)
    torch.testing.assert_close(teacher.rest, rest, rtol=1e-4, atol=1e-5)


def _fused(tmp_path, model_type, smollm2_path):
    from tests.convert.test_aware_fused import _tiny as tiny_fused

    return tiny_fused(tmp_path / "src", model_type, smollm2_path, kv_heads=2, seed=7)


# llama layer by layer and whole; fused qkv with biases (falcon), partial rotary in a fused qkv (phi3),
# interleaved RoPE pairs (cohere)
CASES = [("llama", True), ("llama", False), ("falcon", True), ("phi3", True), ("cohere", True)]


@pytest.mark.parametrize("model_type, layerwise", CASES)
def test_streamed_gradients_equal_autograd_on_the_whole_model(tmp_path, smollm2_path, model_type, layerwise):
    from kvtool.convert.aware.merge import MergeSettings

    if model_type == "llama":
        src, heads, kv, ids = _tiny(tmp_path / "src", seed=4), H, SETTINGS.num_kv_heads, IDS
    else:
        src, heads, kv, ids = _fused(tmp_path, model_type, smollm2_path), 4, 2, IDS[:, :32] + 300
    settings = MergeSettings(num_heads=heads, num_kv_heads=kv, target_kv_heads=1, head_dim=16)
    rows = torch.tensor([1, 2])
    with open_layerwise(src, layerwise=layerwise) as lm:
        merged = {}
        final = run_layerwise(lm, ids, lambda i, inp, p: merge_layer(inp, p, settings)[0], heads,
                              on_merged=merged.__setitem__, keep_original=True)
        teacher = distill_mod.teacher_targets(lm, final)
        d = distill_mod.Distiller(lm, ids, teacher, merged.__getitem__, num_heads=heads, lr=1e-3)
        got = {}
        loss = d.gradients(rows, lambda i, state, g: got.__setitem__(i, g))
        d.close()
    model = _whole(src)
    assert sorted(got) == list(range(model.config.num_hidden_layers))
    for p in model.parameters():
        p.requires_grad_(False)
    mods = {m.layer_idx: m for m in attention_modules(model)}
    for i, m in mods.items():
        install_proj(m, merged[i], heads)
        for p in trainable_params(m):
            p.requires_grad_(True)
    logits = model(input_ids=ids[rows]).logits
    want = sum(distill_mod._kl(logits[j], teacher.idx[r], teacher.logp[r], teacher.rest[r])
               for j, r in enumerate(rows.tolist())) / logits[..., 0].numel()
    want.backward()
    assert loss == pytest.approx(float(want.detach()), rel=1e-4)
    for i, m in mods.items():
        ref = read_proj(m, grads=True)
        for f in ("q", "k", "v", "o", "q_bias", "k_bias", "v_bias", "o_bias"):
            a, b = got[i].get(f), getattr(ref, f)
            assert (a is None) == (b is None), f
            if a is not None:
                torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-7)


def test_distillation_lowers_the_kl_and_keeps_the_start_when_it_cannot(tmp_path):
    src = _tiny(tmp_path / "src", seed=5)
    with open_layerwise(src) as lm:
        merged, final = _merged(lm)
        teacher = distill_mod.teacher_targets(lm, final)
        out = {}
        report = distill_mod.distill(lm, IDS, teacher, merged.__getitem__, out.__setitem__, num_heads=H, steps=8,
                                     lr=2e-3)
        assert report["improved"] and report["kl_end"] < 0.9 * report["kl_start"]
        assert sorted(out) == list(range(LAYERS))
        assert not torch.equal(out[0].k, merged[0].k) and out[0].k.shape == merged[0].k.shape
        # a step far too large: the result is worse, so nothing is put and the start stays
        bad = {}
        report = distill_mod.distill(lm, IDS, teacher, merged.__getitem__, bad.__setitem__, num_heads=H, steps=2,
                                     lr=50.0)
        assert not report["improved"] and report["kl_reached"] > report["kl_start"] == report["kl_end"]
        assert bad == {}


def test_cli_distills_layerwise_and_whole_model_alike_and_leaves_no_spill(tmp_path, smollm2_path, private_tmp):
    import shutil

    from kvtool.cli import main
    from kvtool.io.reader import CheckpointReader

    src = _tiny(tmp_path / "src", seed=6, vocab=49152)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    base = ["convert", str(src), "--to", "mqa", "--method", "aware", "--calib-tokens", "192", "--seq-len", "96",
            "--no-eval", "--no-progress"]
    assert main([*base[:2], str(tmp_path / "free"), *base[2:]]) == 0
    assert main([*base[:2], str(tmp_path / "lw"), *base[2:], "--distill-steps", "3"]) == 0
    assert main([*base[:2], str(tmp_path / "whole"), *base[2:], "--distill-steps", "3",
                 "--method-opt", "layerwise=false"]) == 0
    assert list(private_tmp.glob("kvtool-*")) == []
    info = json.loads((tmp_path / "lw" / "kvtool.json").read_text())["method_details"]
    assert info["distill"]["steps"] == 3 and len(info["distill"]["step_losses"]) == 3
    assert info["distill"]["kl_end"] <= info["distill"]["kl_start"]
    assert "distill" not in json.loads((tmp_path / "free" / "kvtool.json").read_text())["method_details"]
    with CheckpointReader(tmp_path / "lw") as a, CheckpointReader(tmp_path / "whole") as b, \
            CheckpointReader(tmp_path / "free") as c:
        assert a.names() == b.names()
        for n in a.names():
            torch.testing.assert_close(a.get(n), b.get(n), rtol=1e-4, atol=1e-6)
        attention = [n for n in a.names() if "self_attn" in n]
        assert attention
        # the distilled weights when the KL fell, else the training-free start (kvtool.convert.aware.distill)
        changed = [n for n in attention if not torch.equal(a.get(n), c.get(n))]
        assert bool(changed) is info["distill"]["improved"], (changed, info["distill"])


def test_a_full_disk_during_distillation_is_one_line_and_leaves_nothing(tmp_path, smollm2_path, private_tmp,
                                                                       monkeypatch, capsys):
    import errno
    import shutil

    import safetensors.torch

    from kvtool.cli import main

    src = _tiny(tmp_path / "src", seed=8, vocab=49152)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / f, src / f)
    real = safetensors.torch.save_file
    saved = []

    def save_file(tensors, path, *args, **kwargs):
        if "kvtool-distill-" in str(path):
            saved.append(path)
            if len(saved) > LAYERS + 1:  # the start is stored, then the first step's second layer update fails
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(tensors, path, *args, **kwargs)

    monkeypatch.setattr(safetensors.torch, "save_file", save_file)
    capsys.readouterr()
    rc = main(["convert", str(src), str(tmp_path / "out"), "--to", "mqa", "--method", "aware", "--calib-tokens", "192",
               "--seq-len", "96", "--distill-steps", "2", "--no-eval", "--no-progress"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and "distillation state of layer" in err
    assert "No space left on device" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()
    assert list(private_tmp.glob("kvtool-*")) == []
