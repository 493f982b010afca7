"""`kvtool convert --to mla` planning, from config and headers only: the dimensions each option gives, the KV
bytes before and after, the backends, and every refusal (one line, exit 2, nothing written)."""

from __future__ import annotations

import numpy as np
import pytest

from kvtest import write_checkpoint
from kvtool.cli import main
from kvtool.convert.defaults import MLA_SOLVE

SMOL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2, "hidden_size": 576,
        "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 64, "vocab_size": 128,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "torch_dtype": "bfloat16",
        "tie_word_embeddings": True, "hidden_act": "silu", "rms_norm_eps": 1e-5}
EMBED = {"model.embed_tokens.weight": np.zeros((128, 576), "float16")}


def folder(tmp_path, config=SMOL, extra=None, shaped=True, name="m"):
    return write_checkpoint(tmp_path / name, config, shaped=shaped, extra={**EMBED, **(extra or {})})


def plan_of(path, **kw):
    from kvtool.convert.run import plan
    from kvtool.options.convert import ConvertOptions

    return plan(ConvertOptions(src=str(path), to="mla", **kw))


def test_kv_budget_fraction_bytes_and_rank_agree(tmp_path):
    src = folder(tmp_path)
    elem, layers, source_dims = 2, 2, 2 * 3 * 64  # bfloat16 cache, 2 layers, K and V of 3 heads of 64
    # a 128-value row no vLLM release serves: written for transformers only (--engine transformers)
    by_fraction = plan_of(src, kv_budget="33.34%", mla_solve="joint", engine="transformers")  # rope head_dim / 2
    by_bytes = plan_of(src, kv_budget=f"{layers * 128 * elem}B", mla_solve="joint", engine="transformers")
    by_rank = plan_of(src, kv_rank=96, rope_dim=32, engine="transformers")
    for p in (by_fraction, by_bytes, by_rank):
        s = p.shape
        assert (s.kv_lora_rank, s.qk_rope_head_dim, s.qk_nope_head_dim, s.v_head_dim) == (96, 32, 32, 64)
        assert p.kv_bytes_before == layers * source_dims * elem
        assert p.kv_bytes_after == layers * (96 + 32) * elem
    # the rope part keeps the source's 16 fastest pairs: theta'^(-2i/32) = theta^(-2i/64) for theta' = theta^(32/64)
    assert by_rank.rope_pairs == tuple(range(16))
    assert by_rank.new_config["rope_theta"] == pytest.approx(100000.0 ** 0.5)


def test_rope_over_all_but_one_pair(tmp_path):
    p = plan_of(folder(tmp_path), kv_rank=258, rope_dim=62)  # 320 values
    assert (p.shape.qk_nope_head_dim, p.shape.qk_rope_head_dim, p.shape.v_head_dim) == (2, 62, 64)
    assert p.new_config["rope_theta"] == pytest.approx(100000.0 ** (62 / 64))  # the fastest 31 pairs


def test_mqa_seed_rope_default_is_the_head_less_its_static_pairs(tmp_path):
    # SmolLM2's pairs turn at 1e5^(-p/32) rad per position: 6 turn less than 1 rad over 8192 positions (p >= 26),
    # 12 over 1024 (p >= 20); they go to the latent, the rest stays in the rope key
    p = plan_of(folder(tmp_path), kv_budget="90%", mla_solve="mqa-seed")  # 345 values: the largest servable, 320
    assert (p.shape.kv_lora_rank, p.shape.qk_rope_head_dim, p.shape.qk_nope_head_dim) == (268, 52, 12)
    assert plan_of(folder(tmp_path), kv_rank=280, serve_context=1024, mla_solve="mqa-seed").shape.qk_rope_head_dim == 40
    assert plan_of(folder(tmp_path), kv_rank=288, mla_solve="joint").shape.qk_rope_head_dim == 32


def test_write_plan_replaces_attention_and_unties_lm_head(tmp_path):
    p = plan_of(folder(tmp_path), kv_rank=288, mla_solve="joint")
    names = [t.name for t in p.outputs]
    assert not any(n.endswith(("k_proj.weight", "v_proj.weight")) for n in names)
    for i in range(2):
        for m in ("q_proj", "kv_a_proj_with_mqa", "kv_a_layernorm", "kv_b_proj", "o_proj"):
            assert f"model.layers.{i}.self_attn.{m}.weight" in names
    shapes = {t.name: t.shape for t in p.outputs}
    assert shapes["model.layers.0.self_attn.kv_b_proj.weight"] == (9 * (32 + 64), 288)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (9 * (32 + 32), 576)
    assert names[-1] == "lm_head.weight" and p.copies == {"lm_head.weight": "model.embed_tokens.weight"}
    cfg = p.new_config
    assert (cfg["model_type"], cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["first_k_dense_replace"],
            cfg["tie_word_embeddings"], cfg["rope_parameters"]["rope_type"]) == ("deepseek_v3", 288, 32, 2, False,
                                                                                  "default")


def test_qkv_biases_go_to_the_solve(tmp_path):
    qwen2 = {**SMOL, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}
    biases = {f"model.layers.{i}.self_attn.{m}.bias": np.zeros((n,), "float16")
              for i in range(2) for m, n in (("q_proj", 576), ("k_proj", 192), ("v_proj", 192))}
    p = plan_of(folder(tmp_path, qwen2, biases), kv_rank=268)
    assert sorted(p.layers[0]) == ["k_proj.bias", "k_proj.weight", "o_proj.weight", "q_proj.bias", "q_proj.weight",
                                   "v_proj.bias", "v_proj.weight"]
    assert not any(t.name.endswith(".bias") for t in p.outputs)  # DeepSeek's layout has none


def test_dry_run_shows_kv_bytes_backends_and_estimate(tmp_path, capsys):
    assert main(["convert", str(folder(tmp_path)), "--to", "mla", "--kv-budget", "90%", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "KV cache     1.50 KiB/token -> 1.25 KiB/token  (0.833x)" in out  # 320 of 384 values
    assert "backends     vLLM 0.33.0: TRITON_MLA (any GPU), FLASH_ATTN_MLA (Hopper), ROCM_AITER_MLA (ROCm)" in out
    assert "not FLASH_ATTN_MLA on Intel XPU, CPU_MLA, AMX_MLA (row 320 is not 576)" in out
    assert "estimate     ~" in out
    assert f"method       solved per layer ({MLA_SOLVE}) from 4096 calibration tokens" in out
    assert not (tmp_path / "dst").exists()


def test_preset_on_a_model_where_576_dims_save(tmp_path, capsys):
    big = {**SMOL, "hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8}  # Llama-3-8B's heads
    src = folder(tmp_path, big, shaped=False, extra={"model.embed_tokens.weight": np.zeros((128, 4096), "float16")})
    p = plan_of(src, preset="flashmla")
    assert (p.shape.kv_lora_rank, p.shape.qk_rope_head_dim, p.shape.qk_nope_head_dim) == (512, 64, 64)
    assert p.kv_bytes_after / p.kv_bytes_before == 576 / 2048
    from kvtool.engines import mla

    common = mla.rows("0.33.0").head_sizes
    assert {b.name for b in mla.backends("0.33.0") if b.refusal(p.shape, common) is None} == {
        "TRITON_MLA", "FLASHMLA", "CUTLASS_MLA", "FLASHINFER_MLA", "FLASH_ATTN_MLA", "ROCM_AITER_MLA",
        "AITER_TRITON_MLA", "CPU_MLA", "AMX_MLA"}  # not TOKENSPEED_MLA: it takes DeepSeek-R1's qk_nope_head_dim 128
    assert p.engine == "0.33.0" and not p.warnings[1:]


def refused(capsys, argv) -> str:
    assert main(["convert", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvtool: error: "), err
    return err[0]


@pytest.mark.parametrize("args, words", [
    (["--to", "mla"], "--kv-rank: --to mla needs the latent size"),
    (["--to", "gqa", "--groups", "1", "--kv-rank", "8"], "--kv-rank: only --to mla takes it"),
    (["--to", "mla", "--kv-rank", "8", "--kv-budget", "50%"], "give one of --kv-rank, --kv-budget, --preset"),
    (["--to", "mla", "--kv-rank", "8", "--rope-dim", "7"], "--rope-dim: 7 must be even, at least 2 and at most head_dim - 2 = 62"),
    (["--to", "mla", "--kv-rank", "8", "--rope-dim", "66"], "--rope-dim: 66 must be even, at least 2 and at most head_dim - 2"),
    (["--to", "mla", "--kv-rank", "8", "--rope-dim", "64"], "qk_nope_head_dim, the rest of each key head"),
    (["--to", "mla", "--kv-rank", "400"], "cache no less than the source's 384"),
    (["--to", "mla", "--preset", "flashmla"], "--preset: flashmla: 512 latent + 64 rope"),
    (["--to", "mla", "--preset", "flashmla", "--rope-dim", "32"], "--rope-dim: --preset flashmla fixes"),
    (["--to", "mla", "--kv-budget", "3"], "give bytes with a unit (e.g. 3B)"),
    (["--to", "mla", "--kv-budget", "64B", "--engine", "transformers"], "--kv-budget: '64B' gives 16 cached dimensions"),
    (["--to", "mla", "--kv-budget", "64B"], "--kv-budget: '64B' gives 16 cached values per layer (2 layers, 2 bytes "
     "each); vllm 0.33.0 serves MLA rows of 320, 512 or 576 cached values per token and layer (kv_lora_rank + "
     "qk_rope_head_dim): the smallest that saves, 320, needs --kv-budget 1.25KiB"),
    (["--to", "mla", "--kv-rank", "96", "--rope-dim", "32"], "--kv-rank: vllm 0.33.0 serves MLA rows of 320, 512 or "
     "576 cached values per token and layer (kv_lora_rank + qk_rope_head_dim); 96 + 32 = 128 is not one of them: "
     "--kv-rank 288 with 32 rope dimensions writes 320 (--engine transformers writes any size"),
    (["--to", "mla", "--kv-rank", "96", "--rope-dim", "32", "--engine", "vllm==0.17.0"], "--kv-rank: vllm 0.17.0 "
     "serves MLA rows of 576 cached values per token and layer (kv_lora_rank + qk_rope_head_dim); none caches less "
     "than the source's 384"),
    (["--to", "mla", "--kv-rank", "268", "--engine", "vllm==0.7.1"], "--engine: 'vllm==0.7.1': kvtool has not read "
     "which MLA rows vLLM 0.7.1 serves (it has read 0.7.3..0.33.0"),
    (["--to", "mla", "--kv-rank", "268", "--engine", "vllm>=0.30"], "--engine: 'vllm>=0.30' matches 4 releases"),
    (["--to", "mla", "--kv-rank", "268", "--engine", "llama.cpp"], "--engine: 'llama.cpp': unknown engine"),
    (["--to", "gqa", "--groups", "1", "--engine", "vllm==0.33.0"], "--engine: only --to mla takes it"),
    (["--to", "mla", "--kv-budget", "0%"], "must be above 0 and at most 1"),
    (["--to", "mla", "--kv-budget", "lots"], "--kv-budget: must be one of"),
    # the heads targets' options, refused by the --to registry before the model is read (kvtool/convert/targets.py)
    (["--to", "mla", "--kv-rank", "8", "--grouping", "contiguous"],
     "--grouping: only --to gqa, mqa or mha takes it (--to mla solves a latent per layer)"),
    (["--to", "mla", "--kv-rank", "8", "--groups", "2"], "--groups: only --to gqa, mqa or mha takes it"),
    (["--to", "mla", "--kv-rank", "8", "--method-opt", "foo=1"], "--method-opt: only --to gqa, mqa or mha takes it"),
    (["--to", "mla", "--kv-rank", "8", "--method", "first-k"], "--method"),  # no registered method
    (["--to", "mla", "--kv-rank", "8", "--method", "aware"], "--method: --to mla solves each layer from calibration"),
])
def test_option_refusals(tmp_path, capsys, args, words):
    line = refused(capsys, [str(folder(tmp_path)), *args])
    assert words in line, line


def test_a_heads_option_is_refused_before_the_model_is_read(tmp_path, capsys):
    gemma = {**SMOL, "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"}
    line = refused(capsys, [str(folder(tmp_path, gemma)), "--to", "mla", "--kv-rank", "8", "--groups", "2"])
    assert "--groups: only --to gqa, mqa or mha takes it" in line and "model_type" not in line, line


@pytest.mark.parametrize("config, extra, words", [
    ({**SMOL, "model_type": "gemma", "architectures": ["GemmaForCausalLM"], "hidden_act": "gelu"}, None,
     "model_type: --to mla converts llama / mistral / qwen2 blocks"),
    ({**SMOL, "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 4096}, None,
     "sliding_window: sliding-window or non-attention layers"),
    ({**SMOL, "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}, None, "RoPE type 'llama3'"),
    ({**SMOL, "hidden_act": "gelu"}, None, "hidden_act: hidden_act 'gelu': vLLM's DeepseekV2MLP takes silu only"),
    ({**SMOL, "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]},
     {"model.layers.0.self_attn.o_proj.bias": np.zeros((576,), "float16")},
     "model.layers.0.self_attn.o_proj.bias: o_proj bias or q/k norm"),
    (SMOL, {"model.layers.0.pre_feedforward_layernorm.weight": np.zeros((576,), "float16")},
     "model.layers.0.pre_feedforward_layernorm.weight: not a tensor of DeepSeek-V3's dense layer"),
])
def test_source_refusals(tmp_path, capsys, config, extra, words):
    line = refused(capsys, [str(folder(tmp_path, config, extra)), "--to", "mla", "--kv-rank", "8"])
    assert words in line, line


def test_a_recipe_step_plans_mla_and_says_so(tmp_path, capsys):
    src = folder(tmp_path)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("version: 1\nname: t\nsteps:\n  - convert: {to: mla, kv_rank: 288, rope_dim: 32, mla_solve: joint}\n")
    assert main(["apply", str(recipe), str(src), str(tmp_path / "out"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "convert: mla: 3 KV heads -> MLA latent 288 + rope 32 (joint solve, training-free)" in out
    assert "KV heads (mean)" not in out


@pytest.mark.parametrize("theta,horizon", [(100000.0, 8192), (10000.0, 2048), (500000.0, 131072), (1e6, 32768)])
def test_the_default_rope_dims_leave_out_the_pairs_the_seed_keeps_per_head(theta, horizon):
    # the plan counts the pairs in plain floats (no torch); the solve picks them with static_pairs
    from kvtool.convert.defaults import MLA_SOLVES
    from kvtool.convert.mla.plan import default_rope_dim
    from kvtool.convert.mla.rope import SourceRope, static_pairs

    rope = SourceRope(theta=theta, head_dim=64, rotary_dim=64)
    kept = int(static_pairs(rope, horizon, MLA_SOLVES["mqa-seed"]["residual_angle"]).sum())
    assert default_rope_dim("mqa-seed", 64, theta, horizon) == 64 - 2 * kept
    assert default_rope_dim("joint", 64, theta, horizon) == 32


@pytest.mark.parametrize("engine, kwargs", [
    # every requirement the user named is what the output is linted for; KV404 accepted when no vLLM release is named
    (["transformers==4.40.0"], {"engines": ("transformers==4.40.0",), "accept": ("KV404",)}),
    (["transformers"], {"engines": (), "accept": ("KV404",)}),  # a bare name: its default release, as lint
    (["vllm==0.33.0", "transformers==4.40.0"], {"engines": ("vllm==0.33.0", "transformers==4.40.0")}),
])
def test_the_plan_says_what_its_output_check_needs(tmp_path, engine, kwargs):
    p = plan_of(folder(tmp_path), kv_rank=268, engine=engine)  # 268 + 52 rope = 320: a row vLLM 0.33 serves
    assert p.check_kwargs() == kwargs
    default = plan_of(folder(tmp_path), kv_rank=268)  # no --engine: the vLLM release written for, KV404 refused
    assert default.check_kwargs() == {"engines": (f"vllm=={default.engine}",)}


@pytest.mark.parametrize("req", ["transformers>=99", "transformers==0.0.1x"])
def test_a_transformers_release_kvtool_does_not_know_is_refused_when_planning(tmp_path, req):
    from kvtool.errors import UsageError

    with pytest.raises(UsageError) as e:
        plan_of(folder(tmp_path), kv_rank=268, engine=[req])
    assert e.value.option == "engine" and req in str(e.value)


def test_a_heads_target_check_needs_nothing_more(tmp_path):
    from kvtool.convert.run import plan
    from kvtool.options.convert import ConvertOptions

    assert plan(ConvertOptions(src=str(folder(tmp_path)), to="gqa", groups=1)).check_kwargs() == {}


def test_with_no_engine_it_writes_for_the_installed_vllm_as_lint_and_kv_budget_default_to(tmp_path, monkeypatch):
    from kvtool.engines import releases
    from kvtool.errors import UsageError

    monkeypatch.setattr(releases, "installed", lambda engine: "0.30.0" if engine == "vllm" else None)
    p = plan_of(folder(tmp_path), kv_rank=268, rope_dim=52)  # 320: served from 0.30
    assert p.engine == "0.30.0" and p.check_kwargs() == {"engines": ("vllm==0.30.0",)}
    big = {**SMOL, "num_key_value_heads": 9}  # 2 x 9 x 64 = 1152 per layer: 576 saves
    monkeypatch.setattr(releases, "installed", lambda engine: "0.17.1" if engine == "vllm" else None)
    assert plan_of(folder(tmp_path, big, name="big"), kv_rank=524, rope_dim=52).engine == "0.17.1"
    with pytest.raises(UsageError, match="vllm 0.17.1 serves MLA rows of 576"):  # not 0.33's 320
        plan_of(folder(tmp_path), kv_rank=268, rope_dim=52)
    # an installed release kvtool has not read is refused by name, never replaced by another
    monkeypatch.setattr(releases, "installed", lambda engine: "0.7.1" if engine == "vllm" else None)
    with pytest.raises(UsageError, match=r"vLLM 0.7.1 \(installed, the default\): kvtool has not read") as e:
        plan_of(folder(tmp_path), kv_rank=268, rope_dim=52)
    assert e.value.option == "engine"
    # two vLLM releases: refused by name (kvtool.engines.releases.one_release_of)
    monkeypatch.setattr(releases, "installed", lambda engine: None)
    with pytest.raises(UsageError, match="given 2 times"):
        plan_of(folder(tmp_path), kv_rank=268, rope_dim=52, engine=["vllm==0.30.0", "vllm==0.33.0"])
