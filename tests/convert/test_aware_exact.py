"""`--method aware` where the answer is known: duplicated heads merge back exactly; refusals."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import convert_tiny as ct  # noqa: E402
from aware_helpers import mqa_errors  # noqa: E402

from kvtool.cli import main  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_path):
    return smollm2_path  # only its tokenizer files are used


def _tiny(folder, model_type, tokenizer_dir, kv_heads=2, seed=0):
    """A tiny random model with 4 query heads that shares SmolLM2's tokenizer (the calibration needs one)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=16, vocab_size=49152,
                               max_position_embeddings=1024, tie_word_embeddings=True, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # larger attention weights than the init, so attention is far from uniform
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.mul_(8.0 if name.endswith("weight") else 1.0).add_(torch.randn_like(p) * 0.1 if "bias" in name else 0)
    model.save_pretrained(folder)
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, folder / f)
    return folder


def _permute_mha_heads(folder, order):
    """Reorder the KV heads of an MHA checkpoint (with their query heads): the same function, new layout."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((folder / "config.json").read_text())
    hd = cfg["head_dim"]
    rows = torch.cat([torch.arange(h * hd, (h + 1) * hd) for h in order])
    path = folder / "model.safetensors"
    t = load_file(path)
    for name in list(t):
        if any(f"self_attn.{p}_proj" in name for p in "qkv"):
            t[name] = t[name][rows].contiguous()
        elif "self_attn.o_proj.weight" in name:
            t[name] = t[name][:, rows].contiguous()
    save_file(t, path, metadata={"format": "pt"})


def _logits(folder, ids):
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    with torch.no_grad():
        return model(input_ids=ids).logits, model.config


def _convert(src, dst, *args):
    return main(["convert", str(src), str(dst), "--no-eval", "--no-progress", *args])


IDS = torch.arange(300, 364).unsqueeze(0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases ride the augmented input
def test_duplicated_heads_merge_back_exactly(tmp_path, tokenizer_dir, model_type):
    src = _tiny(tmp_path / "gqa", model_type, tokenizer_dir)
    assert _convert(src, tmp_path / "mha", "--to", "mha") == 0
    # KV heads of the MHA model are [k0, k0, k1, k1]; the aware merge must find the original function.
    assert _convert(tmp_path / "mha", tmp_path / "back", "--to", "gqa", "--groups", "2", "--method", "aware",
                    "--calib-tokens", "256") == 0
    want, _ = _logits(src, IDS)
    got, cfg = _logits(tmp_path / "back", IDS)
    assert cfg.num_key_value_heads == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    prov = json.loads((tmp_path / "back" / "kvtool.json").read_text())
    assert json.dumps(prov).count("aware") >= 1


def test_similarity_grouping_finds_scattered_duplicates(tmp_path, tokenizer_dir):
    src = _tiny(tmp_path / "gqa", "llama", tokenizer_dir)
    assert _convert(src, tmp_path / "mha", "--to", "mha") == 0
    _permute_mha_heads(tmp_path / "mha", [0, 2, 1, 3])  # KV heads now [k0, k1, k0, k1]
    want, _ = _logits(src, IDS)
    mha, _ = _logits(tmp_path / "mha", IDS)
    torch.testing.assert_close(mha, want, rtol=1e-4, atol=1e-4)  # the permutation itself is exact
    common = ["--to", "gqa", "--groups", "2", "--method", "aware", "--calib-tokens", "256"]
    assert _convert(tmp_path / "mha", tmp_path / "sim", *common, "--grouping", "similarity") == 0
    assert _convert(tmp_path / "mha", tmp_path / "contig", *common) == 0
    got, _ = _logits(tmp_path / "sim", IDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    contig, _ = _logits(tmp_path / "contig", IDS)
    assert (contig - want).abs().max() > 1e-2  # contiguous groups pair different heads: not exact


def test_aware_to_mqa_loads_and_beats_mean_on_a_random_model(tmp_path, tokenizer_dir):
    # random heads are nearly independent, so even the best single shared head keeps only part of them:
    # a modest margin here, a wide one on SmolLM2
    aware, mean = mqa_errors(_tiny(tmp_path / "gqa", "llama", tokenizer_dir, kv_heads=4), tmp_path)
    assert aware < 0.8 * mean


def test_aware_refuses_per_head_qk_norms_naming_mean(tmp_path, capsys):
    src = ct.build("gemma3_text", tmp_path / "g3", kv_heads=2)
    rc = _convert(src, tmp_path / "out", "--to", "mqa", "--method", "aware")
    err = capsys.readouterr().err
    assert rc == 2
    assert "--method mean" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_calibration_options_are_refused_by_mean(tmp_path, capsys):
    src = ct.build("llama", tmp_path / "l", kv_heads=2)
    rc = _convert(src, tmp_path / "out", "--to", "mqa", "--refine-steps", "3")
    assert rc == 2 and "refine_steps" in capsys.readouterr().err


def test_bad_grouping_is_a_usage_error(tmp_path, capsys):
    src = ct.build("llama", tmp_path / "l", kv_heads=2)
    rc = _convert(src, tmp_path / "out", "--to", "mqa", "--method", "aware", "--grouping", "random")
    assert rc == 2 and "contiguous, similarity" in capsys.readouterr().err
