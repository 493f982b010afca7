"""`--calib-dataset self`: calibration text the model writes itself, and mixes of sources in equal shares."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtool.convert.aware.calibration import Source, calibration_batch, calibration_ids  # noqa: E402
from kvtool.convert.aware.selftext import OPENINGS, Sampling, generate_ids  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, smollm2_path):
    """A tiny random llama with SmolLM2's tokenizer, loaded, and its folder."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny")
    cfg = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=8, vocab_size=49152,
                               max_position_embeddings=256, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (smollm2_path / f).exists():
            shutil.copy(smollm2_path / f, folder / f)
    return model, AutoTokenizer.from_pretrained(folder), folder


def test_rows_are_openings_continued_to_full_length(tiny):
    model, tok, _ = tiny
    ids = generate_ids(model, tok, 5, 12, Sampling(batch=3))  # two batches, the second one short
    assert ids.shape == (5, 12) and ids.dtype == torch.long
    for i, row in enumerate(ids):
        opening = tok(OPENINGS[i % len(OPENINGS)], add_special_tokens=False)["input_ids"]
        assert row[: len(opening)].tolist() == opening  # no padding before the opening
    # the model may not end a row early: no end-of-text or padding token inside
    assert not torch.isin(ids, torch.tensor([tok.eos_token_id, tok.pad_token_id])).any()


def test_generation_is_seeded_and_leaves_the_global_generator_alone(tiny):
    model, tok, _ = tiny
    torch.manual_seed(123)
    before = torch.random.get_rng_state()
    a = generate_ids(model, tok, 2, 16, Sampling(seed=1))
    assert torch.equal(torch.random.get_rng_state(), before)
    assert torch.equal(a, generate_ids(model, tok, 2, 16, Sampling(seed=1)))
    assert not torch.equal(a, generate_ids(model, tok, 2, 16, Sampling(seed=2)))


def test_no_repeated_ngrams(tiny):
    model, tok, _ = tiny
    ids = generate_ids(model, tok, 2, 40, Sampling(no_repeat_ngram_size=3, repetition_penalty=1.0))
    for row in ids.tolist():
        grams = [tuple(row[i:i + 3]) for i in range(len(row) - 2)]
        # the opening is given, not sampled; every n-gram that ends in a sampled token is new
        assert len(set(grams)) == len(grams)


def test_sources_get_equal_shares_of_whole_sequences(tiny):
    _, tok, _ = tiny
    from kvtool.datasets import calibration_text

    asked = []

    def write(rows, seq_len):
        asked.append((rows, seq_len))
        return torch.full((rows, seq_len), 7, dtype=torch.long)

    text = calibration_text()
    ids = calibration_batch(tok, [Source(text, "pydoc"), Source(None, "self")], 5 * 16 + 3, 16, write)
    assert ids.shape == (5, 16) and asked == [(2, 16)]  # 5 rows: the first source gets the remainder
    # interleaved: pydoc, self, pydoc, self, pydoc
    assert torch.equal(ids[[0, 2, 4]], calibration_ids(tok, text, 3 * 16, 16, "pydoc"))
    assert (ids[[1, 3]] == 7).all()
    only_text = calibration_batch(tok, [Source(text, "pydoc")], 64, 16, write)
    assert torch.equal(only_text, calibration_ids(tok, text, 64, 16, "pydoc")) and len(asked) == 1


def test_convert_with_self_written_calibration(tiny, tmp_path):
    from kvtool.cli import main

    _, _, folder = tiny
    rc = main(["convert", str(folder), str(tmp_path / "out"), "--to", "mqa", "--method", "aware", "--no-eval",
               "--no-progress", "--calib-dataset", "pydoc+self", "--calib-tokens", "64", "--seq-len", "16"])
    assert rc == 0
    details = json.loads((tmp_path / "out" / "kvtool.json").read_text())["method_details"]
    assert details["calib_tokens"] == 64 and details["self_written"]["rows"] == 2
    assert details["self_written"]["sampling"] == vars(Sampling())
    assert "written by the model" in details["calib_text"] and "pydoc" in details["calib_text"]


def test_sources_take_turns():
    from kvtool.convert.aware.calibration import interleave

    a, b, c = (torch.full((n, 2), v) for n, v in ((3, 1), (1, 2), (2, 3)))
    assert interleave([a, b, c])[:, 0].tolist() == [1, 2, 3, 1, 3, 1]
    assert torch.equal(interleave([a]), a)


def test_shares_of_a_mix_and_who_gets_none():
    from kvtool.convert.aware.calibration import calibration_shares

    assert calibration_shares(3, 4096, 256) == [6, 5, 5]
    assert calibration_shares(3, 4096, 1024) == [2, 1, 1]
    assert calibration_shares(3, 256, 256) == [1, 0, 0]  # one sequence: the first source only
    assert sum(calibration_shares(3, 8192, 256)) == 32
