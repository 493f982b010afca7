"""A recipe's eval step against a real engine (llama-cpp-python serving SmolLM2's GGUF; the fixture of
test_eval_served.py): `server` scores the served model, `baseline_server` gates the recipe's output against a served
baseline, and `server` after a step that writes a model is refused before any work (nothing serves that output)."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main

from test_eval_served import llama_server  # noqa: F401 - the session's server fixture

# test_eval_served.SMALL: llama-cpp-python sorts its vocabulary in Python for every token it echoes
WINDOW = "max_length: 32, stride: 16, max_tokens: 64"


def _recipe(folder, steps: str):
    from kvtool.datasets import evaluation_text

    (folder / "eval.txt").write_text(evaluation_text()[:4000], encoding="utf-8")
    r = folder / "recipe.yaml"
    r.write_text(f"version: 1\nname: served\nsteps:\n{steps}", encoding="utf-8")
    return r


def _eval_step(dst) -> dict:
    report = json.loads((dst / "kvtool-report.json").read_text())
    return report["steps"][-1]


def test_server_against_server_in_a_recipe(llama_server, tmp_path, smollm2_path, capsys):  # noqa: F811
    r = _recipe(tmp_path, f"  - eval: {{server: '{llama_server}', served_model: smollm2, baseline_server: "
                          f"'{llama_server}', text: eval.txt, {WINDOW}, top_logprobs: 5, server_timeout: 120, "
                          "thresholds: {max_kld: 0.0, min_top1: 1.0}}\n")
    assert main(["apply", str(r), str(smollm2_path), str(tmp_path / "out"), "--dry-run"]) == 0
    assert f"1. eval: eval smollm2 served at {llama_server} against smollm2 at {llama_server}" in \
        capsys.readouterr().out
    assert main(["apply", str(r), str(smollm2_path), str(tmp_path / "out")]) == 0, capsys.readouterr().err
    m = _eval_step(tmp_path / "out")["details"]["metrics"]
    assert m["kld_mean"] == 0.0 and m["ppl_ratio"] == 1.0 and m["tokens"] == 62
    assert m["memory"]["mode"] == "served" and m["memory"]["top_logprobs"] == 5


@pytest.mark.torch
def test_served_model_against_the_recipes_source_fails_a_tight_gate(llama_server, tmp_path, smollm2_path,
                                                                    capsys):  # noqa: F811
    """`server` without `baseline_server`: the engine against transformers on the recipe's SRC (the same weights,
    llama.cpp's Q4_1 kernels against float32), so a zero-KLD gate fails: exit 1, no DST, the report says how."""
    r = _recipe(tmp_path, f"  - eval: {{server: '{llama_server}', served_model: smollm2, text: eval.txt, "
                          f"{WINDOW}, thresholds: {{max_kld: 0.0}}}}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(smollm2_path), str(dst)]) == 1
    assert "step 1 (eval) failed" in capsys.readouterr().err and not dst.exists()
    step = json.loads((tmp_path / "out.kvtool-failed.json").read_text())["steps"][0]
    m = step["details"]["metrics"]
    assert m["memory"]["mode"] == "served+local" and m["memory"]["local"]["side"] == "baseline"
    assert m["baseline"] == f"{smollm2_path} (local)" and abs(m["ppl_ratio"] - 1) < 0.10 and m["kld_mean"] > 0
    print(f"served vs local SRC: ratio {m['ppl_ratio']:.4f} ± {m['ppl_ratio_se']:.4f}, KLD^ {m['kld_mean']:.5f} ± "
          f"{m['kld_se']:.5f}, top-1 {m['top1_agreement']:.3f} ± {m['top1_se']:.3f}")


@pytest.mark.torch
def test_the_recipes_output_against_a_served_baseline(llama_server, tmp_path, smollm2_path, capsys):  # noqa: F811
    """After a convert step the output is local: `baseline_server` gates it against what the server serves (the
    mean-pooled MQA copy of SmolLM2 loses most of its quality, so only a loose KLD gate passes)."""
    r = _recipe(tmp_path, "  - convert: {to: mqa}\n"
                          f"  - eval: {{baseline_server: '{llama_server}', served_baseline: smollm2, text: eval.txt, "
                          f"{WINDOW}, thresholds: {{max_kld: 1000}}}}\n")
    dst = tmp_path / "out"
    assert main(["apply", str(r), str(smollm2_path), str(dst)]) == 0, capsys.readouterr().err
    m = _eval_step(dst)["details"]["metrics"]
    assert m["memory"]["mode"] == "served+local" and m["memory"]["local"]["side"] == "candidate"
    assert m["baseline"] == f"smollm2 @ {llama_server}" and m["ppl_ratio"] > 1.05 and m["kld_mean"] > 0.01
    assert (dst / "config.json").is_file() and json.loads((dst / "config.json").read_text())["num_key_value_heads"] == 1


@pytest.mark.parametrize("steps, said", [
    ("  - convert: {to: mqa}\n  - eval: {server: 'http://127.0.0.1:9', served_model: m, text: eval.txt}\n",
     "step 2 (eval): server scores the model the server serves, not the one step 1 (convert) writes"),
    ("  - eval: {server: 'http://127.0.0.1:9', text: eval.txt}\n", "name the served candidate with served_model"),
    ("  - eval: {baseline_server: 'http://127.0.0.1:9', text: eval.txt}\n",
     "name the served baseline with served_baseline"),
    ("  - eval: {served_model: m, text: eval.txt}\n", "served_model names the model on `server`"),
])
def test_a_served_eval_step_that_would_score_the_wrong_thing_is_refused(steps, said, tmp_path, smollm2_path,
                                                                        capsys):
    r = _recipe(tmp_path, steps)
    assert main(["apply", str(r), str(smollm2_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "recipe.yaml" in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_recipe_server_that_is_no_url_is_refused_at_load(tmp_path, smollm2_path, capsys):
    r = _recipe(tmp_path, "  - eval: {server: '', served_model: m, text: eval.txt}\n")
    assert main(["apply", str(r), str(smollm2_path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recipe.yaml" in err[0] and "server" in err[0] and "http://HOST" in err[0], err
    assert not (tmp_path / "out").exists()
