"""`kvtool eval --server`: the quality gate on what an engine serves, from its prompt log-probabilities
(torch-free: server against server needs neither torch nor transformers).

The text is tokenized by the server (its /tokenize), cut into the windows local eval uses (kvtool.eval.windows),
and each window is sent to POST /v1/completions asking for the log-probabilities of its prompt tokens with k
alternatives each (kvtool.eval.protocol). A family whose prompts must be text (llama-cpp-python) gets the window's
text, checked to tokenize back to the window's tokens (a window that does not, e.g. one that starts inside a
UTF-8 character, starts up to MAX_SHIFT tokens later: less context, the same scored tokens). The scored tokens
add to the sums local eval uses (kvtool.eval.sums); the KL divergence is the top-k estimator of
kvtool.eval.topk. A baseline server must tokenize the text into the same ids, else one line refuses.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtool import progress as kv_progress
from kvtool.errors import InputError, UsageError
from kvtool.eval import topk
from kvtool.eval.server import Server
from kvtool.eval.sums import Sums
from kvtool.eval.windows import Window, windows

MAX_SHIFT = 4  # tokens a text window's start may move so that its text tokenizes back to its tokens


@dataclass(frozen=True)
class ServedWindow:
    window: Window
    begin: int  # the first token sent (window.begin, or up to MAX_SHIFT later)
    prompt: object  # token ids or text, as the family takes it
    n_prompt: int  # prompt tokens the server scores (a BOS it adds itself not counted)


def prepare(server: Server, ids: list[int], w: Window) -> ServedWindow:
    """What to send for window w: its token ids, or its text when that text tokenizes back to them."""
    if server.family.token_prompts:
        return ServedWindow(w, w.begin, list(ids[w.begin:w.end]), w.length)
    bos = server.bos
    last = min(w.begin + MAX_SHIFT, w.first_target - 1)
    for begin in range(w.begin, last + 1):
        part = ids[begin:w.end]
        if bos is not None and part and part[0] == bos:
            part = part[1:]  # the server puts it back
        text = server.detokenize(part)
        if text is None:
            continue
        back = server.tokenize(text)
        if bos is not None and back[:1] == [bos]:
            back = back[1:]
        if back == part:
            return ServedWindow(w, begin, text, len(part))
    raise InputError(f"the text of tokens {w.begin}..{w.end - 1} does not tokenize back to those tokens, even "
                     f"starting up to {MAX_SHIFT} tokens later; choose another --max-length or --stride",
                     file=server.url, option=server.option)


def _scored(sw: ServedWindow, positions: list) -> list:
    """The positions of the window's scored targets (the last n_scored; the first prompt position has none)."""
    n = min(sw.window.n_scored, sw.n_prompt - 1)
    return positions[sw.n_prompt - n:sw.n_prompt]


def evaluate_served(cand: Server, base: Server | None, text: str, *, max_length: int, stride: int,
                    max_tokens: int | None, k: int, progress: bool | None = None) -> tuple[Sums, dict]:
    """Score cand (against base) on text; the sums and what the report says about how."""
    cand.connect()
    if base is not None:
        base.connect()
        if base.family is not cand.family:
            raise UsageError(f"{base.url} is {base.family.name} and {cand.url} {cand.family.name}: their tokens "
                             "are named differently, so their alternatives cannot be compared", option="baseline_server")
    ids = cand.tokenize(text)
    if base is not None and base.tokenize(text) != ids:
        raise UsageError(f"{base.model} at {base.url} and {cand.model} at {cand.url} tokenize the text "
                         "differently; they cannot be compared on the same tokens", field="tokenizer")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InputError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed", option="text")
    ws = windows(len(ids), max_length, stride)
    sums = Sums()
    moved = 0
    t0 = time.perf_counter()
    with kv_progress.task("eval (served)", total=len(ids) - 1, unit="tok", enabled=progress, rate=True) as bar:
        for w in ws:
            sw = prepare(cand, ids, w)
            moved += sw.begin != w.begin
            c = _scored(sw, cand.positions(sw.prompt, sw.n_prompt, k))
            b = _scored(sw, base.positions(sw.prompt, sw.n_prompt, k)) if base is not None else None
            _add(sums, c, b, k, cand)
            bar.update(w.n_scored)
    about = {"mode": "served", "server": cand.url, "family": cand.family.name, "top_logprobs": k,
             "windows": len(ws), "windows_moved": moved, "seconds": time.perf_counter() - t0,
             "kld_estimator": "top-k plus the remaining mass (docs/eval.md), biased low"}
    if base is not None:
        about["baseline_server"] = base.url
    return sums, about


def _text(texts) -> str:
    """The evaluation text as one string (the server tokenizes it): the built-in one, a str, or several texts
    joined by a blank line as local eval joins them (each a str, or a file read through its pieces())."""
    if texts is None:
        from kvtool.datasets import evaluation_text

        return evaluation_text()
    if isinstance(texts, str):
        return texts
    return "\n\n".join(t if isinstance(t, str) else "".join(t.pieces()) for t in texts)


def _add(sums: Sums, c: list, b: list | None, k: int, cand: Server) -> None:
    lc = np.array([p.logprob for p in c], dtype=np.float64)
    sums.nll.add(-lc)
    if b is None:
        return
    for pc, pb in zip(c, b):
        if pc.key != pb.key:
            raise InputError(f"the two servers name the same prompt token differently ({pb.key!r} and {pc.key!r})",
                             file=cand.url, field="tokenizer")
    lb = np.array([p.logprob for p in b], dtype=np.float64)
    sums.base_nll.add(-lb)
    sums.diff.add(lb - lc)
    sums.kld.add([topk.kld(pb.top, pc.top, k) for pb, pc in zip(b, c)])
    sums.top1.add([float(topk.top1(pb.top) == topk.top1(pc.top)) for pb, pc in zip(b, c)])
    sums.dp.add(np.exp(lc) - np.exp(lb))


def evaluate(model: str, *, server: str, baseline: str | None = None, baseline_server: str | None = None,
             texts=None, text_name: str | None = None, max_length: int = 1024, stride: int | None = None,
             max_tokens: int | None = None, top_logprobs: int = 20, timeout: float = 300.0, gates=None,
             progress: bool | None = None):
    """`kvtool eval MODEL --server URL [--baseline NAME] [--baseline-server URL]` as a library: the
    kvtool.eval.api.EvalReport of the model served under the name MODEL at URL, against the baseline served under
    NAME (default MODEL) at --baseline-server (default URL) when either is given."""
    from kvtool.eval.api import EvalReport

    stride = stride if stride is not None else max(1, max_length // 2)
    cand = Server(server, model, timeout=timeout, option="server")
    base = None
    if baseline is not None or baseline_server is not None:
        base = Server(baseline_server or server, baseline or model, timeout=timeout,
                      option="baseline_server" if baseline_server else "server")
    sums, about = evaluate_served(cand, base, _text(texts), max_length=max_length, stride=stride,
                                  max_tokens=max_tokens, k=top_logprobs, progress=progress)
    seconds, n_windows = about.pop("seconds"), about.pop("windows")
    r = EvalReport(model=f"{model} @ {cand.url}", label=None,
                   baseline=f"{base.model} @ {base.url}" if base is not None else None, metrics=sums.summary(),
                   windows=n_windows,
                   device=f"served by {cand.family.name}", dtype="as served", window=max_length, stride=stride,
                   batch_size=1, text=text_name or ("pydoc (built-in evaluation text)" if texts is None else "text"),
                   kv_cache_dtype="as served", kv_scales=None, seconds=seconds,
                   forwards_per_window=2 if base is not None else 1, memory=about)
    if gates:
        r.apply_gates(gates)
    return r
