"""`kvtool eval --kv-cache-dtype D` for every dtype of kvtool/model/kv_emulations.json, on the tiny random llama:
it runs, the report names the dtype and what the emulation is, and the refusals (attention kind, --fp8-attention)
are one line each."""

from __future__ import annotations

import json
import shutil

import pytest

from kvtool.cli import main
from kvtool.errors import UsageError
from kvtool.model import kv_dtypes, kv_emulations

from eval_helpers import DEVICE

FAST = ["--max-length", "64", "--stride", "32", "--max-tokens", "160", "--device", DEVICE, "--dtype", "fp32"]


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def _servable(name: str) -> bool:
    return "standard" in kv_dtypes.get(name).attention and kv_dtypes.get(name).slot_problem(8, 8) is None


@pytest.mark.torch
@pytest.mark.parametrize("name", [n for n in kv_emulations.names()])
def test_every_row_runs_and_the_report_says_what_was_emulated(tiny_llama_path, name, capsys):
    p = str(tiny_llama_path)
    if not _servable(name):  # the tiny llama's head_dim 8: a packing that refuses it is refused, not emulated
        with pytest.raises(UsageError):
            from kvtool.eval.api import refuse_unserved

            refuse_unserved(p, name)
        return
    rc = main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", name, "--format", "json"])
    d = _json(capsys)
    row = kv_emulations.get(name)
    assert rc in (0, 1)
    assert d["kv_cache_dtype"] == (row.alias_of or name)
    kv = d["kv_cache"]
    assert kv["dtype"] == (row.alias_of or name) and kv["codec"] == row.codec and kv["match"] == row.match
    assert kv["reads"] == "K/V read back from the cache for every token, as decoding reads them"
    assert (kv["assumption"] is None) == (row.match == "exact")
    if len(kv["kept_layers"]) < 2:  # the cache changed what the model computes
        assert d["kld_mean"] > 0
    else:  # TurboQuant / UltraQuant keep the first and last layer of a 2-layer model: nothing is quantized
        assert kv["kept_layers"] == [0, 1] and d["kld_mean"] == 0
    main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", name])
    out = capsys.readouterr().out
    assert f"kv cache  {row.alias_of or name} emulated by the {row.codec} codec" in out
    assert "kv cache  K/V read back from the cache for every token, as decoding reads them; match to vLLM " \
           f"{row.match}" in out


@pytest.mark.torch
def test_e5m2_costs_more_than_e4m3_on_the_same_model(tiny_llama_path, capsys):
    """e5m2 keeps 2 mantissa bits where e4m3 keeps 3: at scale 1.0 on small K/V it loses more (measured)."""
    p = str(tiny_llama_path)
    kld = {}
    for name in ("fp8_e4m3", "fp8_e5m2"):
        main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", name, "--format", "json"])
        kld[name] = _json(capsys)["kld_mean"]
    assert kld["fp8_e5m2"] > kld["fp8_e4m3"] > 0


@pytest.mark.torch
def test_e5m2_with_the_cpu_build_truncates_and_the_report_says_so(tiny_llama_path, capsys):
    """fp8_e5m2 --fp8-attention cpu: K/V in e5m2 truncated toward zero (vLLM's CPU build), which loses more than
    the GPU writers' round to nearest (cache-only) on the same model; the report names the format and rounding."""
    p = str(tiny_llama_path)
    kld = {}
    for fa in ("cache-only", "cpu"):
        assert main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", "fp8_e5m2", "--fp8-attention", fa,
                     "--max-ppl-increase", "off", "--format", "json"]) == 0
        d = _json(capsys)
        kld[fa] = d["kld_mean"]
        assert d["kv_cache"]["dtype"] == "fp8_e5m2"
    assert d["fp8_attention"]["kv_format"] == "float8_e5m2" and d["fp8_attention"]["kv_rounding"] == "toward-zero"
    assert kld["cpu"] > kld["cache-only"] > 0
    assert main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", "fp8_e5m2", "--fp8-attention", "cpu",
                 "--max-ppl-increase", "off"]) == 0
    assert "K/V float8_e5m2 rounded toward-zero, queries model dtype" in capsys.readouterr().out


@pytest.mark.torch
def test_fp8_attention_goes_with_the_rows_that_name_it_only(tiny_llama_path, capsys):
    """triton rounds queries and probabilities to e4m3: the e4m3 rows only; fp8_e5m2 takes cache-only and cpu."""
    p = str(tiny_llama_path)
    rc = main(["eval", p, *FAST, "--kv-cache-dtype", "fp8_e5m2", "--fp8-attention", "triton"])
    err = capsys.readouterr().err.strip().splitlines()
    with_it = ", ".join(n for n, r in kv_emulations.table().items() if kv_emulations.takes_fp8_attention(r, "triton"))
    assert "fp8_e5m2" not in with_it and "fp8_e4m3" in with_it
    assert rc == 2 and err == [f"kvtool: error: --fp8-attention: triton is emulated with an {with_it} KV cache only; "
                               "not with kv_cache_dtype fp8_e5m2"]


def test_a_dtype_the_attention_kind_cannot_be_served_with_is_refused_in_one_line(tmp_path, capsys):
    """fp8_e5m2 has no sparse-MLA backend in vLLM 0.33 (kv_dtypes.json attention): refused before anything loads."""
    assert "mla_sparse" not in kv_dtypes.get("fp8_e5m2").attention
    cfg = {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "hidden_size": 64,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
           "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "index_topk": 8,
           "vocab_size": 100, "intermediate_size": 64, "moe_intermediate_size": 16, "torch_dtype": "bfloat16"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    from kvtool.eval.api import refuse_unserved

    with pytest.raises(UsageError) as exc:
        refuse_unserved(str(tmp_path), "fp8_e5m2")
    assert exc.value.option == "kv_cache_dtype"
    assert "has no attention backend that stores fp8_e5m2 for sparse MLA" in exc.value.message
    refuse_unserved(str(tmp_path), "fp8_e4m3")  # served on sparse MLA: no refusal here


@pytest.mark.torch
def test_a_refused_dtype_is_one_line_from_the_command(tiny_deepseek_path, tmp_path, capsys):
    folder = tmp_path / "sparse"
    shutil.copytree(tiny_deepseek_path, folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["index_topk"] = 8
    (folder / "config.json").write_text(json.dumps(cfg))
    rc = main(["eval", str(folder), *FAST, "--kv-cache-dtype", "fp8_e5m2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("kvtool: error: --kv-cache-dtype: vLLM 0.33.0 has no "
                                                          "attention backend that stores fp8_e5m2 for sparse MLA")
    rc = main(["eval", str(tiny_deepseek_path), *FAST, "--kv-cache-dtype", "int8_per_token_head"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["kvtool: error: --kv-cache-dtype: vLLM 0.33.0 has no attention backend that stores "
                               "int8_per_token_head for MLA; int8_per_token_head serves MHA / GQA / MQA attention"]


@pytest.mark.torch
def test_mla_latent_in_e5m2(tiny_deepseek_path, capsys):
    """MLA serves fp8_e5m2 (kv_dtypes.json): the latent cache rounds through e5m2, costing more than e4m3."""
    p = str(tiny_deepseek_path)
    kld = {}
    for name in ("fp8_e4m3", "fp8_e5m2"):
        assert main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", name, "--format", "json"]) in (0, 1)
        d = _json(capsys)
        assert d["kv_cache"]["dtype"] == name
        kld[name] = d["kld_mean"]
    assert kld["fp8_e5m2"] > kld["fp8_e4m3"] > 0


def test_a_row_served_on_one_platform_only_is_emulated_with_a_note():
    """Decided: a ROCm-only dtype (kv_dtypes.json platform, the Octave presets) is emulated, and the report says
    where vLLM serves it."""
    import dataclasses

    from kvtool.eval.api import kv_cache_info

    platformed = [n for n, r in kv_dtypes.table().items() if r.platform and "ROCm" in r.platform]
    assert platformed
    row = dataclasses.replace(kv_emulations.get("fp8_e5m2"), name=platformed[0])
    info = kv_cache_info(row, {"source": "one", "layers": 0}, "per tensor")
    assert info["note"] == (f"vLLM {kv_dtypes.release()} serves {platformed[0]} on one platform only: "
                            f"{kv_dtypes.get(platformed[0]).platform}")
    assert kv_cache_info(kv_emulations.get("fp8_e5m2"), {"source": "one", "layers": 0}, "per tensor")["note"] is None


@pytest.fixture(scope="module")
def deeper_llama(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    """A 6-layer random llama with head_dim 64 (2 heads, 1 KV head): every packed dtype can store it, and the
    TurboQuant / UltraQuant boundary layers (0, 1, 4, 5) leave two layers quantized."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from eval_helpers import copy_tokenizer

    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("deep") / "llama6"
    cfg = LlamaConfig(vocab_size=len(smollm2_tokenizer), hidden_size=128, intermediate_size=128,
                      num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).save_pretrained(folder)
    copy_tokenizer(smollm2_path, folder)
    return str(folder)


@pytest.mark.torch
def test_turboquant_runs_end_to_end_with_its_boundary_layers(deeper_llama, capsys):
    """`kvtool eval --kv-cache-dtype` with each TurboQuant preset on a 6-layer model: vLLM keeps layers 0, 1, 4
    and 5 in the model dtype, the two between go through the codec; the KLD to the unquantized model grows as
    the presets lose bits (measured)."""
    kld = {}
    for name in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_3bit_nc"):
        rc = main(["eval", deeper_llama, "--baseline", deeper_llama, *FAST, "--kv-cache-dtype", name,
                   "--format", "json"])
        d = _json(capsys)
        assert rc in (0, 1)
        assert d["kv_cache"]["kept_layers"] == [0, 1, 4, 5] and d["kv_cache"]["codec"] == "turboquant"
        kld[name] = d["kld_mean"]
    assert 0 < kld["turboquant_k8v4"] < kld["turboquant_4bit_nc"] < kld["turboquant_3bit_nc"], kld


@pytest.mark.torch
@pytest.mark.parametrize("name, kept", [("ultraquant_4bit", [0, 1, 4, 5]), ("octave_k3v4", [])])
def test_ultraquant_and_octave_run_end_to_end(deeper_llama, name, kept, capsys):
    """head_dim 64 fits UltraQuant's 32-value groups and Octave's 64-dim blocks: each runs end to end; vLLM keeps
    boundary layers for UltraQuant (engine/arg_utils.py, as for TurboQuant), none for Octave."""
    rc = main(["eval", deeper_llama, "--baseline", deeper_llama, *FAST, "--kv-cache-dtype", name, "--format", "json"])
    d = _json(capsys)
    assert rc in (0, 1)
    assert d["kv_cache"]["kept_layers"] == kept and d["kld_mean"] > 0


@pytest.mark.torch
def test_fewer_bits_cost_more_on_the_same_model(tiny_llama_path, capsys):
    """Measured on the tiny random llama, each dtype against the model itself: int4 per token-head loses more than
    int8 per token-head (KLD and the PPL ratio's distance from 1), and int8 with a scale per token and head less
    than fp8 e4m3 at vLLM's default scale 1.0."""
    p = str(tiny_llama_path)
    got = {}
    for name in ("int8_per_token_head", "int4_per_token_head", "fp8_e4m3"):
        main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", name, "--format", "json"])
        d = _json(capsys)
        assert d["kv_cache"]["scales"] == kv_emulations.get(name).scales
        got[name] = (d["kld_mean"], abs(d["ppl_ratio"] - 1))
    assert got["int4_per_token_head"][0] > got["int8_per_token_head"][0] > 0
    assert got["int4_per_token_head"][1] > got["int8_per_token_head"][1]
    assert got["fp8_e4m3"][0] > got["int8_per_token_head"][0]


@pytest.mark.torch
def test_per_head_scales_reach_the_rows_that_load_them_and_the_report_says_so(tiny_llama_path):
    """Per-head (attn_head) k/v scales, shape [kv_heads], go into fp8 rows per head and the report says "per head";
    a per-token-head row ignores them (its result is the same with and without)."""
    from kvtool.eval.api import Candidate, evaluate_many

    p = str(tiny_llama_path)
    per_head = {0: ([0.01, 0.5], [0.02, 0.4]), 1: ([0.03, 0.3], [0.05, 0.2])}
    rows = evaluate_many([Candidate(p, "fp8_e5m2", per_head), Candidate(p, "fp8_e5m2", "one"),
                          Candidate(p, "int8_per_token_head", per_head), Candidate(p, "int8_per_token_head", "one")],
                         p, max_length=64, stride=32, max_tokens=160, device=DEVICE, dtype="fp32")
    given, one, pth_given, pth_one = rows
    assert given.kv_cache["scales_used"] == "given (per head)" and one.kv_cache["scales_used"] == "one (per tensor)"
    assert given.kld_mean != one.kld_mean  # the per-head scales were applied
    assert pth_given.kv_cache["scales_used"] == kv_emulations.SCALES_WORDS["ignored"]
    assert pth_given.kld_mean == pth_one.kld_mean
