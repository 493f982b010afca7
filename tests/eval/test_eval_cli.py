"""`kvtool eval` command line: outputs, gate exit codes (0 / 1) and bad input (2), on a tiny random llama."""

from __future__ import annotations

import json

import pytest
import torch

from kvtool.cli import main

from eval_helpers import DEVICE, tiny_llama

FAST = ["--max-length", "64", "--stride", "32", "--max-tokens", "160", "--device", DEVICE, "--dtype", "fp32"]


@pytest.fixture(scope="module")
def other_tiny(tmp_path_factory, smollm2_path, smollm2_tokenizer):
    return tiny_llama(tmp_path_factory.mktemp("tiny2") / "tiny-llama-seed1", smollm2_path, len(smollm2_tokenizer), seed=1)


def _json(capsys):
    return json.loads(capsys.readouterr().out)


def test_model_against_itself_passes(tiny_llama_path, capsys):
    p = str(tiny_llama_path)
    rc = main(["eval", p, "--baseline", p, *FAST, "--format", "json", "--max-kld", "0", "--min-top1", "1.0"])
    d = _json(capsys)
    assert rc == 0 and d["passed"] is True
    assert d["kld_mean"] == 0.0 and d["ppl_ratio"] == 1.0 and d["top1_agreement"] == 1.0
    assert d["tokens"] == 159 and d["device"].startswith(DEVICE.split(":")[0]) and d["dtype"] == "float32"
    assert d["window"] == 64 and d["stride"] == 32 and d["baseline_ppl"] == d["ppl"]
    assert [g["option"] for g in d["gates"]] == ["--max-ppl-increase", "--max-kld", "--min-top1"]


def test_failed_gate_exits_1_and_names_the_metric(tiny_llama_path, other_tiny, capsys):
    rc = main(["eval", str(other_tiny), "--baseline", str(tiny_llama_path), *FAST, "--min-top1", "0.99",
               "--max-ppl-increase", "off"])
    out, err = capsys.readouterr()
    assert rc == 1
    assert "top1_agreement" in err and "--min-top1" in err
    assert "FAILED" in out and "result    FAILED" in out


def test_without_baseline_reports_ppl_only(tiny_llama_path, capsys):
    rc = main(["eval", str(tiny_llama_path), *FAST, "--format", "json"])
    d = _json(capsys)
    assert rc == 0 and d["baseline_ppl"] is None and d["kld_mean"] is None and d["gates"] == []
    assert d["ppl"] > 1


def test_text_output_and_text_files(tiny_llama_path, tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("The quick brown fox jumps over the lazy dog. " * 20)
    b.write_text("Pack my box with five dozen liquor jugs. " * 20)
    rc = main(["eval", str(tiny_llama_path), "--baseline", str(tiny_llama_path), "--text", str(a), "--text", str(b),
               "--max-length", "64", "--stride", "48", "--kv-cache-dtype", "fp8", "--kv-scales", "one", "--device", DEVICE,
               "--progress"])
    out, err = capsys.readouterr()
    assert rc == 0 and "tok/s" in err  # kvtool.progress with tokens/s on stderr
    assert f"{a}, {b}" in out and "fp8_e4m3 emulated, scale 1.0 in every layer" in out and "kld" in out


def test_kv_scales_one_equals_api(tiny_llama_path, capsys):
    from kvtool.eval.api import evaluate

    p = str(tiny_llama_path)
    main(["eval", p, "--baseline", p, *FAST, "--kv-cache-dtype", "fp8", "--kv-scales", "one", "--format", "json"])
    d = _json(capsys)
    r = evaluate(p, p, max_length=64, stride=32, max_tokens=160, kv_cache_dtype="fp8", kv_scales={}, device=DEVICE,
                 dtype="fp32")
    assert d["kv_cache_dtype"] == "fp8_e4m3" and d["kld_mean"] == pytest.approx(r.kld_mean, rel=1e-9)


def _bad_utf8(tmp_path):
    p = tmp_path / "latin1.txt"
    p.write_bytes("caf\xe9 au lait".encode("latin-1"))
    return str(p)


def _empty(tmp_path):
    p = tmp_path / "empty.txt"
    p.write_text("  \n")
    return str(p)


@pytest.mark.parametrize("extra,needle", [
    (lambda t: ["--text", str(t / "missing.txt")], "missing.txt: --text: no such file"),
    (lambda t: ["--text", _bad_utf8(t)], "not UTF-8"),
    (lambda t: ["--text", _empty(t)], "is empty"),
    (lambda t: ["--dataset", "nosuch"], "unknown dataset"),
    (lambda t: ["--stride", "64", "--max-length", "64"], "--stride"),
    (lambda t: ["--max-kld", "0.1"], "give --baseline"),
    (lambda t: ["--kv-scales", "bogus"], "--kv-scales"),
    (lambda t: ["--kv-cache-dtype", "int8"], "--kv-cache-dtype"),
    (lambda t: ["--format", "yaml"], "--format"),
    (lambda t: ["--max-ppl-increase", "lots"], "--max-ppl-increase"),
    (lambda t: ["--device", "tpu"], "--device"),
    (lambda t: ["--text", "x", "--dataset", "pydoc"], "not both"),
])
def test_bad_input_exits_2(tiny_llama_path, tmp_path, capsys, extra, needle):
    rc = main(["eval", str(tiny_llama_path), *extra(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert err.count("\n") == 1  # one line


def test_min_top1_out_of_range(tiny_llama_path, capsys):
    rc = main(["eval", str(tiny_llama_path), "--baseline", str(tiny_llama_path), "--min-top1", "95"])
    assert rc == 2 and "--min-top1" in capsys.readouterr().err


def test_missing_model_exits_2(tmp_path, capsys):
    assert main(["eval", str(tmp_path / "nope")]) == 2
    assert "no such file or folder" in capsys.readouterr().err
    (tmp_path / "empty").mkdir()
    assert main(["eval", str(tmp_path / "empty")]) == 2
    assert "config.json" in capsys.readouterr().err


def test_dataset_needs_the_datasets_package(tiny_llama_path, capsys, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    rc = main(["eval", str(tiny_llama_path), "--dataset", "wikitext2"])
    err = capsys.readouterr().err
    assert rc == 2 and "pip install datasets" in err and "--dataset" in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_asked_without_gpu(tiny_llama_path, capsys):
    assert main(["eval", str(tiny_llama_path), "--device", "cuda"]) == 2
    assert "no CUDA GPU" in capsys.readouterr().err


def test_undefined_values_are_json_null(tiny_llama_path, capsys):
    # one scored token: no standard error exists; JSON has no NaN, so it is null
    p = str(tiny_llama_path)
    rc = main(["eval", p, "--baseline", p, "--max-tokens", "2", "--device", DEVICE, "--format", "json"])
    d = _json(capsys)
    assert rc == 0 and d["tokens"] == 1 and d["ppl_se"] is None and d["kld_se"] is None and d["ppl"] > 0


def test_dry_run_prints_the_estimate_without_torch(tmp_path, tiny_llama_config):
    from kvtest import run_without_torch
    from kvtool.model import costs
    from tests.quantize.test_quantize_kv_plan import tiny_model

    src = tiny_model(tmp_path / "src", tiny_llama_config)
    proc = run_without_torch(["eval", src, "--baseline", src, "--max-tokens", "300", "--dry-run"])
    assert proc.returncode == 0, proc.stderr
    est = costs.evaluate(costs.for_checkpoint(src), 300, models=2)
    assert f"  tokens       300 through 2 layers, candidate and baseline\n  estimate     {est.line()}\n" in proc.stdout
