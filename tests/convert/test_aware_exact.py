"""`--method aware` where the answer is known: duplicated heads merge back exactly; refusals."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import convert_tiny as ct  # noqa: E402
from aware_helpers import convert, logits, mqa_errors, tiny_model  # noqa: E402


@pytest.fixture(scope="module")
def tokenizer_dir(smollm2_path):
    return smollm2_path  # only its tokenizer files are used


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


IDS = torch.arange(300, 364).unsqueeze(0)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])  # qwen2: q/k/v biases ride the augmented input
def test_duplicated_heads_merge_back_exactly(tmp_path, tokenizer_dir, model_type):
    src = tiny_model(tmp_path / "gqa", model_type, tokenizer_dir)
    assert convert(src, tmp_path / "mha", "--to", "mha") == 0
    # KV heads of the MHA model are [k0, k0, k1, k1]; the aware merge must find the original function.
    assert convert(tmp_path / "mha", tmp_path / "back", "--to", "gqa", "--groups", "2", "--method", "aware",
                    "--calib-tokens", "256") == 0
    want, _ = logits(src, IDS)
    got, cfg = logits(tmp_path / "back", IDS)
    assert cfg.num_key_value_heads == 2
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    prov = json.loads((tmp_path / "back" / "kvtool.json").read_text())
    assert json.dumps(prov).count("aware") >= 1


@pytest.mark.parametrize("grouping", [None, "similarity"])  # None: the default, error
def test_grouping_finds_scattered_duplicates(tmp_path, tokenizer_dir, grouping):
    src = tiny_model(tmp_path / "gqa", "llama", tokenizer_dir)
    assert convert(src, tmp_path / "mha", "--to", "mha") == 0
    _permute_mha_heads(tmp_path / "mha", [0, 2, 1, 3])  # KV heads now [k0, k1, k0, k1]
    want, _ = logits(src, IDS)
    mha, _ = logits(tmp_path / "mha", IDS)
    torch.testing.assert_close(mha, want, rtol=1e-4, atol=1e-4)  # the permutation itself is exact
    common = ["--to", "gqa", "--groups", "2", "--method", "aware", "--calib-tokens", "256"]
    assert convert(tmp_path / "mha", tmp_path / "found", *common, *(["--grouping", grouping] if grouping else [])) == 0
    assert convert(tmp_path / "mha", tmp_path / "contig", *common, "--grouping", "contiguous") == 0
    got, _ = logits(tmp_path / "found", IDS)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    details = json.loads((tmp_path / "found" / "kvtool.json").read_text())["method_details"]
    assert details["grouping"] == (grouping or "error")
    assert set(map(tuple, details["kv_order"].values())) == {(0, 2, 1, 3)}  # every layer, the duplicates paired
    contig, _ = logits(tmp_path / "contig", IDS)
    assert (contig - want).abs().max() > 1e-2  # contiguous groups pair different heads: not exact


def test_aware_to_mqa_loads_and_beats_mean_on_a_random_model(tmp_path, tokenizer_dir):
    # random heads are nearly independent, so even the best single shared head keeps only part of them:
    # a modest margin here, a wide one on SmolLM2
    aware, mean = mqa_errors(tiny_model(tmp_path / "gqa", "llama", tokenizer_dir, kv_heads=4), tmp_path)
    assert aware < 0.8 * mean


def test_aware_refuses_per_head_qk_norms_naming_mean(tmp_path, capsys):
    src = ct.build("gemma3_text", tmp_path / "g3", kv_heads=2)
    rc = convert(src, tmp_path / "out", "--to", "mqa", "--method", "aware")
    err = capsys.readouterr().err
    assert rc == 2
    assert "--method mean" in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_calibration_options_are_refused_by_mean(tmp_path, capsys):
    src = ct.build("llama", tmp_path / "l", kv_heads=2)
    rc = convert(src, tmp_path / "out", "--to", "mqa", "--refine-steps", "3")
    assert rc == 2 and "refine_steps" in capsys.readouterr().err


def test_bad_grouping_is_a_usage_error(tmp_path, capsys):
    src = ct.build("llama", tmp_path / "l", kv_heads=2)
    rc = convert(src, tmp_path / "out", "--to", "mqa", "--method", "aware", "--grouping", "random")
    assert rc == 2 and "error, contiguous, similarity" in capsys.readouterr().err
