"""quantize-kv --dry-run: the estimated peak memory and time from the cost model, without torch."""

from __future__ import annotations

import numpy as np

from kvtest import run_without_torch
from kvtool.cli import main
from kvtool.model import costs
from tests.conftest import write_config, write_safetensors


def tiny_model(folder, config, layers=2):
    config = {**config, "num_hidden_layers": layers}
    write_config(folder, config)
    h, kvd = config["hidden_size"], 2 * 16
    t = {"model.embed_tokens.weight": np.zeros((128, h), np.float32), "lm_head.weight": np.zeros((128, h), np.float32)}
    for i in range(layers):
        p = f"model.layers.{i}.self_attn"
        t |= {f"{p}.q_proj.weight": np.zeros((h, h), np.float32), f"{p}.k_proj.weight": np.zeros((kvd, h), np.float32),
              f"{p}.v_proj.weight": np.zeros((kvd, h), np.float32), f"{p}.o_proj.weight": np.zeros((h, h), np.float32)}
    write_safetensors(folder / "model.safetensors", t)
    return folder


def test_dry_run_prints_the_estimate_and_writes_nothing(tmp_path, tiny_llama_config, capsys):
    src = tiny_model(tmp_path / "src", tiny_llama_config)
    assert main(["quantize-kv", str(src), str(tmp_path / "out"), "--dry-run", "--calib-tokens", "512",
                 "--no-eval"]) == 0
    out = capsys.readouterr().out
    shape = costs.for_checkpoint(src)
    assert f"  estimate     {costs.quantize_kv(shape, 512).line()}\n" in out
    assert "512 tokens through 2 layers, one layer at a time\n" in out
    assert not (tmp_path / "out").exists()
    # the quality report (default) adds two evaluations
    assert main(["quantize-kv", str(src), "--dry-run", "--calib-tokens", "512"]) == 0
    assert costs.quantize_kv(shape, 512, 1024).line() in capsys.readouterr().out


def test_dry_run_imports_no_torch_and_dst_is_required_otherwise(tmp_path, tiny_llama_config, capsys):
    src = tiny_model(tmp_path / "src", tiny_llama_config)
    proc = run_without_torch(["quantize-kv", src, "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    assert "estimate     ~" in proc.stdout
    assert main(["quantize-kv", str(src)]) == 2
    assert "DST: missing required argument" in capsys.readouterr().err
