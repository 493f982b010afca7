"""kvtool.tokenstream: the first tokens of a text, read and tokenized a window at a time, equal those of
tokenizing the used text whole, and of tokenizing the whole text; files are read only as far as they are used."""

from __future__ import annotations

import functools
import re

import pytest

from kvtool import tokenstream as ts
from kvtool.errors import InputError
from kvtool.io import inputfile


class Words:
    """A fast tokenizer's call in miniature (GPT-2's pre-tokenizer: a space joins the word after it), with
    offsets; ids from a vocabulary grown as words are seen. BOS 1 and EOS 2 with add_special_tokens."""

    PATTERN = re.compile(r" ?\w+| ?[^\w\s]+|\s+(?!\S)|\s+")

    def __init__(self, eos: bool = False, offsets: bool = True):
        self.vocab: dict[str, int] = {}
        self.eos, self.offsets, self.calls = eos, offsets, []

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False, verbose=True):
        if return_offsets_mapping and not self.offsets:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        self.calls.append(len(text))
        spans = [m.span() for m in self.PATTERN.finditer(text)]
        ids = [self.vocab.setdefault(text[a:b], len(self.vocab) + 3) for a, b in spans]
        if add_special_tokens:
            ids = [1, *ids, *([2] if self.eos else [])]
            spans = [(0, 0), *spans, *([(0, 0)] if self.eos else [])]
        out = {"input_ids": ids}
        if return_offsets_mapping:
            out["offset_mapping"] = spans
        return out


class Runs(Words):
    """Every run of one repeated character is one token: a token as long as the text, no boundary inside it."""

    PATTERN = re.compile(r"(.)\1*", re.S)


@functools.lru_cache(maxsize=None)
def _texts() -> dict[str, str]:
    from kvtool.datasets import calibration_text, packaged_text

    return {
        "prose": calibration_text()[:60_000],
        "dictionary": packaged_text("devil")[:30_000],
        "code": open(ts.__file__, encoding="utf-8").read() * 3,
        "cjk": "日本語のテキストです。漢字、ひらがな。" * 800,
        "no-spaces": "a" * 9000 + "bc" * 3000 + "x1-" * 2000,
        "whitespace": "word   \n\n\t  " * 1500 + "  \n " * 300,
        "nul": "\0" * 5000 + "x y " * 5000,
    }


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of 300 characters: every text is cut dozens of times."""
    for name, value in {"WINDOW": 300, "CONTEXT": 40, "HOLD": 40, "SCAN": 64}.items():
        monkeypatch.setattr(ts, name, value)


def _check(tok, text: str, budget, *, special_tokens=False, windowed=True):
    got = ts.first_tokens(tok, [text], budget, special_tokens=special_tokens)
    whole = tok(text, add_special_tokens=special_tokens)["input_ids"]
    used = tok(text[:got.chars], add_special_tokens=special_tokens)["input_ids"]
    assert list(got.ids) == whole[:budget], "windows changed the tokens of the whole text"
    assert list(got.ids) == used[:budget], "not the tokens of the used text"
    assert got.windowed is windowed
    return got


@pytest.mark.parametrize("budget", [None, 7, 500])
@pytest.mark.parametrize("name", sorted(_texts()))
def test_windows_give_the_tokens_of_the_whole_text(small_windows, name, budget):
    got = _check(Words(), _texts()[name], budget)
    if budget is not None:
        assert got.chars < len(_texts()[name]) and not got.exhausted  # it stopped where the budget was met


@functools.lru_cache(maxsize=None)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.model_max_length = 10**12
    return tok


@pytest.mark.torch
@pytest.mark.parametrize("name", ["prose", "code", "cjk", "no-spaces", "whitespace", "nul"])
@pytest.mark.parametrize("fixture", ["smollm2_path", "gemma3_path"])
def test_real_tokenizers_windowed_equal_their_whole_text(request, monkeypatch, fixture, name):
    tok = _tokenizer(str(request.getfixturevalue(fixture)))
    monkeypatch.setattr(ts, "WINDOW", 3000)
    for budget in (None, 1000):
        _check(tok, _texts()[name], budget, special_tokens=True)


@pytest.mark.torch
def test_a_tokenizer_that_marks_the_start_of_each_text(small_windows):
    """A sentencepiece-style normalizer prepends "▁" to every text it is given: each window's start gets it,
    which the left context absorbs; the tokens stay those of the whole text."""
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = _texts()["prose"][:20_000]
    tk = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tk.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tk.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tk.train_from_iterator([text], trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>", "<s>"]))
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", bos_token="<s>")
    for budget in (None, 300):
        got = ts.first_tokens(tok, [text], budget)
        assert list(got.ids) == tok(text, add_special_tokens=False)["input_ids"][:budget]


def test_a_token_longer_than_the_window_widens_it(small_windows):
    tok = Runs()
    got = _check(tok, "a" * 5000 + "b" * 10 + "c" * 3000, None)
    assert got.exhausted and max(tok.calls) > 5000  # the run was read whole, never cut


def test_a_tokenizer_without_offsets_tokenizes_the_growing_prefix(small_windows):
    text = _texts()["prose"]
    tok = Words(offsets=False)
    got = _check(tok, text, 50, windowed=False)
    assert got.chars < len(text)


@pytest.mark.parametrize("eos", [False, True])
def test_special_tokens_are_where_the_whole_text_has_them(small_windows, eos):
    text = _texts()["prose"][:5000]
    for budget in (None, 3, 200):
        got = _check(Words(eos=eos), text, budget, special_tokens=True)
        assert got.ids[0] == 1 and (got.ids[-1] == 2) == (eos and budget is None)


def test_several_texts_are_one_stream_joined_by_blank_lines(small_windows):
    a, b = _texts()["prose"][:1000], _texts()["code"][:1000]
    tok = Words()
    assert list(ts.first_tokens(tok, [a, b]).ids) == tok(a + "\n\n" + b, add_special_tokens=False)["input_ids"]


# --- files ---------------------------------------------------------------------------------------------


@pytest.fixture
def counted(monkeypatch):
    """Bytes kvtool reads from text files."""
    seen = {"bytes": 0}
    real = inputfile.read_chunks

    def chunks(*args, **kwargs):
        for chunk in real(*args, **kwargs):
            seen["bytes"] += len(chunk)
            yield chunk

    monkeypatch.setattr(inputfile, "read_chunks", chunks)
    return seen


def test_a_file_is_read_only_as_far_as_the_budget_needs(tmp_path, counted):
    path = tmp_path / "big.txt"
    block = _texts()["prose"].encode()
    with path.open("wb") as fh:
        while fh.tell() < 32 << 20:
            fh.write(block)
    text = ts.TextFile(str(path), "text")
    counted["bytes"] = 0
    got = ts.first_tokens(Words(), [text], 100)
    assert len(got.ids) == 100 and counted["bytes"] <= ts.READ_BYTES
    assert list(got.ids) == Words()(block.decode()[:got.chars], add_special_tokens=False)["input_ids"][:100]


def test_a_file_gives_the_tokens_of_its_text(tmp_path):
    text = _texts()["cjk"] + _texts()["prose"]
    path = tmp_path / "t.txt"
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())  # a BOM is dropped, as inputfile.read_text drops it
    tok = Words()
    assert list(ts.first_tokens(tok, [ts.TextFile(str(path), "text")]).ids) == \
        tok(text, add_special_tokens=False)["input_ids"]


def test_bad_utf8_is_named_by_byte_where_it_is_read(tmp_path):
    path = tmp_path / "t.txt"
    path.write_bytes(b"x " * 150_000 + b"\xff" + b"y" * 10)
    f = ts.TextFile(str(path), "calib_text")
    assert len(ts.first_tokens(Words(), [f], 5).ids) == 5  # past the used text: never read, never checked
    with pytest.raises(InputError) as got:
        ts.first_tokens(Words(), [f])
    assert got.value.line() == f"{path}: calib_text: text file is not UTF-8 (byte 300000)"
    path.write_bytes("x é".encode()[:-1])
    with pytest.raises(InputError, match="ends inside a character"):
        ts.first_tokens(Words(), [ts.TextFile(str(path), "text")])


def test_blank_reads_only_up_to_the_first_character(tmp_path, counted):
    path = tmp_path / "t.txt"
    path.write_bytes(b" \n" * 10 + b"x" + b" " * (8 << 20))
    counted["bytes"] = 0
    assert not ts.TextFile(str(path), "text").blank() and counted["bytes"] <= ts.READ_BYTES
    path.write_bytes(b" \n\t" * 100_000)
    assert ts.TextFile(str(path), "text").blank()


def test_a_file_over_the_limit_is_refused_when_it_is_given(tmp_path):
    path = tmp_path / "t.txt"
    with path.open("wb") as fh:
        fh.truncate(2001)
    with pytest.raises(InputError) as got:
        ts.TextFile(str(path), "text", limit=2000)
    assert got.value.line() == f"{path}: text: text file is larger than the 2000 byte limit"


class Fused(Words):
    """add_special_tokens changes the text's first token (a BOS merged into it), so the special tokens are not
    around the text's own: first_tokens leaves them to the tokenizer, on the growing prefix."""

    def __call__(self, text, add_special_tokens=True, return_offsets_mapping=False, verbose=True):
        out = super().__call__(text, False, return_offsets_mapping, verbose)
        if add_special_tokens and out["input_ids"]:
            out["input_ids"] = [-out["input_ids"][0], *out["input_ids"][1:]]
        return out


def test_special_tokens_not_around_the_text_with_a_budget(small_windows):
    """With a budget this used to stop on len(None) (the tokens before the text unknown), a TypeError."""
    text = _texts()["prose"][:5000]
    for budget in (None, 3, 200):
        got = _check(Fused(), text, budget, special_tokens=True, windowed=False)
        assert got.ids[0] < 0
