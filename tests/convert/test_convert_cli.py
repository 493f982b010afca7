"""`kvtool convert` end to end on small numpy-written checkpoints: semantics, safety, output format."""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest

from kvtool.cli import main
from tests.conftest import write_config, write_safetensors

torch = pytest.importorskip("torch")


def llama(folder: Path, *, heads=8, kv=8, hd=8, layers=2, extra_config=None, shards=1, dtype=np.float32) -> Path:
    """A llama checkpoint with random weights written by numpy (no transformers needed)."""
    hidden = heads * hd
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
           "intermediate_size": 32, "num_hidden_layers": layers, "num_attention_heads": heads,
           "num_key_value_heads": kv, "head_dim": hd, "vocab_size": 64, "max_position_embeddings": 128,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False, "torch_dtype": "float32",
           "my_custom_field": {"kept": [1, 2, 3]}}
    cfg.update(extra_config or {})
    write_config(folder, cfg)
    rng = np.random.default_rng(0)

    def r(*shape):
        return rng.standard_normal(shape).astype(dtype)

    t = {"model.embed_tokens.weight": r(64, hidden), "model.norm.weight": r(hidden), "lm_head.weight": r(64, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}"
        t.update({f"{p}.self_attn.q_proj.weight": r(heads * hd, hidden), f"{p}.self_attn.k_proj.weight": r(kv * hd, hidden),
                  f"{p}.self_attn.v_proj.weight": r(kv * hd, hidden), f"{p}.self_attn.o_proj.weight": r(hidden, heads * hd),
                  f"{p}.mlp.gate_proj.weight": r(32, hidden), f"{p}.mlp.up_proj.weight": r(32, hidden),
                  f"{p}.mlp.down_proj.weight": r(hidden, 32), f"{p}.input_layernorm.weight": r(hidden),
                  f"{p}.post_attention_layernorm.weight": r(hidden)})
    names = list(t)
    if shards == 1:
        write_safetensors(folder / "model.safetensors", t)
    else:
        wm = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: t[n] for n in names[s::shards]}
            write_safetensors(folder / fname, part)
            wm.update({n: fname for n in part})
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    (folder / "tokenizer.json").write_text("{}")
    (folder / "generation_config.json").write_text('{"do_sample": false}')
    return folder


def run(*args) -> int:
    return main(["convert", *map(str, args), "--no-eval", "--no-progress"])


def checksums(folder: Path) -> dict:
    return {p.name: (hashlib.sha256(p.read_bytes()).hexdigest(), p.stat().st_mtime_ns) for p in sorted(folder.iterdir())}


def leftovers(parent: Path) -> list[str]:
    return [p.name for p in parent.iterdir() if ".kvtool-" in p.name]


def load(folder: Path) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


# --- semantics ---------------------------------------------------------------------------------
@pytest.mark.parametrize(("heads", "kv", "target", "hd"), [(8, 8, 4, 8), (8, 4, 2, 8), (6, 3, 1, 8), (8, 2, 1, 4)])
def test_pooling_from_mha_and_existing_gqa_is_the_contiguous_group_mean(tmp_path, heads, kv, target, hd):
    src = llama(tmp_path / "src", heads=heads, kv=kv, hd=hd)
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", target) == 0
    a, b = load(src), load(tmp_path / "out")
    r = kv // target
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            n = f"model.layers.{i}.self_attn.{proj}.weight"
            assert b[n].shape == (target * hd, heads * hd)
            for j in range(target):  # new head j = mean of old heads j*r .. j*r + r - 1
                want = torch.stack([a[n][h * hd:(h + 1) * hd].double() for h in range(j * r, (j + 1) * r)]).mean(0)
                assert torch.equal(b[n][j * hd:(j + 1) * hd], want.float())
    for n in a:
        if "k_proj" not in n and "v_proj" not in n:
            assert torch.equal(a[n], b[n]), n
    cfg = json.loads((tmp_path / "out" / "config.json").read_text())
    assert cfg["num_key_value_heads"] == target


def test_converted_numpy_checkpoint_loads_in_transformers(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    src = llama(tmp_path / "src", heads=6, kv=3)
    assert run(src, tmp_path / "out", "--to", "mqa") == 0
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_key_value_heads == 1
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=torch.tensor([[1, 2, 3]])).logits).all()


def test_config_keeps_order_and_unknown_fields_and_changes_only_kv_heads(tmp_path):
    src = llama(tmp_path / "src")
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", "2") == 0
    before = json.loads((src / "config.json").read_text())
    after = json.loads((tmp_path / "out" / "config.json").read_text())
    assert list(before) == list(after)
    assert {k for k in before if before[k] != after[k]} == {"num_key_value_heads"}
    assert after["my_custom_field"] == {"kept": [1, 2, 3]}


def test_missing_kv_field_is_added(tmp_path):
    src = llama(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    del cfg["num_key_value_heads"]  # MHA by default
    (src / "config.json").write_text(json.dumps(cfg))
    assert run(src, tmp_path / "out", "--to", "mqa") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_key_value_heads"] == 1


def test_dtype_cast_updates_tensors_and_config(tmp_path):
    src = llama(tmp_path / "src", kv=4)
    assert run(src, tmp_path / "out", "--to", "mqa", "--dtype", "bf16") == 0
    out = load(tmp_path / "out")
    assert {t.dtype for t in out.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_bf16_expand_then_pool_is_bit_exact(tmp_path):
    src = llama(tmp_path / "src", kv=2)
    assert run(src, tmp_path / "bf", "--to", "gqa", "--groups", "2", "--dtype", "bf16") == 0
    assert run(tmp_path / "bf", tmp_path / "mha", "--to", "mha") == 0
    assert run(tmp_path / "mha", tmp_path / "back", "--to", "gqa", "--groups", "2") == 0
    a, b = load(tmp_path / "bf"), load(tmp_path / "back")
    assert all(torch.equal(a[n], b[n]) for n in a)


# --- output format and provenance ---------------------------------------------------------------
def test_sharded_input_and_output_with_hf_names_and_index(tmp_path):
    src = llama(tmp_path / "src", shards=3)
    assert run(src, tmp_path / "out", "--to", "mqa", "--max-shard-size", "20KB") == 0
    out = tmp_path / "out"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 1 and files == [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    assert sorted(p.name for p in out.glob("*.safetensors")) == files
    tensors = load(out)
    assert set(index["weight_map"]) == set(tensors) == set(load(src))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    for f in files:
        assert (out / f).stat().st_size <= 20_000 + 4096  # shard limit on data, plus its header


def test_provenance_in_metadata_and_kvtool_json(tmp_path):
    from safetensors import safe_open

    src = llama(tmp_path / "src")
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", "4") == 0
    prov = json.loads((tmp_path / "out" / "kvtool.json").read_text())
    assert prov["method"] == "mean" and prov["from_kv_heads"] == 8 and prov["to_kv_heads"] == 4
    assert prov["source_hash"].startswith("sha256:") and prov["kvtool_version"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), framework="pt") as fh:
        meta = fh.metadata()
    assert meta["format"] == "pt" and meta["kvtool_source_hash"] == prov["source_hash"]
    assert meta["kvtool_method"] == "mean" and meta["kvtool_kv_heads"] == "8->4"
    # side files copied, old weights never
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == ["config.json", "generation_config.json", "kvtool.json", "model.safetensors", "tokenizer.json"]
    # converting the output again records the earlier provenance
    assert run(tmp_path / "out", tmp_path / "out2", "--to", "mqa") == 0
    prov2 = json.loads((tmp_path / "out2" / "kvtool.json").read_text())
    assert prov2["source_provenance"]["source_hash"] == prov["source_hash"]



def test_dry_run_estimate_counts_the_error_grouping(tmp_path, capsys):
    """--grouping error (the aware default) measures candidate groups: the plan's estimate counts their passes."""
    from kvtool.convert.aware.partition import attention_passes
    from kvtool.model import costs

    src = llama(tmp_path / "src", hd=64)
    shape = costs.for_checkpoint(src)
    grouped = {"grouping_passes": attention_passes(8, 4), "grouping_tokens": 1024, "grouping_heads": 8,
               "grouping_groups": 28}
    lines = {costs.convert_aware(shape, 4096, 256, **g).line() for g in ({}, grouped)}
    assert len(lines) == 2  # the grouping shows in the line at this size
    for extra, to, g in (([], ["--to", "gqa", "--groups", "4"], grouped),
                         (["--grouping", "contiguous"], ["--to", "gqa", "--groups", "4"], {}),
                         ([], ["--to", "mqa"], {})):
        assert run(src, tmp_path / "out", *to, "--method", "aware", *extra, "--dry-run") == 0
        est = costs.convert_aware(shape, 4096, 256, **g)
        assert f"  estimate     {est.line()}\n" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()

def test_dry_run_prints_the_plan_and_writes_nothing(tmp_path, capsys):
    src = llama(tmp_path / "src")
    before = checksums(src)
    assert run(src, tmp_path / "out", "--to", "mqa", "--dry-run") == 0
    text = capsys.readouterr().out
    assert "model.layers.{i}.self_attn.k_proj.weight  [64, 64] -> [8, 64]  (x2)" in text
    # fp32 served in 16 bits (vLLM auto, as lint and kv-budget count it): 2 layers x 2 x 8 heads x 8 x 2 B
    assert "KV cache     512 B/token -> 64 B/token  (0.125x)" in text
    assert "num_key_value_heads: 8 -> 1" in text
    from kvtool.model import costs

    est = costs.convert_mean(costs.for_checkpoint(src))
    assert f"  estimate     {est.line()}\n" in text and "at the measured copy speed" in text
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert checksums(src) == before


# --- errors and safety ---------------------------------------------------------------------------
def test_bad_groups_lists_valid_choices(tmp_path, capsys):
    src = llama(tmp_path / "src", heads=8, kv=4)
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", "3") == 2
    err = capsys.readouterr().err
    assert "valid choices: 1, 2, 4, 8" in err and err.count("\n") == 1
    assert run(src, tmp_path / "out", "--to", "gqa") == 2
    assert "--groups" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_non_empty_destination_needs_force(tmp_path, capsys):
    src = llama(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    assert run(src, tmp_path / "out", "--to", "mqa") == 2
    assert "--force" in capsys.readouterr().err
    assert (tmp_path / "out" / "keep.txt").exists()
    assert run(src, tmp_path / "out", "--to", "mqa", "--force") == 0
    assert not (tmp_path / "out" / "keep.txt").exists() and (tmp_path / "out" / "model.safetensors").exists()


def test_source_as_destination_is_refused_even_with_force(tmp_path):
    src = llama(tmp_path / "src")
    before = checksums(src)
    assert run(src, src, "--to", "mqa", "--force") == 2
    assert run(src, tmp_path, "--to", "mqa", "--force") == 2
    assert checksums(src) == before


def test_input_is_never_modified(tmp_path):
    src = llama(tmp_path / "src", shards=2)
    before = checksums(src)
    assert run(src, tmp_path / "out", "--to", "gqa", "--groups", "2", "--dtype", "fp16") == 0
    assert checksums(src) == before


def test_exception_mid_write_leaves_no_destination(tmp_path, monkeypatch, capsys):
    from kvtool.io import writer

    src = llama(tmp_path / "src", layers=3)
    before = checksums(src)
    real_slot, calls = writer.ShardWriter._slot, []

    def failing_slot(self, name):  # every tensor, written from memory or copied, passes here
        calls.append(name)
        if len(calls) == 7:
            raise RuntimeError("simulated crash")
        return real_slot(self, name)

    monkeypatch.setattr(writer.ShardWriter, "_slot", failing_slot)
    assert run(src, tmp_path / "out", "--to", "mqa") == 2
    assert "simulated crash" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []
    assert checksums(src) == before


def test_ctrl_c_mid_write_leaves_no_destination(tmp_path, monkeypatch, capsys):
    from kvtool.io import writer

    src = llama(tmp_path / "src")

    def interrupted(self, name):
        raise KeyboardInterrupt

    monkeypatch.setattr(writer.ShardWriter, "_slot", interrupted)
    assert run(src, tmp_path / "out", "--to", "mqa") == 130
    assert capsys.readouterr().err.splitlines()[-1] == "kvtool: interrupted: nothing was written"
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_disk_full_is_a_clean_error(tmp_path, monkeypatch, capsys):
    src = llama(tmp_path / "src")
    state = {"n": 0}

    def filling(real):
        def call(*args):
            state["n"] += 1
            if state["n"] > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
            return real(*args)
        return call

    monkeypatch.setattr(os, "pwrite", filling(os.pwrite))  # tensors written from memory
    monkeypatch.setattr(os, "copy_file_range", filling(os.copy_file_range))  # tensors copied file to file
    assert run(src, tmp_path / "out", "--to", "mqa") == 2
    err = capsys.readouterr().err
    assert "no space left on device" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


@pytest.mark.parametrize(("model_type", "needle"), [
    ("gpt2", "alternative: gpt_bigcode"), ("gpt_neox", "GPTNeoXAttention"), ("bloom", "BloomAttention"),
    ("mpt", "MptAttention"), ("opt", "OPTAttention"), ("gptj", "GPTJAttention"), ("deepseek_v3", "MLA"),
    ("not_a_model", "no architecture table"),
])
def test_refused_architectures_say_why(tmp_path, capsys, model_type, needle):
    folder = tmp_path / "src"
    write_config(folder, {"model_type": model_type, "num_attention_heads": 4, "num_hidden_layers": 1,
                          "hidden_size": 16, "n_head": 4, "n_layer": 1, "n_embd": 16, "kv_lora_rank": 8})
    write_safetensors(folder / "model.safetensors", {"x": np.zeros(2, np.float32)})
    assert run(folder, tmp_path / "out", "--to", "mqa") == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_falcon_without_new_decoder_architecture_is_refused(tmp_path, capsys):
    folder = tmp_path / "src"
    write_config(folder, {"model_type": "falcon", "num_attention_heads": 4, "num_hidden_layers": 1, "hidden_size": 16,
                          "multi_query": True, "new_decoder_architecture": False})
    write_safetensors(folder / "model.safetensors", {"x": np.zeros(2, np.float32)})
    assert run(folder, tmp_path / "out", "--to", "mha") == 2
    assert "new_decoder_architecture" in capsys.readouterr().err


@pytest.mark.parametrize("qk_layernorm, refused", [(True, True), (False, False)])
def test_per_head_k_norms_without_table_names_are_refused(tmp_path, capsys, qk_layernorm, refused):
    """stablelm's optional per-head q/k LayerNorms are one module per head, not a weight the table names:
    pooling K without them would leave norms for the old head count, so convert refuses (by the config flag)."""
    folder = tmp_path / "src"
    write_config(folder, {"model_type": "stablelm", "num_attention_heads": 4, "num_key_value_heads": 4,
                          "num_hidden_layers": 1, "hidden_size": 16, "qk_layernorm": qk_layernorm})
    write_safetensors(folder / "model.safetensors", {"x": np.zeros(2, np.float32)})
    rc = run(folder, tmp_path / "out", "--to", "mqa", "--dry-run")
    err = capsys.readouterr().err
    if refused:
        assert rc == 2 and "qk_layernorm: true" in err and err.count("\n") == 1
    else:
        assert "qk_layernorm" not in err


def test_unknown_method_and_missing_tensor(tmp_path, capsys):
    src = llama(tmp_path / "src")
    assert run(src, tmp_path / "out", "--to", "mqa", "--method", "nope") == 2
    assert "--method: must be one of aware, mean, got 'nope'" in capsys.readouterr().err
    from safetensors.torch import load_file, save_file

    t = load_file(src / "model.safetensors")
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, src / "model.safetensors")
    assert run(src, tmp_path / "out", "--to", "mqa") == 2
    assert "model.layers.1.self_attn.k_proj.weight" in capsys.readouterr().err


def test_eval_flag_reports_clearly_when_unavailable_or_runs(tmp_path, capsys, monkeypatch):
    import kvtool.commands.convert as cmd

    def missing():
        from kvtool.errors import UsageError
        raise UsageError("--eval needs kvtool's eval module", field="--eval")

    monkeypatch.setattr(cmd, "_eval_api", missing)
    src = llama(tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "mqa", "--eval", "--no-progress"]) == 2
    assert "--eval" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # refused before converting


def test_mean_method_never_imports_torch(tmp_path):
    from kvtest import run_without_torch

    src = llama(tmp_path / "src", kv=4)
    proc = run_without_torch(["convert", src, tmp_path / "out", "--to", "mqa", "--dtype", "bf16", "--no-progress"],
                             cwd=str(tmp_path))
    assert proc.returncode == 0, proc.stderr


def test_torch_methods_get_torch_tensors_and_give_the_same_result(tmp_path):
    """The torch path (used by methods that compute with torch, e.g. the calibrated one) agrees with numpy."""
    from kvtool.convert import methods
    from kvtool.convert.pooling import mean_pool

    seen = []

    @methods.register_method("torch-mean-for-test")
    class TorchMean(methods.MergeMethod):
        def merge_layer(self, layer, w):
            seen.append(type(w.k).__module__)
            return mean_pool(w)

    try:
        src = llama(tmp_path / "src", kv=4, dtype=np.float32)
        assert run(src, tmp_path / "a", "--to", "gqa", "--groups", "2", "--method", "torch-mean-for-test", "--dtype", "bf16") == 0
        assert run(src, tmp_path / "b", "--to", "gqa", "--groups", "2", "--dtype", "bf16") == 0
    finally:
        methods.METHODS.remove("torch-mean-for-test")
    assert seen and set(seen) == {"torch"}
    a, b = load(tmp_path / "a"), load(tmp_path / "b")
    assert all(a[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]) for n in a)


def test_progress_bar_shows_bytes_and_tensors_on_stderr(tmp_path, capsys):
    src = llama(tmp_path / "src")
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "mqa", "--no-eval", "--progress"]) == 0
    err = capsys.readouterr().err
    final = err.strip().splitlines()[-1]  # stderr is not a terminal here: plain lines (kvtool.progress)
    assert final.startswith("convert  ") and "  100%" in final and "(21/21 tensors)" in final
