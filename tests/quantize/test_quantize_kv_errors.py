"""quantize-kv refuses bad input with one line and exit 2, before loading any model, writing nothing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvtool.cli import main
from tests.conftest import write_config, write_safetensors


@pytest.fixture
def tiny(tmp_path, tiny_llama_config):
    src = tmp_path / "src"
    write_config(src, tiny_llama_config)
    write_safetensors(src / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32)})
    text = tmp_path / "calib.txt"
    text.write_text("some calibration text " * 50)
    return src, text


def _run(capsys, *args) -> tuple[int, str]:
    rc = main(["quantize-kv", *map(str, args)])
    err = capsys.readouterr().err
    return rc, err


def test_missing_calibration_file(capsys, tiny, tmp_path):
    src, _ = tiny
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", tmp_path / "nope.txt", "--no-eval")
    assert rc == 2 and "nope.txt" in err and "--calib-text" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("opt, value, field", [
    ("--observer", "minmax", "--observer"),
    ("--observer", "percentile:101", "--observer"),
    ("--strategy", "channel", "--strategy"),
    ("--format", "e3m4", "--format"),
    ("--seq-len", "1", "--seq-len"),
    ("--calib-tokens", "3", "--calib-tokens"),
])
def test_bad_options(capsys, tiny, tmp_path, opt, value, field):
    src, text = tiny
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", text, opt, value)
    assert rc == 2 and field in err and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("extra, field, words", [
    (("--strategy", "attn_head"), "--strategy", "one scale per layer"),
    (("--observer", "mse"), "--observer", "rounds candidates through an FP8 cache"),
    (("--observer", "attn-out"), "--observer", "rounds candidates through an FP8 cache"),
])
def test_nvfp4_refuses_per_head_scales_and_fp8_rounding_observers(capsys, tiny, tmp_path, extra, field, words):
    """vLLM's NVFP4 stores read one global scale per layer; mse / attn-out try candidates through an FP8 cache."""
    src, text = tiny
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", text, "--format", "nvfp4", *extra)
    assert rc == 2 and field in err and words in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_nvfp4_refuses_a_head_size_vllm_does_not_serve_it_at(capsys, tiny, tmp_path, tiny_llama_config):
    src, text = tiny
    assert tiny_llama_config["hidden_size"] // tiny_llama_config["num_attention_heads"] not in (64, 128, 256, 512)
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", text, "--format", "nvfp4")
    assert rc == 2 and "head_dim" in err and "FlashInfer" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_missing_source(capsys, tiny, tmp_path):
    _, text = tiny
    rc, err = _run(capsys, tmp_path / "absent", tmp_path / "out", "--calib-text", text)
    assert rc == 2 and "absent" in err


def test_refuses_a_gptq_checkpoint_naming_the_field(capsys, tiny, tmp_path, tiny_llama_config):
    src, text = tiny
    write_config(src, dict(tiny_llama_config, quantization_config={"quant_method": "gptq", "bits": 4}))
    before = (src / "config.json").read_text()
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", text)
    assert rc == 2 and "quantization_config.quant_method" in err and "gptq" in err
    assert (src / "config.json").read_text() == before
    assert not (tmp_path / "out").exists()


def test_refuses_a_checkpoint_that_already_has_kv_scales(capsys, tiny, tmp_path):
    src, text = tiny
    write_safetensors(src / "model.safetensors", {"model.embed_tokens.weight": np.zeros((128, 64), np.float32),
                                                  "model.layers.0.self_attn.k_proj.k_scale": np.ones((1,), np.float32)})
    rc, err = _run(capsys, src, tmp_path / "out", "--calib-text", text)
    assert rc == 2 and "k_proj.k_scale" in err and "already carries" in err


def test_refuses_a_non_empty_destination_without_force(capsys, tiny, tmp_path):
    src, text = tiny
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    rc, err = _run(capsys, src, out, "--calib-text", text)
    assert rc == 2 and "--force" in err
    assert (out / "keep.txt").read_text() == "mine"


def test_refuses_writing_into_the_source(capsys, tiny):
    src, text = tiny
    rc, err = _run(capsys, src, src, "--calib-text", text, "--force")
    assert rc == 2 and "input checkpoint" in err
    assert json.loads((src / "config.json").read_text())["model_type"] == "llama"


def test_a_failure_while_writing_leaves_no_destination_and_the_source_intact(tiny, tmp_path, monkeypatch):
    import errno

    import torch

    import kvtool.quantize.write as write_mod
    from kvtool.errors import InputError
    from kvtool.io.staging import staged_output
    from kvtool.quantize.write import write_output

    src, _ = tiny
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    real = write_mod.write_new

    def full_disk(path, data):
        if path.name == write_mod.SCALE_SHARD:  # the scale shard: after the source shards were copied
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(write_mod, "write_new", full_disk)
    dst = tmp_path / "out"
    with pytest.raises(InputError) as e:
        with staged_output(dst, protect=[src], verify=None) as tmp:
            write_output(src, tmp, config={"model_type": "llama"}, provenance={}, metadata={},
                         scales={"model.layers.0.self_attn.k_scale": torch.ones(1)})
    assert "no space left" in e.value.message
    assert not dst.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []  # staging folder removed
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


@pytest.mark.parametrize("link", [False, True], ids=["copy", "link"])
def test_write_output_maps_every_tensor_and_copies_or_links_the_shards(tiny, tmp_path, link):
    import torch
    from safetensors import safe_open

    from kvtool.io.staging import staged_output
    from kvtool.quantize.write import SCALE_SHARD, write_output

    src, _ = tiny
    dst = tmp_path / "out"
    with staged_output(dst, protect=[src], verify=None) as tmp:
        summary = write_output(src, tmp, config={"model_type": "llama"}, provenance={"command": "quantize-kv"},
                               metadata={"kvtool.kv_scale_point": "post_rope"},
                               scales={"model.layers.0.self_attn.k_scale": torch.full((1,), 0.5),
                                       "model.layers.0.self_attn.v_scale": torch.full((2, 1, 1), 0.25)},
                               link=link)
    same_inode = (dst / "model.safetensors").stat().st_ino == (src / "model.safetensors").stat().st_ino
    if link:
        assert summary.linked == ["model.safetensors"] and summary.copied == [] and same_inode
    else:
        assert summary.copied == ["model.safetensors"] and summary.linked == [] and not same_inode
    assert (dst / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    index = json.loads((dst / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == {"model.embed_tokens.weight": "model.safetensors",
                                   "model.layers.0.self_attn.k_scale": SCALE_SHARD,
                                   "model.layers.0.self_attn.v_scale": SCALE_SHARD}
    assert index["metadata"]["total_size"] == 128 * 64 * 4 + 4 + 8
    with safe_open(str(dst / SCALE_SHARD), framework="pt") as f:
        assert f.metadata()["kvtool.kv_scale_point"] == "post_rope"
        assert f.get_tensor("model.layers.0.self_attn.v_scale").shape == (2, 1, 1)
    from kvtool.engines.compat import read_as_written

    assert json.loads((dst / "kvtool.json").read_text()) == {  # the provenance, and which releases read the config
        "command": "quantize-kv", "engines_read_as_written": read_as_written({"model_type": "llama"})}
    # a plain llama config is read as written by every release line kvtool knows (schemas/engines/releases.json)
    from kvtool.model.engine_tables import known as releases

    known = {e: releases(e) for e in ("transformers", "vllm")}
    minor = lambda v: ".".join(v.split(".")[:2])  # noqa: E731
    assert json.loads((dst / "kvtool.json").read_text())["engines_read_as_written"] == {
        e: f"{minor(known[e][0])}-{minor(known[e][-1])}" for e in ("transformers", "vllm")}


@pytest.mark.parametrize("args, needle", [
    (["--calib-dataset", "wikitext9"], "--calib-dataset: unknown dataset 'wikitext9'"),
    (["--calib-dataset", "pydoc", "--calib-text", "{text}"], "--calib-dataset: give --calib-text or --calib-dataset, not both"),
])
def test_calibration_source_refusals(capsys, tiny, tmp_path, args, needle):
    src, text = tiny
    rc, err = _run(capsys, src, tmp_path / "out", *[a.format(text=text) for a in args])
    assert rc == 2 and needle in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()


def test_calibration_text_is_optional(tmp_path):
    """No --calib-text: the built-in pydoc text (the README's `kvtool quantize-kv smollm2 smol-fp8`)."""
    from kvtool.quantize.run import QuantizeOptions, check_options

    opts = QuantizeOptions(src=str(tmp_path / "m"), dst=str(tmp_path / "out"))
    check_options(opts)
    assert opts.calib_text == [] and opts.calib_dataset is None


def test_the_declared_strategies_are_the_calibrators():
    from kvtool.options.quantize_kv import STRATEGIES
    from kvtool.quantize.calibrate import STRATEGIES as CALIBRATE_STRATEGIES

    assert STRATEGIES == CALIBRATE_STRATEGIES
