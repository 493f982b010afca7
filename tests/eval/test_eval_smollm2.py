"""Real-model evidence on SmolLM2-135M (and Gemma-3-270M): self-comparison, the plain-loop identity,
a mean-pooled MQA copy failing the gate, FP8 KV emulation and checkpoint scales. Small: 256 tokens,
windows of 128."""

from __future__ import annotations

import json

import pytest

from kvtool.cli import main
from kvtool.eval.api import Candidate, evaluate, evaluate_many

from eval_helpers import DEVICE, mean_pooled_mqa, reference_nll, with_kv_scales

# real_weights: the figures asserted are the real checkpoints' (gpu_check.sh deselects them on stand-ins)
pytestmark = [pytest.mark.slow, pytest.mark.real_weights]
L, S, N = 128, 64, 256  # N = L + 2 S: the HF guide's windows, no slide-back


def test_equals_plain_loop_and_itself(smollm2_model, smollm2_tokenizer):
    from kvtool.testing.text import evaluation_text

    r = evaluate(smollm2_model, smollm2_model, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=N)
    assert r.kld_mean == 0.0 and r.ppl_ratio == 1.0 and r.top1_agreement == 1.0
    ids = smollm2_tokenizer(evaluation_text())["input_ids"][:N]
    total, count = reference_nll(smollm2_model, ids, L, S)
    assert r.tokens == count == N - 1
    assert r.metrics["nll_mean"] == pytest.approx(total / count, rel=1e-5)
    assert 5 < r.ppl < 60  # a real model on English prose, not a random one (~49152)


@pytest.fixture(scope="module")
def mqa_copy(tmp_path_factory, smollm2_path):
    return mean_pooled_mqa(smollm2_path, tmp_path_factory.mktemp("mqa") / "smollm2-mqa")


def test_mean_pooled_mqa_fails_the_gate(mqa_copy, smollm2_path, eval_text_file, capsys):
    rc = main(["eval", str(mqa_copy), "--baseline", str(smollm2_path), "--text", str(eval_text_file),
               "--max-length", str(L), "--stride", str(S), "--max-tokens", str(N), "--format", "json",
               "--max-ppl-increase", "2%", "--min-top1", "0.95", "--device", DEVICE, "--dtype", "fp32"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert rc == 1 and d["passed"] is False
    assert d["ppl_ratio"] > 1.02 and d["kld_mean"] > 0.05 and d["top1_agreement"] < 0.95
    assert "ppl_increase (--max-ppl-increase)" in err and "top1_agreement (--min-top1)" in err


def _scales(n_layers, k0, v0):
    return {i: (k0 * (1 + 0.05 * i), v0 * (1 + 0.03 * i)) for i in range(n_layers)}


def test_fp8_emulation_and_checkpoint_scales(tmp_path, smollm2_model, smollm2_path, smollm2_tokenizer):
    n_layers = smollm2_model.config.num_hidden_layers
    good = _scales(n_layers, 0.05, 0.02)
    with_scales = with_kv_scales(smollm2_path, tmp_path / "scaled", good)
    wrong = with_kv_scales(smollm2_path, tmp_path / "wrong", _scales(n_layers, 1e-3, 1e-3), spelling="attn.k_scale")
    rows = evaluate_many([
        Candidate(smollm2_model, "fp8", "one", label="fp8 scale 1.0"),
        Candidate(with_scales, "auto", "checkpoint", label="checkpoint scales"),  # auto: kv_cache_scheme -> fp8
        Candidate(smollm2_model, "fp8", good, label="same scales given"),
        Candidate(with_scales, "auto", "one", label="checkpoint, --kv-scales one"),
        Candidate(wrong, "auto", "checkpoint", label="wrong scales"),
        Candidate(with_scales, "off", label="emulation off"),
    ], baseline=smollm2_model, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=N, device=DEVICE,
        dtype="fp32")
    one, ckpt, given, ckpt_one, bad, off = rows
    # FP8 changes PPL by a small, non-zero amount
    assert 0 < abs(one.metrics["log_ppl_ratio"]) < 0.05 and 0 < one.kld_mean < 0.05
    # the checkpoint's per-layer scales are the ones used ...
    assert ckpt.kv_cache_dtype == "fp8_e4m3" and ckpt.kv_scales["source"] == "checkpoint"
    assert ckpt.kv_scales["layers"] == n_layers
    assert ckpt.kld_mean == pytest.approx(given.kld_mean, rel=1e-9) and ckpt.ppl == pytest.approx(given.ppl, rel=1e-9)
    assert ckpt.kld_mean != pytest.approx(one.kld_mean, rel=1e-3)
    # ... --kv-scales one ignores them, and a wrong scale really changes the result
    assert ckpt_one.kld_mean == pytest.approx(one.kld_mean, rel=1e-9)
    assert bad.kld_mean > 20 * one.kld_mean and bad.ppl_ratio > 1.2
    assert off.kld_mean == 0.0 and off.kv_scales is None


def test_gemma3_fp8(gemma3_path):
    """Sliding-window layers, q/k norms and head_dim 256 go through the same hook."""
    rows = evaluate_many([Candidate(gemma3_path, "off"), Candidate(gemma3_path, "fp8", "one")], baseline=gemma3_path,
                         max_length=L, stride=S, max_tokens=N, device=DEVICE, dtype="fp32")
    assert rows[0].kld_mean == 0.0 and rows[0].top1_agreement == 1.0
    assert 0 < rows[1].kld_mean < 0.1 and rows[1].top1_agreement > 0.8
