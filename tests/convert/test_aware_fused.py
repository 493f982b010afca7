"""`--method aware` on fused-qkv layouts (phi3 qkv_proj, falcon query_key_value), phi's `dense`
o projection, and its table-driven refusals (optional q/k norms, interleaved RoPE)."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from aware_helpers import mqa_errors  # noqa: E402

from kvtool.cli import main  # noqa: E402
from kvtool.convert.aware.calibration import run_layerwise  # noqa: E402
from kvtool.convert.aware.modules import install_proj, read_proj  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")
IDS = torch.arange(300, 364).unsqueeze(0)
_COMMON = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=49152,
               max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0)
# model_type -> (config overrides, config key of the KV-head count)
ARCHS = {
    "phi3": ({"partial_rotary_factor": 0.5}, "num_key_value_heads"),  # partial rotary: half of each head rotates
    "falcon": ({"new_decoder_architecture": True, "multi_query": False, "bias": True, "alibi": False},
               "num_kv_heads"),  # grouped fused layout, q/k/v biases
    "phi": ({"qk_layernorm": False}, "num_key_value_heads"),  # separate q/k/v, o is `dense`, partial rotary
    "cohere": ({"use_qk_norm": False}, "num_key_value_heads"),
}


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_path):
    return smollm2_path  # only its tokenizer files are used


def _tiny(folder, model_type, tokenizer_dir, kv_heads=2, seed=0, **overrides):
    """A tiny random model with 4 query heads sharing SmolLM2's tokenizer (the calibration needs one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    extra, kv_key = ARCHS[model_type]
    cfg = AutoConfig.for_model(model_type, **{**_COMMON, **extra, kv_key: kv_heads, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # sharper attention than the init, so merging changes the function visibly
        for name, p in model.named_parameters():
            if ("attn" in name or "attention" in name) and name.endswith("weight") and p.ndim == 2:
                p.mul_(8.0)
            elif name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def _load(folder):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    return model.eval()


def _logits(folder, ids=IDS):
    model = _load(folder)
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


def _convert(src, dst, *args):
    return main(["convert", str(src), str(dst), "--no-eval", "--no-progress", *args])


@pytest.mark.parametrize("model_type", ["phi3", "falcon", "phi", "cohere"])
def test_duplicated_heads_merge_back_exactly(tmp_path, tokenizer_dir, model_type):
    src = _tiny(tmp_path / "gqa", model_type, tokenizer_dir)
    assert _convert(src, tmp_path / "mha", "--to", "mha") == 0
    # KV heads of the MHA model are [k0, k0, k1, k1]: the aware merge must find the original function
    assert _convert(tmp_path / "mha", tmp_path / "back", "--to", "gqa", "--groups", "2", "--method", "aware",
                    "--calib-tokens", "256") == 0
    want, _ = _logits(src)
    got, cfg = _logits(tmp_path / "back")
    assert cfg.to_dict()[ARCHS[model_type][1]] == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_phi3_aware_to_mqa_beats_mean(tmp_path, tokenizer_dir):
    aware, mean = mqa_errors(_tiny(tmp_path / "mha", "phi3", tokenizer_dir, kv_heads=4, partial_rotary_factor=1.0),
                             tmp_path)
    assert aware < 0.8 * mean


# the attention module's forward arguments besides hidden states and position embeddings
FORWARD_KW = {"phi3": {"attention_mask": None}, "falcon": {"alibi": None, "attention_mask": None}}


@pytest.mark.parametrize("model_type", ["phi3", "falcon"])
def test_installed_fused_projections_run_with_fewer_kv_heads(tmp_path, tokenizer_dir, model_type):
    """Installing projections with 2 KV heads (the first of each pair) into a 4-KV-head module gives
    the attention of a 2-KV-head model holding those heads: same output."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kvtool.model.architectures import lookup
    from kvtool.convert.aware.attention import Proj

    src = _tiny(tmp_path / "m", model_type, tokenizer_dir, kv_heads=4)
    prefix = lookup(model_type).attn_prefix(0)
    big = _load(src)
    attn = big.get_submodule(prefix)
    p = read_proj(attn)
    hd = attn.head_dim
    assert p.q.shape == (4 * hd, 64) and p.k.shape == (4 * hd, 64) and p.o.shape == (64, 4 * hd)
    keep = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in (0, 2)])

    def sub(b):
        return None if b is None else b[keep]

    merged = Proj(p.q, p.k[keep], p.v[keep], p.o, p.q_bias, sub(p.k_bias), sub(p.v_bias), p.o_bias)
    x = torch.randn(1, 10, 64)
    pos = big.base_model.rotary_emb(x, torch.arange(10).unsqueeze(0))
    install_proj(attn, merged, 4)
    assert torch.equal(read_proj(attn).k, p.k[keep]) and torch.equal(read_proj(attn).q, p.q)
    cfg = AutoConfig.from_pretrained(src)
    setattr(cfg, ARCHS[model_type][1], 2)
    ref = AutoModelForCausalLM.from_config(cfg).eval().get_submodule(prefix)
    install_proj(ref, merged, 4)
    with torch.no_grad():
        kw = dict(position_embeddings=pos, **FORWARD_KW[model_type])
        torch.testing.assert_close(attn(x, **kw)[0], ref(x, **kw)[0])


def test_cohere_with_qk_norm_is_refused_by_name(tmp_path, tokenizer_dir, capsys):
    needle = "use_qk_norm: true"
    src = _tiny(tmp_path / "c", "cohere", tokenizer_dir, kv_heads=4, use_qk_norm=True)
    rc = _convert(src, tmp_path / "out", "--to", "mqa", "--method", "aware")
    err = capsys.readouterr().err
    assert rc == 2, err
    assert needle in err and "--method mean" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_unsupported_reason_follows_the_config_flags():
    from kvtool.model.architectures import lookup
    from kvtool.convert.aware.method import unsupported_reason
    from kvtool.convert.methods import MergeJob
    from kvtool.model.spec import build_spec

    def reason(config):
        spec = build_spec(config)
        return unsupported_reason(MergeJob(src=None, spec=spec, arch=lookup(config["model_type"]), target_kv_heads=1))

    base = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "num_key_value_heads": 4}
    assert reason({"model_type": "phi", **base}) is None  # qk_layernorm defaults to false
    assert "qk_layernorm: true" in reason({"model_type": "phi", **base, "qk_layernorm": True})
    assert "qk_layernorm: true" in reason({"model_type": "stablelm", **base, "qk_layernorm": True})
    assert reason({"model_type": "stablelm", **base}) is None
    assert "normalises q/k" in reason({"model_type": "qwen3", **base})  # always-on norms: no flag
    assert reason({"model_type": "cohere2", **base}) is None  # interleaved RoPE: merged in its own pairs
    assert "alibi" in reason({"model_type": "falcon", **base, "alibi": True, "new_decoder_architecture": True})
    assert reason({"model_type": "phi3", **base}) is None
    assert reason({"model_type": "falcon", **base, "new_decoder_architecture": True}) is None


def _rotate_head_pairs(w, head, hd, planes, theta):
    """Rotate rows (a, b) of one head of w [heads*hd, ...] by theta[i] for the i-th plane (a, b)."""
    w = w.clone()
    for (a, b), t in zip(planes, theta):
        ra, rb = head * hd + a, head * hd + b
        wa, wb = w[ra].clone(), w[rb].clone()
        w[ra], w[rb] = torch.cos(t) * wa - torch.sin(t) * wb, torch.sin(t) * wa + torch.cos(t) * wb
    return w


def test_interleaved_rope_is_merged_in_its_own_pairs(tmp_path, tokenizer_dir, monkeypatch):
    """cohere (RoPE pairs 2i, 2i+1): an MHA model whose duplicated heads differ by a rotation in each
    RoPE pair (q and k rotated alike: the same function) merges back exactly only when the merge pairs
    the dims the model's RoPE rotates together (layer_fn's result is in the merge's order; on_merged
    gives the checkpoint's order)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    import kvtool.convert.aware.calibration as calib
    from kvtool.convert.aware.merge import MergeSettings, merge_layer
    from kvtool.runtime.layerwise import open_layerwise

    src = _tiny(tmp_path / "gqa", "cohere", tokenizer_dir, kv_heads=2, logit_scale=1.0)
    assert _convert(src, tmp_path / "mha", "--to", "mha") == 0  # KV heads [k0, k0, k1, k1]
    hd, planes = 16, [(2 * i, 2 * i + 1) for i in range(8)]
    path = tmp_path / "mha" / "model.safetensors"
    t = load_file(path)
    gen = torch.Generator().manual_seed(1)
    for q_name in [n for n in t if n.endswith("q_proj.weight")]:
        for head in (1, 3):  # the second copy of each KV head and the query head reading it, alike
            theta = torch.rand(len(planes), generator=gen) * 6.28
            for name in (q_name, q_name.replace("q_proj", "k_proj")):
                t[name] = _rotate_head_pairs(t[name], head, hd, planes, theta)
    save_file(t, path, metadata={"format": "pt"})
    want, _ = _logits(src)
    mha, _ = _logits(tmp_path / "mha")
    torch.testing.assert_close(mha, want, rtol=1e-4, atol=1e-4)  # the rotations keep the function

    settings = MergeSettings(num_heads=4, num_kv_heads=4, target_kv_heads=2, head_dim=hd)

    def merged_logits():
        got = {}
        with open_layerwise(tmp_path / "mha") as lm:
            calib.run_layerwise(lm, IDS, lambda i, inp, p: merge_layer(inp, p, settings)[0], 4,
                                on_merged=got.__setitem__)
        model = AutoModelForCausalLM.from_pretrained(src).eval()
        for i, p in got.items():
            attn = model.model.layers[i].self_attn
            with torch.no_grad():
                for name in ("q", "k", "v", "o"):
                    getattr(attn, f"{name}_proj").weight.copy_(getattr(p, name))
        with torch.no_grad():
            return model(input_ids=IDS).logits

    torch.testing.assert_close(merged_logits(), want, rtol=1e-4, atol=1e-4)
    # the merge in rotate_half pairs cannot undo rotations of the interleaved pairs
    monkeypatch.setattr(calib, "rope_order", lambda layout, rotary_dim: None)
    assert (merged_logits() - want).abs().max() > 1e-2


def test_interleaved_rope_needs_on_merged(tmp_path, tokenizer_dir):
    from kvtool.errors import UsageError
    from kvtool.runtime.layerwise import open_layerwise

    src = _tiny(tmp_path / "c", "cohere", tokenizer_dir, kv_heads=4)
    with open_layerwise(src) as lm, pytest.raises(UsageError, match="interleaved RoPE"):
        run_layerwise(lm, IDS, lambda i, inp, p: p, 4)
