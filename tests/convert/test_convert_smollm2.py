"""Real model: SmolLM2-135M (9 query heads, 3 KV heads) converted to MQA and to MHA."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.cli import main  # noqa: E402

pytestmark = pytest.mark.slow


def test_smollm2_to_mqa_loads_generates_and_reports_perplexity(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kvtool.eval.api import evaluate

    out = tmp_path / "mqa"
    assert main(["convert", str(smollm2_path), str(out), "--to", "mqa", "--no-eval", "--no-progress"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.config.num_key_value_heads == 1
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    gen = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert gen.shape[1] == ids.shape[1] + 8
    r = evaluate(out, baseline=smollm2_path, max_tokens=256, device="cpu")
    print(f"\nSmolLM2-135M perplexity ({r.tokens} tokens): GQA-3 {r.baseline_ppl:.2f} -> MQA (mean pooling) "
          f"{r.ppl:.2f}; mean KLD {r.kld_mean:.3f}; generated: {tok.decode(gen[0, ids.shape[1]:])!r}")
    # Mean pooling without retraining is known to hurt: the rise must show, and stay finite.
    assert r.ppl > r.baseline_ppl and r.ppl == r.ppl and r.ppl < float("inf")


def test_smollm2_to_mha_is_exact(smollm2_path, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "mha"
    assert main(["convert", str(smollm2_path), str(out), "--to", "mha", "--no-eval", "--no-progress"]) == 0
    ids = torch.arange(100, 164).unsqueeze(0)
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(smollm2_path)(input_ids=ids).logits
        b = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
