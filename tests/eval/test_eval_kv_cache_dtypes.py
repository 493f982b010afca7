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
    assert d["kld_mean"] > 0  # the cache changed what the model computes
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
def test_fp8_attention_goes_with_the_e4m3_rows_only(tiny_llama_path, capsys):
    p = str(tiny_llama_path)
    rc = main(["eval", p, *FAST, "--kv-cache-dtype", "fp8_e5m2", "--fp8-attention", "triton"])
    err = capsys.readouterr().err.strip().splitlines()
    with_it = ", ".join(n for n, r in kv_emulations.table().items() if r.fp8_attention)
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
