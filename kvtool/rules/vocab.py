"""Vocabulary size vs tokenizer, and special-token ids (KV503, KV504)."""

from __future__ import annotations

from kvtool.rules.registry import checker, define
from kvtool.units import plain_int
from kvtool.values import is_int as _is_int

SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
GENERATION_IDS = SPECIAL_IDS + ("decoder_start_token_id",)

define("KV503", "vocab-smaller-than-tokenizer", "error",
       "The tokenizer produces ids at or beyond vocab_size",
       """
       What it does: compares vocab_size with the number of ids the tokenizer can produce
       (tokenizer.json's vocabulary plus added tokens, and tokenizer_config.json's
       added_tokens_decoder).
       Why it matters: an id >= vocab_size indexes past the embedding matrix: a CUDA device-side
       assert in transformers, an out-of-range error or garbage logits in serving engines. A
       vocab_size larger than the tokenizer is fine (padding, e.g. TinyLlama's 32003 or rounded-up
       embedding tables).
       Example: vocab_size 32000 with a tokenizer that added <|im_start|> as id 32000.
       Fix: resize the embeddings (and lm_head) to cover the tokenizer, then update vocab_size.
       """, hint="resize the embeddings to cover every tokenizer id and update vocab_size", topic="vocab")

define("KV504", "special-token-out-of-vocab", "error",
       "A bos / eos / pad token id is not an id inside the vocabulary",
       """
       What it does: checks bos_token_id, eos_token_id and pad_token_id in config.json and
       generation_config.json (each an integer or a list of integers) against 0 <= id < vocab_size.
       Why it matters: generation stops on eos ids and pads with pad ids; an id outside the
       vocabulary never matches (generation runs to max_tokens) or indexes past the embeddings.
       Example: {"vocab_size": 32000, "eos_token_id": 32000}
       Fix: use the ids the tokenizer assigns to its special tokens.
       """, hint="use the tokenizer's ids for its special tokens", topic="vocab")


def _tokenizer_ids(ckpt) -> tuple[int, str] | None:
    """(number of ids the tokenizer can emit, the file that says so), or None when unknown."""
    best = None
    if ckpt.tokenizer_vocab_size:
        best = (ckpt.tokenizer_vocab_size, "tokenizer.json")
    added = (ckpt.tokenizer_config or {}).get("added_tokens_decoder")
    if isinstance(added, dict):
        # ids as transformers reads them (int(key)): ASCII digits within Python's 4300-digit limit
        ids = [i for k in added if (i := plain_int(k)) is not None and i >= 0]
        if ids and (best is None or max(ids) + 1 > best[0]):
            best = (max(ids) + 1, "tokenizer_config.json added_tokens_decoder")
    return best


@checker("vocab")
def check_tokenizer_size(ctx) -> None:
    spec = ctx.spec
    vocab, tok = spec.get("vocab_size"), _tokenizer_ids(ctx.checkpoint)
    if not (_is_int(vocab) and vocab > 0 and tok):
        return
    n, source = tok
    if n > vocab:
        key = spec.key("vocab_size") or "vocab_size"
        ctx.report("KV503", f"{key} = {vocab} but {source} has ids up to {n - 1} ({n} ids)", path=key)


@checker("vocab")
def check_special_ids(ctx) -> None:
    spec = ctx.spec
    vocab = spec.get("vocab_size")
    if not (_is_int(vocab) and vocab > 0):
        vocab = None
    for name in SPECIAL_IDS:
        key = spec.key(name) or spec.prefixed(name)
        r = spec.values.get(name)
        if r is not None and r.key is not None:
            _check_ids(ctx, r.value, key, vocab, None)
    gen = ctx.checkpoint.generation_config
    if isinstance(gen, dict) and ctx.checkpoint.root is not None:
        gfile = ctx.file_of("generation_config.json")
        for name in GENERATION_IDS:
            if gen.get(name) is not None:
                _check_ids(ctx, gen[name], name, vocab, gfile)


def _check_ids(ctx, value, key: str, vocab: int | None, file: str | None) -> None:
    ids = value if isinstance(value, list) else [value]
    bad_type = [v for v in ids if not _is_int(v)]
    if bad_type or (isinstance(value, list) and not value):
        ctx.report("KV504", f"{key} is {value!r}; it must be an integer or a non-empty list of integers",
                   path=key, file=file)
        return
    out = [v for v in ids if v < 0 or (vocab is not None and v >= vocab)]
    if out:
        rng = f"0..{vocab - 1}" if vocab else "ids >= 0"
        ctx.report("KV504", f"{key} = {value!r} has {out} outside the vocabulary ({rng})", path=key, file=file)
