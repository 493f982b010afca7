"""Fixed-length windows over one token stream (Hugging Face "perplexity of fixed-length models").

Window i covers tokens [b_i, b_i + L) with b_i = i * S (the last window is moved back so it still
has L tokens when the stream is long enough). A window scores only the targets the previous
window did not reach, so every token 1..N-1 is scored exactly once, each with at least L - S
tokens of context (the first L with less). Token 0 has no context and is never scored.
The scored targets are always the *last* `n_scored` tokens of a window, which lets the model
compute logits only there (`logits_to_keep`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

from kvtool.errors import UsageError


@dataclass(frozen=True)
class Window:
    begin: int  # first input token (absolute position in the stream)
    end: int  # one past the last input token
    n_scored: int  # targets scored: positions end - n_scored .. end - 1

    @property
    def length(self) -> int:
        return self.end - self.begin

    @property
    def first_target(self) -> int:
        return self.end - self.n_scored


def check_window(max_length: int, stride: int) -> None:
    """The one bound no declaration holds: a window's step is shorter than the window."""
    if stride < 1 or stride >= max_length:
        raise UsageError(f"must be between 1 and max-length - 1 = {max_length - 1} (each window's first "
                         f"target needs one token of context), got {stride}", option="stride")


def windows(n_tokens: int, max_length: int, stride: int) -> list[Window]:
    """The windows over a stream of n_tokens; their n_scored sum to n_tokens - 1."""
    check_window(max_length, stride)
    out: list[Window] = []
    if n_tokens < 2:
        return out
    prev_end = 1  # token 0 is never a target
    begin = 0
    while prev_end < n_tokens:
        end = min(begin + max_length, n_tokens)
        b = max(0, end - max_length)  # last window: slide back to keep L tokens of input
        out.append(Window(b, end, end - prev_end))
        prev_end = end
        begin += stride
    return out


def batches(ws: list[Window], batch_size: int) -> Iterator[list[Window]]:
    """Consecutive windows of equal (length, n_scored) grouped so they stack into one tensor."""
    group: list[Window] = []
    for w in ws:
        if group and (len(group) >= batch_size or (w.length, w.n_scored) != (group[0].length, group[0].n_scored)):
            yield group
            group = []
        group.append(w)
    if group:
        yield group


def check_settings(*, max_length: int, stride: int | None, max_tokens: int | None, batch_size: int | None,
                   max_memory, device_map) -> int:
    """The window / batch / memory options `kvtool eval`'s plan and kvtool.eval.api.evaluate_many both check:
    each against its declaration (kvtool/options/eval.py: the line the CLI and a recipe print), then what
    spans two fields. Returns the stride."""
    from kvtool.options.eval import EvalOptions
    from kvtool.options.fields import check_fields

    check_fields(EvalOptions, max_length=max_length, stride=stride, max_tokens=max_tokens, batch_size=batch_size)
    stride = stride if stride is not None else max(1, max_length // 2)
    check_window(max_length, stride)
    if max_memory and not device_map:
        raise UsageError("goes with --device-map (it bounds what accelerate places on each device)",
                         option="max_memory")
    return stride
