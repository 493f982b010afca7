"""The first N tokens of a text: read and tokenize only what they need.

`--text`, `--calib-text` and the built-in texts reach the tokenizer through `first_tokens(tokenizer, sources,
budget)`. A file is read 256 KiB at a time and decoded as it comes (kvtool.io.inputfile.read_chunks); the text is
tokenized a window at a time; reading stops once `budget` tokens are in. Time and memory follow the budget, not
the file: a 255 MiB text with `--max-tokens 32` reads one piece of it. Python runs between windows, so Ctrl-C
and SIGTERM stop a long tokenization within one window (a single tokenizer call on the whole text could not be
interrupted). Ids are kept 8 bytes each (`array("q")`), not as Python ints.

Windows are cut where tokenizing the whole text cuts too. A cut is a token boundary (no token's characters
span it, by the fast tokenizer's offsets), preferably just before a single space between two words, at least
HOLD characters before the window's end; the next window starts CONTEXT characters before the cut and must
have a token boundary at the same place, or the tokenizer is not local enough to be windowed: it is then
tokenized on the growing prefix instead (`Tokens.windowed` False; so are tokenizers without offsets). The ids
equal those of tokenizing the used text whole (`Tokens.chars` characters; tests/test_tokenstream.py checks both
real fixtures' tokenizers on prose, code, CJK, whitespace runs and a text without spaces).
"""

from __future__ import annotations

import codecs
import hashlib
from array import array
from dataclasses import dataclass
from typing import Iterable, Iterator

from kvtool.errors import InputError
from kvtool.io import inputfile

SEPARATOR = "\n\n"  # between texts: one stream, as the texts joined by blank lines
WINDOW = 64 * 1024  # characters per tokenizer call (about 16k tokens of prose, tens of ms)
CONTEXT = 1024  # characters the next window re-reads before a cut (a start-of-text marker lands there)
HOLD = 1024  # characters after a cut that its window saw (a word the window's end splits stays beyond it)
SCAN = 4096  # tokens looked at, backwards from HOLD, for a cut before a space
READ_BYTES = 256 * 1024


class TextFile:
    """A UTF-8 text file given as option `option`: a regular file of at most `limit` bytes (checked when made),
    read lazily in pieces. A leading BOM is dropped; bytes past what is used are never read nor checked."""

    def __init__(self, name: str, option: str, limit: int = inputfile.TEXT_LIMIT):
        self.name, self.option, self.limit = str(name), option, limit
        try:  # opened and checked (regular, size) now, not read: the plan refuses it, not the run
            self.size = inputfile.check_size(self.name, what="text file", limit=limit)
        except InputError as exc:
            raise self._error(exc.message) from None

    def __repr__(self) -> str:
        return f"TextFile({self.name!r})"

    def _chunks(self) -> Iterator[bytes]:
        try:
            yield from inputfile.read_chunks(self.name, what="text file", limit=self.limit, size=READ_BYTES)
        except InputError as exc:
            raise self._error(exc.message) from None

    def _error(self, message: str) -> InputError:
        return InputError(message, file=self.name, option=self.option)

    def pieces(self) -> Iterator[str]:
        dec = codecs.getincrementaldecoder("utf-8")()
        fed, first = 0, True
        for chunk in self._chunks():
            try:
                text = dec.decode(chunk)
            except UnicodeDecodeError as exc:
                raise self._error(f"text file is not UTF-8 (byte {fed - len(dec.getstate()[0]) + exc.start})") from None
            fed += len(chunk)
            if first and text:
                text, first = text.removeprefix("\ufeff"), False
            if text:
                yield text
        try:
            dec.decode(b"", final=True)
        except UnicodeDecodeError:
            raise self._error(f"text file is not UTF-8 (it ends inside a character, byte {fed})") from None

    def blank(self) -> bool:
        """Whether the file holds only whitespace; read up to its first other character."""
        return all(not piece.strip() for piece in self.pieces())


def source_size(source) -> int:
    """Characters of a text (bytes of a file): what a plan without a tokenizer estimates from."""
    return len(source) if isinstance(source, str) else source.size


def pieces(sources: Iterable) -> Iterator[str]:
    """The texts as one stream, SEPARATOR between them: a str in WINDOW slices, anything else by its pieces()."""
    for i, src in enumerate(sources):
        if i:
            yield SEPARATOR
        if isinstance(src, str):
            yield from (src[k:k + WINDOW] for k in range(0, len(src), WINDOW))
        else:
            yield from src.pieces()


@dataclass
class Tokens:
    ids: array  # int64 token ids
    chars: int  # characters of the text they come from (its first ones, separators included)
    exhausted: bool  # the whole text was used
    windowed: bool  # False: tokenized on the growing prefix (a tokenizer without offsets or not local)
    sha256: str  # of the used text, UTF-8


class _NotLocal(Exception):
    """The tokenizer cut a window differently with more context: windows would change the ids."""


def first_tokens(tokenizer, sources: Iterable, budget: int | None = None, *, special_tokens: bool = False) -> Tokens:
    """The first `budget` tokens (all when None) of the sources joined by SEPARATOR, as tokenizing that text
    whole gives them. special_tokens: with the tokenizer's BOS (and EOS, when the whole text is used), as
    `tokenizer(text, add_special_tokens=True)`."""
    sources = list(sources)
    head, tail = _specials(tokenizer) if special_tokens else ([], [])
    need = None if budget is None else max(budget - len(head or ()), 0)
    if head is None:  # special tokens not around the text: the tokenizer adds them itself, on the prefix
        got = _prefix(tokenizer, pieces(sources), budget, special_tokens=True)
    elif need == 0:
        got = Tokens(array("q"), 0, False, True, hashlib.sha256().hexdigest())
    else:
        try:
            got = _windowed(tokenizer, pieces(sources), need)
        except _NotLocal:
            got = _prefix(tokenizer, pieces(sources), need)
        got.ids[:0] = array("q", head)
        if got.exhausted:
            got.ids.extend(tail)
    if budget is not None:
        del got.ids[budget:]
    return got


def _specials(tokenizer) -> tuple[list | None, list]:
    """(before, after): the ids add_special_tokens=True puts around a text's own; (None, []) when they are not
    around it."""
    own = list(tokenizer("a", add_special_tokens=False)["input_ids"])
    full = list(tokenizer("a", add_special_tokens=True)["input_ids"])
    for i in range(len(full) - len(own) + 1):
        if full[i:i + len(own)] == own:
            return full[:i], full[i + len(own):]
    return None, []


def _encode(tokenizer, text: str, offsets: bool):
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=offsets, verbose=False)
    return enc["input_ids"], (enc["offset_mapping"] if offsets else None)


def _windowed(tokenizer, stream: Iterator[str], need: int | None) -> Tokens:
    out, h = array("q"), hashlib.sha256()
    buf, ctx, chars, done = "", 0, 0, False  # buf[:ctx] was used already: the next window's left context
    want = WINDOW if need is None else min(WINDOW, max(4096, 16 * need))
    while True:
        while not done and len(buf) - ctx < want + HOLD:
            piece = next(stream, None)
            if piece is None:
                done = True
            else:
                buf += piece
        last = done and len(buf) - ctx <= want + HOLD
        window = buf if last else buf[:ctx + want + HOLD]
        try:
            ids, offs = _encode(tokenizer, window, offsets=True)
        except NotImplementedError:  # a slow (Python) tokenizer has no offsets
            raise _NotLocal() from None
        i0 = _boundary(offs, ctx)
        if last:
            j, cut = len(ids), len(window)
        else:
            at = _cut(window, offs, i0, len(window) - HOLD)
            if at is None:  # no token boundary far enough from the end: a longer window
                want *= 2
                continue
            j, cut = at, offs[at - 1][1]
        out.extend(ids[i0:j])
        h.update(window[ctx:cut].encode("utf-8", "surrogatepass"))
        chars += cut - ctx
        if last or (need is not None and len(out) >= need):
            return Tokens(out, chars, last, True, h.hexdigest())
        keep = max(0, cut - CONTEXT)
        buf, ctx = buf[keep:], cut - keep
        want = WINDOW


def _boundary(offs, ctx: int) -> int:
    """Index of the first token at or after ctx, which must be a token boundary of this window too."""
    if ctx == 0:
        return 0
    i = 0
    while i < len(offs) and offs[i][0] < ctx:
        if offs[i][1] > ctx:
            raise _NotLocal()
        i += 1
    if i == 0:  # the left context gave no token: the window start is not where the text starts
        raise _NotLocal()
    return i


def _cut(text: str, offs, i0: int, limit: int) -> int | None:
    """Index j > i0 of the first token after a cut, the cut (end of token j - 1) at or before limit: before a
    single space between words if one is found, else any token boundary."""
    k = len(offs) - 1
    while k > i0 and offs[k][0] > limit:
        k -= 1
    other = None
    for j in range(k, max(i0, k - SCAN), -1):
        end, start = offs[j - 1][1], offs[j][0]
        if start < end or start <= offs[j - 1][0] or end <= offs[j - 1][0]:
            continue  # overlapping or empty offsets (bytes of one character): not a boundary
        if 0 < end < len(text) - 1 and text[end] == " " and not text[end - 1].isspace() \
                and not text[end + 1].isspace():
            return j
        other = other or j
    return other


def _prefix(tokenizer, stream: Iterator[str], need: int | None, *, special_tokens: bool = False) -> Tokens:
    """Tokenize the growing prefix (doubled each round) until it gives need + HOLD tokens or ends."""
    text, done, want = "", False, WINDOW
    while True:
        while not done and len(text) < want:
            piece = next(stream, None)
            if piece is None:
                done = True
            else:
                text += piece
        ids = tokenizer(text, add_special_tokens=special_tokens, verbose=False)["input_ids"]
        if done or (need is not None and len(ids) >= need + HOLD):
            return Tokens(array("q", ids), len(text), done, False,
                          hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest())
        want *= 2
