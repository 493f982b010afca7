"""evaluate / evaluate_many on a tiny random llama: plain-loop equality, token accounting, refusals."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvtool.errors import UsageError
from kvtool.eval.api import Candidate, evaluate, evaluate_many

from eval_helpers import DEVICE, reference_nll

L, S = 64, 32


@pytest.fixture(scope="module")
def tiny_model(tiny_llama_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_path, dtype=torch.float32).to(DEVICE).eval()


def test_equals_plain_transformers_loop(tiny_llama_path, tiny_model, smollm2_tokenizer):
    from kvtool.testing.text import evaluation_text

    n = L + 5 * S  # aligned: the HF guide's last window needs no slide
    r = evaluate(tiny_llama_path, max_length=L, stride=S, max_tokens=n, device=DEVICE, dtype="fp32")
    ids = smollm2_tokenizer(evaluation_text())["input_ids"][:n]
    total, count = reference_nll(tiny_model, ids, L, S)
    assert r.tokens == count == n - 1
    assert r.metrics["nll_mean"] == pytest.approx(total / count, rel=1e-5)
    assert r.ppl == pytest.approx(torch.tensor(total / count).exp().item(), rel=1e-5)
    assert r.baseline_ppl is None and r.kld_mean is None and r.kv_cache_dtype == "float32"


@pytest.mark.parametrize("n,stride", [(200, 32), (257, 63), (300, 1 * L // 4)])
def test_each_token_scored_once_and_batching_is_invisible(tiny_model, smollm2_tokenizer, n, stride):
    one = evaluate(tiny_model, tokenizer=smollm2_tokenizer, max_length=L, stride=stride, max_tokens=n, batch_size=1)
    many = evaluate(tiny_model, tokenizer=smollm2_tokenizer, max_length=L, stride=stride, max_tokens=n, batch_size=4)
    assert one.tokens == many.tokens == n - 1
    assert many.ppl == pytest.approx(one.ppl, rel=1e-5)
    assert one.windows == many.windows and many.batch_size == 4


def test_model_against_itself(tiny_model, smollm2_tokenizer):
    r = evaluate(tiny_model, tiny_model, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=200,
                 gates={"max_ppl_increase": 0.0, "max_kld": 0.0, "min_top1": 1.0})
    assert r.kld_mean == 0.0 and r.ppl_ratio == 1.0 and r.top1_agreement == 1.0 and r.dp_rms == 0.0
    assert r.passed and len(r.gates) == 3


def test_fp8_variants_share_one_model_and_restore_it(tiny_model, smollm2_tokenizer):
    rows = evaluate_many([Candidate(tiny_model, "off", label="original"),
                          Candidate(tiny_model, "fp8", "one", label="fp8 1.0"),
                          Candidate(tiny_model, "fp8", {0: (100.0, 100.0), 1: (100.0, 100.0)}, label="fp8 huge scales")],
                         baseline=tiny_model, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=160)
    assert [r.label for r in rows] == ["original", "fp8 1.0", "fp8 huge scales"]
    assert rows[0].kld_mean == 0.0 and rows[0].kv_scales is None
    assert rows[1].kv_cache_dtype == "fp8_e4m3" and rows[1].kv_scales["source"] == "one"
    assert rows[2].kv_scales == {"source": "given", "layers": 2, "max_scale": 100.0, "min_scale": 100.0}
    # the random model's K/V are ~0.02: / 100 underflows e4m3 (smallest subnormal 2^-9), far worse than 1.0
    assert rows[2].kld_mean > 10 * rows[1].kld_mean > 0
    assert tiny_model.config._attn_implementation == "sdpa"  # the hook is gone afterwards


def test_as_dict_has_the_documented_keys(tiny_model, smollm2_tokenizer):
    d = evaluate(tiny_model, tiny_model, tokenizer=smollm2_tokenizer, max_length=L, stride=S, max_tokens=100).as_dict()
    for key in ("ppl", "baseline_ppl", "ppl_ratio", "kld_mean", "top1_agreement", "tokens", "device", "dtype",
                "window", "stride", "passed", "ppl_se", "log_ppl_ratio", "dp_mean", "dp_rms", "kv_cache_dtype"):
        assert key in d, key
    assert d["device"].startswith(DEVICE.split(":")[0]) and d["window"] == L and d["stride"] == S and d["tokens"] == 99
    json.dumps(d)


def test_different_tokenizers_are_refused(tmp_path, tiny_llama_path, smollm2_path, smollm2_tokenizer):
    other = tmp_path / "other-tok"
    shutil.copytree(tiny_llama_path, other)
    tok = json.loads((other / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    vocab["Ġthe"], vocab["Ġa"] = vocab["Ġa"], vocab["Ġthe"]  # same size, different ids
    (other / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(UsageError, match="different tokenizers"):
        evaluate(other, tiny_llama_path, max_length=L, stride=S, max_tokens=100, device=DEVICE)


@pytest.mark.parametrize("kwargs,field", [
    ({"max_length": 64, "stride": 64}, "stride"),
    ({"max_tokens": 1}, "max_tokens"),
    ({"kv_cache_dtype": "int4"}, "kv_cache_dtype"),
    ({"kv_scales": "calibrated"}, "kv_scales"),
    ({"batch_size": 0}, "batch_size"),
    ({"dtype": "fp64"}, "dtype"),
])
def test_bad_options(tiny_model, smollm2_tokenizer, kwargs, field):
    with pytest.raises(UsageError) as exc:
        evaluate(tiny_model, tokenizer=smollm2_tokenizer, **kwargs)
    assert exc.value.option == field  # a field name: the CLI spells it --name


def test_text_shorter_than_two_tokens(tiny_model, smollm2_tokenizer):
    from kvtool.errors import InputError

    with pytest.raises(InputError, match="at least 2"):
        evaluate(tiny_model, tokenizer=smollm2_tokenizer, texts="a")


def test_device_map_path_gives_the_same_result(tiny_llama_path):
    # accelerate's dispatch (what --device-map auto uses on multi-GPU nodes), here onto the CPU
    plain = evaluate(tiny_llama_path, max_length=L, stride=S, max_tokens=128, device="cpu", dtype="fp32")
    mapped = evaluate(tiny_llama_path, max_length=L, stride=S, max_tokens=128, device_map="cpu", dtype="fp32")
    assert mapped.device == "cpu(cpu)" and mapped.ppl == pytest.approx(plain.ppl, rel=1e-6)
