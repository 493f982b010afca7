"""Every supported architecture, as a tiny random transformers model: convert, load, run, compare.

- --to mqa: loads with no missing / unexpected keys, runs, and the pooled K/V rows equal the mean
  of each group's heads computed directly from the source tensors;
- --to mha: exact expansion, same logits as the source;
- --to mha then back to the source group count: bit-identical tensors and identical logits;
- converting to the current group count is the identity.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import convert_tiny as ct  # noqa: E402

from kvtool.cli import main  # noqa: E402

H, HD = 4, 16
SUPPORTED = [a for a in ct.ARCHS if a != "gpt_bigcode"]


def _convert(src, dst, *args):
    rc = main(["convert", str(src), str(dst), "--no-eval", "--no-progress", *args])
    assert rc == 0, f"convert {' '.join(args)} exited {rc}"
    return dst


def _attn_rows(model_type: str, sd: dict, layer: int, kv: int) -> dict:
    """Per-KV-head K and V rows (and biases) of one layer, read with index formulas written from
    each transformers modeling file (independent of kvtool's splitting code)."""
    if model_type == "falcon":
        w = sd[f"transformer.h.{layer}.self_attention.query_key_value.weight"]
        b = sd.get(f"transformer.h.{layer}.self_attention.query_key_value.bias")
        r = H // kv  # falcon new_decoder_architecture: per KV group [q x r, k, v]
        k = [slice((j * (r + 2) + r) * HD, (j * (r + 2) + r + 1) * HD) for j in range(kv)]
        v = [slice((j * (r + 2) + r + 1) * HD, (j * (r + 2) + r + 2) * HD) for j in range(kv)]
    elif model_type == "phi3":
        w = sd[f"model.layers.{layer}.self_attn.qkv_proj.weight"]
        b = None  # phi3 qkv_proj: [q (H*hd) | k (KV*hd) | v (KV*hd)]
        k = [slice(H * HD + j * HD, H * HD + (j + 1) * HD) for j in range(kv)]
        v = [slice((H + kv) * HD + j * HD, (H + kv) * HD + (j + 1) * HD) for j in range(kv)]
    elif model_type == "gpt_bigcode":
        w = sd[f"transformer.h.{layer}.attn.c_attn.weight"]
        b = sd[f"transformer.h.{layer}.attn.c_attn.bias"]
        if kv == 1:  # multi_query: [q (H*hd) | k (hd) | v (hd)]
            k, v = [slice(H * HD, (H + 1) * HD)], [slice((H + 1) * HD, (H + 2) * HD)]
        else:  # per head [q, k, v]
            k = [slice((3 * h + 1) * HD, (3 * h + 2) * HD) for h in range(kv)]
            v = [slice((3 * h + 2) * HD, (3 * h + 3) * HD) for h in range(kv)]
    else:
        p = f"model.layers.{layer}.self_attn"
        out = {"k": [sd[f"{p}.k_proj.weight"][j * HD:(j + 1) * HD] for j in range(kv)],
               "v": [sd[f"{p}.v_proj.weight"][j * HD:(j + 1) * HD] for j in range(kv)]}
        for n in ("k", "v"):
            if f"{p}.{n}_proj.bias" in sd:
                out[n + "_bias"] = [sd[f"{p}.{n}_proj.bias"][j * HD:(j + 1) * HD] for j in range(kv)]
        kn = sd.get(f"{p}.k_norm.weight")
        if kn is not None and model_type in ("olmo2", "cohere"):  # one weight per K channel
            out["k_norm"] = [kn.reshape(-1)[j * HD:(j + 1) * HD] for j in range(kv)]
        return out
    out = {"k": [w[s] for s in k], "v": [w[s] for s in v]}
    if b is not None:
        out["k_bias"], out["v_bias"] = [b[s] for s in k], [b[s] for s in v]
    return out


def _source(tmp_path_factory, model_type, kv):
    folder = tmp_path_factory.mktemp(f"{model_type}-kv{kv}") / "src"
    return ct.build(model_type, folder, kv_heads=kv)


def _check_loads(folder):
    model, info = ct.load(folder)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info.get("mismatched_keys")
    out = ct.logits(model)
    assert torch.isfinite(out).all()
    return out


def _assert_same_tensors(a_dir, b_dir):
    a, b = ct.state(a_dir), ct.state(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_convert_architecture(tmp_path_factory, capsys, model_type):
    src = _source(tmp_path_factory, model_type, 2)
    work = src.parent
    src_logits = _check_loads(src)

    # MQA: pooled rows equal the direct mean of each group's heads.
    capsys.readouterr()
    mqa = _convert(src, work / "mqa", "--to", "mqa")
    approximate_norm = "k_norm spans all KV heads" in capsys.readouterr().err
    assert approximate_norm == (model_type in ("olmo2", "cohere"))  # the all-channel k_norm is said to be approximate
    _check_loads(mqa)
    s, m = ct.state(src), ct.state(mqa)
    for layer in range(2):
        before, after = _attn_rows(model_type, s, layer, 2), _attn_rows(model_type, m, layer, 1)
        assert set(before) == set(after)
        for part in before:
            direct = (before[part][0].double() + before[part][1].double()) / 2
            assert torch.equal(after[part][0], direct.to(after[part][0].dtype)), (layer, part)

    # MHA: exact expansion, same function.
    mha = _convert(src, work / "mha", "--to", "mha")
    torch.testing.assert_close(_check_loads(mha), src_logits, rtol=1e-5, atol=1e-5)
    # ... and back: bit-identical tensors, identical logits.
    back = _convert(mha, work / "back", "--to", "gqa", "--groups", "2")
    _assert_same_tensors(src, back)
    assert torch.equal(_check_loads(back), src_logits)
    # Same group count: identity.
    same = _convert(src, work / "same", "--to", "gqa", "--groups", "2")
    _assert_same_tensors(src, same)


def test_convert_gpt_bigcode_mha_to_mqa_and_back(tmp_path_factory):
    src = _source(tmp_path_factory, "gpt_bigcode", 4)
    work = src.parent
    _check_loads(src)
    mqa = _convert(src, work / "mqa", "--to", "mqa")
    mqa_logits = _check_loads(mqa)
    s, m = ct.state(src), ct.state(mqa)
    for layer in range(2):
        before, after = _attn_rows("gpt_bigcode", s, layer, 4), _attn_rows("gpt_bigcode", m, layer, 1)
        for part in before:
            direct = sum(x.double() for x in before[part]) / 4
            assert torch.equal(after[part][0], direct.to(after[part][0].dtype)), (layer, part)
    mha = _convert(mqa, work / "mha", "--to", "mha")
    torch.testing.assert_close(_check_loads(mha), mqa_logits, rtol=1e-5, atol=1e-5)
    back = _convert(mha, work / "back", "--to", "mqa")
    _assert_same_tensors(mqa, back)
    assert '"multi_query": true' in (mqa / "config.json").read_text()
    assert main(["convert", str(src), str(work / "g2"), "--to", "gqa", "--groups", "2", "--no-eval"]) == 2


@pytest.mark.parametrize("model_type", SUPPORTED)
def test_bf16_fast_path_writes_the_float_path_bytes(tmp_path_factory, monkeypatch, model_type):
    """BF16 K/V pooled on storage arrays, q / o never loaded (issue 18): the same file bytes as
    widening every attention tensor to float, pooling and rounding back (the path before)."""
    import kvtool.io.arrays as arrays
    from kvtool.convert.pooling import MeanPooling

    pooled = []
    real = arrays.mean_groups_bf16
    monkeypatch.setattr(arrays, "mean_groups_bf16", lambda g: (pooled.append(g.shape), real(g))[1])
    src = ct.build(model_type, tmp_path_factory.mktemp(f"{model_type}-bf16") / "src", kv_heads=4,
                   dtype=torch.bfloat16)
    work = src.parent
    targets = (("--to", "mqa"), ("--to", "gqa", "--groups", "2"))
    fast = [_convert(src, work / f"fast{i}", *t) for i, t in enumerate(targets)]
    assert pooled  # the storage path ran
    monkeypatch.setattr(MeanPooling, "reads", None)
    monkeypatch.setattr(MeanPooling, "storage_dtypes", ())
    slow = [_convert(src, work / f"slow{i}", *t) for i, t in enumerate(targets)]
    for f, s in zip(fast, slow):
        files = sorted(p.name for p in f.glob("*.safetensors"))
        assert files and files == sorted(p.name for p in s.glob("*.safetensors"))
        for name in files:
            assert (f / name).read_bytes() == (s / name).read_bytes(), (model_type, name)
