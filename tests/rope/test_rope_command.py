"""`kvtool rope`: writes, layouts, max_position_embeddings rules, refusals, --in-place, --show, --plot."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from kvtest import write_config, write_safetensors

from kvtool.cli import main
from kvtool.rules.runner import lint_one
from kvtool.rules.registry import LintOptions

DATA = Path(__file__).resolve().parents[1] / "data" / "rope"


def real(name: str) -> dict:
    return json.loads((DATA / f"{name}.json").read_text())


def model(tmp_path: Path, config: dict, name: str = "src") -> Path:
    folder = tmp_path / name
    write_config(folder, config)
    write_safetensors(folder / "model.safetensors", {"x": np.zeros((2, 2), dtype=np.float32)})
    (folder / "tokenizer.json").write_text("{}")
    (folder / "sub").mkdir()
    (folder / "sub" / "extra.txt").write_text("kept")
    return folder


def digest(folder: Path) -> dict:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def cfg_of(path: Path) -> dict:
    p = path / "config.json" if path.is_dir() else path
    return json.loads(p.read_text())


def run(*args) -> int:
    return main(["rope", *map(str, args)])


LLAMA = {"model_type": "llama", "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 1000, "max_position_embeddings": 4096, "rope_theta": 10000.0,
         "intermediate_size": 512, "torch_dtype": "float32"}


def test_yarn_both_layouts_copies_weights_and_keeps_input(tmp_path, capsys):
    src = model(tmp_path, LLAMA)
    before = digest(src)
    assert run(src, tmp_path / "dst", "--type", "yarn", "--target-context", 32768) == 0
    out = capsys.readouterr().out
    assert "yarn factor 8" in out and "3 other file(s) copied" in out
    dst = tmp_path / "dst"
    cfg = cfg_of(dst)
    assert cfg["max_position_embeddings"] == 32768
    assert cfg["rope_theta"] == 10000.0
    assert cfg["rope_scaling"] == {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 4096}
    assert cfg["rope_parameters"] == {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                      "original_max_position_embeddings": 4096}
    assert digest(src) == before  # input untouched
    for name in ("model.safetensors", "tokenizer.json", "sub/extra.txt"):
        assert (src / name).read_bytes() == (dst / name).read_bytes()
        assert os.stat(src / name).st_ino != os.stat(dst / name).st_ino  # copies: editing DST leaves SRC alone
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    assert lint_one(str(dst), LintOptions()).failing(strict=True) == []


def test_link_option_hard_links_unchanged_files(tmp_path, capsys):
    src = model(tmp_path, LLAMA)
    assert run(src, tmp_path / "dst", "--type", "linear", "--factor", 2, "--link") == 0
    assert "3 other file(s) hard-linked, 0 copied" in capsys.readouterr().out
    for name in ("model.safetensors", "tokenizer.json", "sub/extra.txt"):
        assert os.stat(src / name).st_ino == os.stat(tmp_path / "dst" / name).st_ino


@pytest.mark.parametrize("rope_type,new_max,extra", [
    ("yarn", 16384, {"original_max_position_embeddings": 4096}),
    ("llama3", 16384, {"original_max_position_embeddings": 4096, "low_freq_factor": 1.0, "high_freq_factor": 4.0}),
    ("linear", 4096, {}),
    ("dynamic", 4096, {}),
])
def test_max_position_rules(tmp_path, rope_type, new_max, extra):
    src = model(tmp_path, LLAMA)
    assert run(src, tmp_path / "o", "--type", rope_type, "--factor", 4) == 0
    cfg = cfg_of(tmp_path / "o")
    assert cfg["max_position_embeddings"] == new_max
    assert cfg["rope_scaling"] == {"rope_type": rope_type, "factor": 4.0, **extra}


def test_legacy_type_key_is_kept_and_agrees(tmp_path):
    cfg = real("minicpm-2b")  # rope_scaling {"type": "dynamic", "factor": 4.0}
    out = tmp_path / "o.json"
    assert run(DATA / "minicpm-2b.json", out, "--type", "yarn", "--factor", 2) == 0
    rs = cfg_of(out)["rope_scaling"]
    assert rs["type"] == rs["rope_type"] == "yarn"
    # linear / dynamic carried the pre-scaling length in max_position_embeddings
    assert rs["original_max_position_embeddings"] == cfg["max_position_embeddings"]


def test_rescaling_same_type_keeps_tuned_knobs(tmp_path):
    out = tmp_path / "o.json"
    assert run(DATA / "gpt-oss-20b.json", out, "--type", "yarn", "--factor", 64) == 0
    cfg = cfg_of(out)
    assert cfg["rope_scaling"]["truncate"] is False and cfg["rope_scaling"]["beta_fast"] == 32.0
    assert cfg["max_position_embeddings"] == 4096 * 64


def test_mla_yarn_keeps_mscale_and_refuses_other_types(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert run(DATA / "deepseek-v3.json", out, "--type", "yarn", "--target-context", 262144) == 0
    rs = cfg_of(out)["rope_scaling"]
    assert rs["mscale_all_dim"] == 1.0 and rs["factor"] == 64.0 and rs["type"] == "yarn"
    assert run(DATA / "deepseek-v3.json", tmp_path / "p.json", "--type", "llama3", "--factor", 2) == 2
    err = capsys.readouterr().err
    assert "multi-head latent attention" in err and "deepseek_yarn" in err and "llama3" in err
    assert not (tmp_path / "p.json").exists()


def test_gemma3_nested_changes_only_the_chosen_layer_type(tmp_path, capsys):
    out = tmp_path / "o.json"
    assert run(DATA / "gemma-3-1b-it.json", out, "--type", "linear", "--factor", 8) == 0
    cfg = cfg_of(out)
    assert cfg["rope_parameters"] == {
        "full_attention": {"rope_type": "linear", "rope_theta": 1000000.0, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}
    assert cfg["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert cfg["rope_local_base_freq"] == 10000
    # the legacy layout cannot scale sliding layers alone
    assert run(DATA / "gemma-3-1b-it.json", tmp_path / "p.json", "--type", "linear", "--factor", 2,
               "--layer-type", "sliding_attention") == 2
    assert "--layout v5" in capsys.readouterr().err
    assert run(DATA / "gemma-3-1b-it.json", tmp_path / "q.json", "--type", "linear", "--factor", 2,
               "--layer-type", "sliding_attention", "--layout", "v5") == 0
    rp = cfg_of(tmp_path / "q.json")["rope_parameters"]
    assert rp["sliding_attention"]["factor"] == 2.0 and rp["full_attention"]["rope_type"] == "default"


def test_layout_v5_only_and_legacy_only(tmp_path):
    src = model(tmp_path, {**LLAMA, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}})
    assert run(src, tmp_path / "v5", "--type", "yarn", "--factor", 2, "--layout", "v5") == 0
    v5 = cfg_of(tmp_path / "v5")
    assert "rope_scaling" not in v5 and "rope_theta" not in v5 and v5["rope_parameters"]["rope_type"] == "yarn"
    assert run(src, tmp_path / "legacy", "--type", "yarn", "--factor", 2, "--layout", "legacy") == 0
    legacy = cfg_of(tmp_path / "legacy")
    assert "rope_parameters" not in legacy and legacy["rope_scaling"]["rope_type"] == "yarn"


def test_longrope_from_factor_files(tmp_path, capsys):
    phi = real("phi-3.5-mini-instruct")
    short, long_ = tmp_path / "short.json", tmp_path / "long.json"
    short.write_text(json.dumps(phi["rope_scaling"]["short_factor"]))
    long_.write_text(json.dumps({"long_factor": phi["rope_scaling"]["long_factor"]}))
    src = model(tmp_path, {**LLAMA, "hidden_size": 96 * 4})  # head_dim 96 as Phi-3.5
    assert run(src, tmp_path / "o", "--type", "longrope", "--factor", 32, "--short-factor-file", short,
               "--long-factor-file", long_) == 0
    rs = cfg_of(tmp_path / "o")["rope_scaling"]
    assert len(rs["short_factor"]) == 48 and rs["original_max_position_embeddings"] == 4096
    assert cfg_of(tmp_path / "o")["max_position_embeddings"] == 131072
    # head_dim 64 needs 32 entries: refused before writing
    src2 = model(tmp_path, LLAMA, name="src2")
    assert run(src2, tmp_path / "p", "--type", "longrope", "--factor", 2, "--short-factor-file", short,
               "--long-factor-file", long_) == 2
    assert "needs 32" in capsys.readouterr().err and not (tmp_path / "p").exists()
    assert run(src2, tmp_path / "p", "--type", "longrope", "--factor", 2) == 2


def test_in_place_writes_a_backup(tmp_path):
    src = model(tmp_path, LLAMA)
    original = (src / "config.json").read_bytes()
    assert run(src, "--in-place", "--type", "llama3", "--factor", 8) == 0
    assert (src / "config.json.bak").read_bytes() == original
    assert cfg_of(src)["rope_scaling"]["rope_type"] == "llama3"
    assert run(src, "--in-place", "--type", "llama3", "--factor", 4) == 0
    assert (src / "config.json.bak.1").exists()
    assert cfg_of(src)["rope_scaling"]["factor"] == 4.0


@pytest.mark.parametrize("args,needle", [
    (["--type", "yarn", "--factor", "0.5"], "--factor: must be at least 1, got 0.5"),
    (["--type", "yarn", "--target-context", "1024"], "below 1"),
    (["--type", "gptj", "--factor", "2"], "--type: must be one of linear, dynamic, yarn, longrope, llama3, got 'gptj'"),
    (["--type", "yarn"], "--factor F or --target-context N"),
    (["--type", "yarn", "--factor", "2", "--target-context", "8192"], "not both"),
    (["--type", "llama3", "--factor", "2", "--beta-fast", "8"], "--beta-fast applies to --type yarn"),
    (["--type", "linear", "--factor", "2", "--layer-type", "sliding_attention"], "no 'sliding_attention' layers"),
    (["--type", "linear", "--factor", "2", "--layer-type", "sliding_attention"], "one RoPE for all layers"),
    (["--type", "llama3", "--factor", "2", "--low-freq-factor", "4", "--high-freq-factor", "1"], "KV208"),
    (["--type", "yarn", "--factor", "2", "--layout", "both3"], "--layout: must be one of both, legacy, v5, got 'both3'"),
])
def test_refusals_exit_2_and_write_nothing(tmp_path, capsys, args, needle):
    # the second --layer-type case runs on a model with sliding layers that share one RoPE (mistral style)
    sliding = needle == "one RoPE for all layers"
    src = model(tmp_path, {**LLAMA, "layer_types": ["sliding_attention", "full_attention"]} if sliding else LLAMA)
    before = digest(src)
    assert run(src, tmp_path / "dst", *args) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "dst").exists() and digest(src) == before


def test_alibi_and_non_rope_models_refused(tmp_path, capsys):
    assert run(DATA / "mpt-7b-shrunk.json", tmp_path / "o.json", "--type", "yarn", "--factor", 2) == 2
    assert "ALiBi" in capsys.readouterr().err
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_embd": 64, "n_head": 4, "n_layer": 2, "n_positions": 1024}))
    assert run(gpt2, tmp_path / "p.json", "--type", "yarn", "--factor", 2) == 2
    assert "not RoPE" in capsys.readouterr().err


def test_destination_rules(tmp_path, capsys):
    src = model(tmp_path, LLAMA)
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("x")
    assert run(src, busy, "--type", "yarn", "--factor", 2) == 2
    assert (busy / "keep.txt").read_text() == "x" and not (busy / "config.json").exists()
    assert run(src, src, "--type", "yarn", "--factor", 2) == 2
    assert run(src, tmp_path / "x", "--in-place", "--type", "yarn", "--factor", 2) == 2
    assert run(src, "--type", "yarn", "--factor", 2) == 2  # nowhere to write and no --show
    capsys.readouterr()


def test_show_current_and_preview(tmp_path, capsys):
    assert run(DATA / "llama-3.1-8b.json", "--show") == 0
    out = capsys.readouterr().out
    assert "llama3 RoPE, theta 500000" in out and "vLLM serves 131072" in out and "wavelength" in out
    src = model(tmp_path, LLAMA)
    assert run(src, "--type", "yarn", "--factor", 4, "--show") == 0
    out = capsys.readouterr().out
    assert "before: default RoPE" in out and "after: yarn RoPE" in out and "stretch" in out
    assert "preview only" in out and "attention scaling 1.1386" in out
    assert cfg_of(src) == LLAMA  # a preview writes nothing
    assert run(DATA / "gemma-3-1b-it.json", "--show") == 0
    out = capsys.readouterr().out
    assert "[full_attention]" in out and "[sliding_attention]" in out and "theta 10000" in out


def test_show_wavelengths_match_the_math(tmp_path, capsys):
    from kvtool.model.rope.freqs import wavelengths
    from kvtool.model.rope.types import Geometry, compute

    assert run(DATA / "llama-2-7b-hf.json", "--show") == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip()[:1].isdigit()]
    rows = [r for r in rows if len(r) == 2]
    assert len(rows) == 16
    want = wavelengths(compute({"rope_type": "default"}, Geometry(dim=128, theta=10000.0))[0])
    for i, wl in rows:
        assert float(wl.replace(",", "")) == pytest.approx(want[int(i)], rel=5e-3)


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "w.png"
    assert run(DATA / "llama-2-7b-hf.json", "--type", "yarn", "--factor", 4, "--plot", png) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert run(DATA / "llama-2-7b-hf.json", "--show", "--plot", tmp_path / "w.png") == 2
    assert "pip install 'kvtool[plot]'" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_rope_command_never_imports_torch_or_transformers(tmp_path):
    code = (
        "import sys\n"
        "from kvtool.cli import main\n"
        f"assert main(['rope', {str(DATA / 'llama-3.1-8b.json')!r}, '--show']) == 0\n"
        f"assert main(['rope', {str(DATA / 'llama-3.1-8b.json')!r}, {str(tmp_path / 'o.json')!r}, '--type', 'yarn',"
        " '--factor', '2']) == 0\n"
        "bad = [m for m in ('torch', 'transformers') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_link_copies_when_hard_links_fail(tmp_path, monkeypatch, capsys):
    src = model(tmp_path, LLAMA)

    def no_links(a, b):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_links)
    assert run(src, tmp_path / "dst", "--type", "linear", "--factor", 2, "--link") == 0
    assert "0 other file(s) hard-linked, 3 copied" in capsys.readouterr().out
    dst = tmp_path / "dst"
    assert (dst / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    assert os.stat(src / "model.safetensors").st_ino != os.stat(dst / "model.safetensors").st_ino


def test_in_place_on_a_lone_config_file(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(LLAMA))
    assert run(p, "--in-place", "--type", "dynamic", "--factor", 2) == 0
    assert json.loads((tmp_path / "config.json.bak").read_text()) == LLAMA
    assert cfg_of(p)["rope_scaling"] == {"rope_type": "dynamic", "factor": 2.0}
