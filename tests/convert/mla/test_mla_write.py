"""`kvtool convert --to mla` end to end on a tiny random llama, with the stand-in solve of mla_helpers (the real
kvtool.convert.mla.solve is tested on its own): what is written loads in transformers with no remote code and
computes the MLA attention of the solved tensors; lint, kv-budget and quantize-kv read it."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.cli import main
from mla_helpers import install_fake_solve, reference_attention, solve_layer, tiny_llama

R, ROPE = 24, 8  # 4 heads of 16, 2 KV heads: the source caches 2 x 2 x 16 = 64 dims per layer, MLA 32


@pytest.fixture
def converted(smollm2_path, tmp_path, monkeypatch):
    calls = install_fake_solve(monkeypatch)
    src = tiny_llama(tmp_path / "src", smollm2_path)
    dst = tmp_path / "mla"
    rc = main(["convert", str(src), str(dst), "--to", "mla", "--kv-rank", str(R), "--rope-dim", str(ROPE),
               "--engine", "transformers", "--calib-tokens", "64", "--seq-len", "32", "--calib-dataset", "pydoc", "--no-eval", "--no-progress"])
    assert rc == 0
    return src, dst, calls


def test_calibration_then_one_solve_per_layer(converted):
    _, dst, calls = converted
    # the source model once over 64 tokens in 2 sequences of 32; each layer solved with its statistics as the
    # forward reaches it, and the converted layer's output goes on
    assert calls[0] == ("stats", "LlamaForCausalLM", (2, 32))
    weights = ["k_proj.weight", "o_proj.weight", "q_proj.weight", "v_proj.weight"]
    # the horizon of the static pairs: the config's max_position_embeddings (no --serve-context)
    assert calls[1:] == [("solve", weights, {"layer": 0}, 1024), ("output", (2, 32, 64)),
                         ("solve", weights, {"layer": 1}, 1024), ("output", (2, 32, 64))]
    prov = json.loads((dst / "kvtool.json").read_text())
    assert prov["mla"]["kv_lora_rank"] == R and prov["mla"]["rope_source_pairs"] == [0, 1, 2, 3]
    assert prov["solve"]["solve"] == "tests/convert/mla/mla_helpers.py"  # the solve's own record
    assert prov["solve"]["options"]["seed"] == "mqa"  # --mla-solve's default, mqa-seed, chose the solve
    assert (prov["solve"]["calib_tokens"], prov["solve"]["seq_len"]) == (64, 32)


def test_transformers_loads_it_without_remote_code_and_computes_mla(converted):
    from transformers import AutoModelForCausalLM

    from kvtool.convert.mla.shape import MlaShape

    src, dst, _ = converted
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["q_lora_rank"] is None and cfg["first_k_dense_replace"] == 2
    assert cfg["rope_theta"] == pytest.approx(10000.0 ** (ROPE / 16)) and cfg["rope_interleave"] is True
    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert type(model).__name__ == "DeepseekV3ForCausalLM"
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ids = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 40, 49152) and torch.isfinite(logits).all()
    # the lm_head of a tied source is its embeddings, written out
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert not model.config.tie_word_embeddings

    assert_layer_computes_mla(src, model, R, ROPE, cfg["rms_norm_eps"])


def assert_layer_computes_mla(src, model, rank, rope, eps):
    """Layer 0's attention as written = the MLA maths on the solve's own tensors, its rope pairs turning as the
    source's fastest pairs (the config's rope_theta, rope_interleave)."""
    from transformers import AutoModelForCausalLM

    from kvtool.convert.mla.shape import MlaShape

    source = AutoModelForCausalLM.from_pretrained(src)
    sa = source.model.layers[0].self_attn
    weights = {f"{n}_proj.weight": getattr(sa, f"{n}_proj").weight.detach() for n in "qkvo"}
    shape = MlaShape(hidden_size=64, num_heads=4, kv_lora_rank=rank, qk_rope_head_dim=rope,
                     qk_nope_head_dim=16 - rope, v_head_dim=16)
    tensors = solve_layer(weights, None, shape, None)
    torch.manual_seed(1)
    x = torch.randn(1, 12, 64)
    pos = torch.arange(12).unsqueeze(0)
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        got = attn(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None)[0][0]
        want = reference_attention(tensors, shape, 10000.0, 16, x[0], eps)
    # transformers' attention is causal when attention_mask is None (sdpa's is_causal)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()


def test_rope_over_all_but_one_pair(smollm2_path, tmp_path, monkeypatch):
    """--rope-dim head_dim - 2 (the most allowed: qk_nope_head_dim 0 is lint's KV401): nearly every key the shared
    rope key."""
    from transformers import AutoModelForCausalLM

    install_fake_solve(monkeypatch)
    src = tiny_llama(tmp_path / "src", smollm2_path)
    dst = tmp_path / "mla"
    assert main(["convert", str(src), str(dst), "--to", "mla", "--kv-rank", "16", "--rope-dim", "14",
                 "--engine", "transformers", "--calib-tokens", "64", "--seq-len", "32", "--calib-dataset", "pydoc", "--no-eval",
                 "--no-progress"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert model.config.qk_nope_head_dim == 2
    assert_layer_computes_mla(src, model, 16, 14, model.config.rms_norm_eps)


def test_lint_and_kv_budget_read_the_output(converted, capsys):
    _, dst, _ = converted
    capsys.readouterr()
    rc = main(["lint", str(dst), "--output-format", "json"])
    (model,) = json.loads(capsys.readouterr().out)["models"]
    errors = [f for f in model["findings"] if f["severity"] == "error"]
    # written for transformers (--engine transformers): a 32-value row no vLLM release serves, which lint and
    # kv-budget both say (KV404), and nothing else
    assert rc == 1 and [f["code"] for f in errors] == ["KV404"], errors
    assert model["model_type"] == "deepseek_v3" and model["kv_cache"]["bytes_per_token"] == 2 * (R + ROPE) * 2
    assert main(["kv-budget", str(dst), "--format", "json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["problems"] == [next(p for p in out["problems"] if "= 24 + 8 = 32: vllm " in p)]
    # 2 layers x (24 + 8) latent dims x 2 bytes (the float32 source's config says bfloat16)
    assert out["kv_bytes_per_token"] == 2 * (R + ROPE) * 2
    assert [layer["kind"] for layer in out["layers"]] == ["MLA", "MLA"]


@pytest.mark.torch
def test_quantize_kv_refuses_mla_with_what_vllm_does(converted, capsys):
    _, dst, _ = converted
    capsys.readouterr()
    rc = main(["quantize-kv", str(dst), str(dst.parent / "q"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "MLA" in err and "--kv-cache-dtype fp8" in err
    assert not (dst.parent / "q").exists()


def test_eval_scores_it_against_the_source(converted, capsys):
    """kvtool eval loads the DeepSeek-layout folder (layer by layer, transformers) beside the llama source."""
    src, dst, _ = converted
    capsys.readouterr()
    rc = main(["eval", str(dst), "--baseline", str(src), "--max-tokens", "96", "--max-length", "48", "--format",
               "json", "--no-progress", "--device", "cpu"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0, out
    r = out[0] if isinstance(out, list) else out
    import math

    assert r["model"] == str(dst) and r["baseline"] == str(src)
    # a random source and a stand-in solve: the figures only have to be real numbers, and the models differ
    assert math.isfinite(r["ppl_ratio"]) and math.isfinite(r["kld_mean"]) and r["kld_mean"] > 0


def test_the_real_mqa_seed_solve_writes_what_transformers_loads(smollm2_path, tmp_path):
    """No stand-in: the default solve (mqa-seed) on a tiny llama, written, loaded with no remote code; its default
    rope part is the head less the pairs static over max_position_embeddings (1024 positions at theta 1e4: the
    slowest pair), which the latent carries as per-head NoPE keys."""
    from transformers import AutoModelForCausalLM

    src = tiny_llama(tmp_path / "src", smollm2_path)
    dst = tmp_path / "mla"
    assert main(["convert", str(src), str(dst), "--to", "mla", "--kv-budget", "50%", "--engine", "transformers", "--calib-tokens", "64",
                 "--seq-len", "32", "--calib-dataset", "pydoc", "--no-eval", "--no-progress"]) == 0
    prov = json.loads((dst / "kvtool.json").read_text())
    assert prov["solve"]["options"]["seed"] == "mqa" and prov["mla"]["qk_rope_head_dim"] == 14
    model, info = AutoModelForCausalLM.from_pretrained(dst, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert (model.config.kv_lora_rank, model.config.qk_nope_head_dim) == (18, 2)
    source = AutoModelForCausalLM.from_pretrained(src)
    ids = torch.arange(5, 45).unsqueeze(0)
    with torch.no_grad():
        got, want = model(input_ids=ids).logits, source(input_ids=ids).logits
    assert torch.isfinite(got).all()
    kld = torch.nn.functional.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True, reduction="batchmean")
    assert float(kld) / ids.shape[1] < 0.05  # a random tiny model converted at half its KV bytes stays near it


def test_any_verify_callable_is_the_check_and_the_named_release_is_checked(smollm2_path, tmp_path, monkeypatch,
                                                                           capsys):
    from kvtool.convert.run import apply, plan
    from kvtool.options.convert import ConvertOptions

    install_fake_solve(monkeypatch)
    src = tiny_llama(tmp_path / "src", smollm2_path)
    opts = dict(src=str(src), to="mla", kv_rank=R, rope_dim=ROPE, engine=["transformers"], calib_tokens=64, seq_len=32,
                calib_dataset="pydoc")
    # convert.run.apply's contract: verify is any callable taking the staged folder (no keyword arguments added)
    seen: list = []
    apply(plan(ConvertOptions(**opts)), tmp_path / "out", verify=seen.append)
    assert len(seen) == 1 and ".kvtool-tmp-" in seen[0].name and (tmp_path / "out" / "config.json").exists()
    # --engine transformers==4.40.0: the output is linted for that release, which has no deepseek_v3 (KV010)
    capsys.readouterr()
    rc = main(["convert", str(src), str(tmp_path / "old"), "--to", "mla", "--kv-rank", str(R), "--rope-dim", str(ROPE),
               "--engine", "transformers==4.40.0", "--calib-tokens", "64", "--seq-len", "32", "--calib-dataset",
               "pydoc", "--no-eval", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "kvtool's own checks refuse the output" in err and "KV010" in err, err
    assert not (tmp_path / "old").exists()
