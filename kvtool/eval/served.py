"""`kvtool eval --server`: the quality gate on what an engine serves, from its prompt log-probabilities
(torch-free: server against server needs neither torch nor transformers).

The text is tokenized by the server (its /tokenize), cut into the windows local eval uses (kvtool.eval.windows),
and each window is sent to POST /v1/completions asking for the log-probabilities of its prompt tokens with k
alternatives each (kvtool.eval.protocol). A family whose prompts must be text (llama-cpp-python) gets the window's
text, checked to tokenize back to the window's tokens (a window that does not, e.g. one that starts inside a
UTF-8 character, starts up to MAX_SHIFT tokens later: less context, the same scored tokens). The scored tokens
add to the sums local eval uses (kvtool.eval.sums); the KL divergence is the top-k estimator of
kvtool.eval.topk. A baseline server must tokenize the scored tokens (the first --max-tokens) into the same ids,
else one line refuses; every answer is checked against its request (kvtool.eval.protocol.parse_positions).

A mixed run has one side served and the other a local model folder (LocalSide, torch imported only then): the
served side tokenizes and cuts the windows, the local side runs exactly the served prompts (the engine's ids,
what it serves, whatever the local tokenizer makes of the text: where the two differ over the scored tokens the
report says how many and where, `compare_tokens`) and reports what a server would return for them (its top k and
the target, keyed as the server keys tokens), so the estimator and its measured bias are those of server against
server.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from kvtool import progress as kv_progress
from kvtool.errors import InputError, UsageError
from kvtool.eval import served_reads, topk
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
    ids: tuple = ()  # those tokens as ids (a local side runs them)
    bos: int | None = None  # the token the server puts before them itself (a local side does too)


def prepare(server: Server, ids: list[int], w: Window) -> ServedWindow:
    """What to send for window w: its token ids, or its text when that text tokenizes back to them."""
    if server.family.token_prompts:
        return ServedWindow(w, w.begin, list(ids[w.begin:w.end]), w.length, tuple(ids[w.begin:w.end]))
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
            return ServedWindow(w, begin, text, len(part), tuple(part), bos)
    raise InputError(f"the text of tokens {w.begin}..{w.end - 1} does not tokenize back to those tokens, even "
                     f"starting up to {MAX_SHIFT} tokens later; choose another --max-length or --stride",
                     file=server.url, option=server.option)


def _scored(sw: ServedWindow, positions: list) -> list:
    """The positions of the window's scored targets (the last n_scored; the first prompt position has none)."""
    n = min(sw.window.n_scored, sw.n_prompt - 1)
    return positions[sw.n_prompt - n:sw.n_prompt]


def evaluate_served(cand, base, text: str, *, max_length: int, stride: int, max_tokens: int | None, k: int,
                    progress: bool | None = None, served_kv_cache_dtype: str | None = None,
                    served_chunk: int | None = None) -> tuple[Sums, dict]:
    """Score cand (against base) on text; the sums and what the report says about how. Each side is a Server or,
    in a mixed run, a LocalSide (never both local): the served side tokenizes and cuts the windows, the other
    side must tokenize the text into the same ids. served_kv_cache_dtype / served_chunk: what the candidate's
    server (else the served baseline's) serves, where it does not tell (kvtool.eval.served_reads)."""
    served = cand if isinstance(cand, Server) else base
    served.connect()
    other = base if served is cand else cand
    if isinstance(other, Server):
        other.connect()
        if other.family is not served.family:
            raise UsageError(f"{base.url} is {base.family.name} and {cand.url} {cand.family.name}: their tokens "
                             "are named differently, so their alternatives cannot be compared", option="baseline_server")
    elif other is not None:
        other.connect(served)
    reads = served_reads.observe(served, declared_dtype=served_kv_cache_dtype, declared_chunk=served_chunk)
    ids = served.tokenize(text)
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if len(ids) < 2:
        raise InputError(f"the evaluation text has {len(ids)} token(s); at least 2 are needed", option="text")
    tokenization = None
    if other is not None:
        tokenization = compare_tokens(ids, other.tokenize(text))
        if tokenization["differ"] and (isinstance(other, Server) or tokenization["differ"] * 2 > len(ids)):
            raise UsageError(f"{other.model} at {other.url} and {served.model} at {served.url} tokenize the text "
                             f"differently: {tokenization['differ']} of the {len(ids)} tokens scored, the first at "
                             f"token {tokenization['first']}; they cannot be compared on the same tokens"
                             + ("" if isinstance(other, Server) else " (over half: not one vocabulary)"),
                             field="tokenizer")
        if isinstance(other, LocalSide):
            other.check_ids(ids)
    ws = windows(len(ids), max_length, stride)
    sums = Sums()
    moved = 0
    prefilled = []  # per window: (tokens the engine prefills, index of the first scored target, targets scored)
    t0 = time.perf_counter()
    with kv_progress.task("eval (served)", total=len(ids) - 1, unit="tok", enabled=progress, rate=True) as bar:
        for w in ws:
            sw = prepare(served, ids, w)
            moved += sw.begin != w.begin
            shift = 0 if sw.bos is None else 1  # a BOS the server puts first is a prefilled token too
            n = min(w.n_scored, sw.n_prompt - 1)
            prefilled.append((sw.n_prompt + shift, sw.n_prompt - n + shift, n))
            c = _scored(sw, cand.score(sw, k))
            b = _scored(sw, base.score(sw, k)) if base is not None else None
            _add(sums, c, b, k, served)
            bar.update(w.n_scored)
    local = other if isinstance(other, LocalSide) else None
    about = {"mode": "served" if local is None else "served+local", "server": served.url,
             "family": served.family.name, "top_logprobs": k, "windows": len(ws), "windows_moved": moved,
             "seconds": time.perf_counter() - t0, "kld_estimator": ESTIMATOR,
             "cache_reads": dict(served_reads.summary(reads, prefilled, max_length=max_length, stride=stride),
                                 side="candidate" if served is cand else "baseline")}
    if isinstance(base, Server):
        about["baseline_server"] = base.url
    if tokenization is not None:
        about["tokenization"] = tokenization
    if local is not None:
        about["local"] = {"side": "baseline" if local is base else "candidate", "model": local.model,
                          **local.describe()}
        about["kld_estimator"] += "; the local side truncated to its top k and the target as a server returns them"
    return sums, about


ESTIMATOR = "top-k plus the remaining mass (docs/eval.md), biased low"


def compare_tokens(served: list[int], other: list[int]) -> dict:
    """How the other side's tokenization of the text differs from the served side's over the tokens scored
    (served: the served side's ids, already cut to --max-tokens; other: the other side's ids of the whole text,
    compared only as far as they cover those tokens). differ: how many of the scored tokens lie in a stretch the
    two sides split differently; first: the position of the first (None: none). Both sides score the served
    side's ids whatever this says (the engine's ids are what it serves): docs/eval.md."""
    import difflib

    n = len(served)
    if other[:n] == served:
        return {"scored": n, "differ": 0, "first": None, "scored_ids": "the server's"}
    # the other side may split the same text into more or fewer tokens: enough of it to cover the scored span
    # (twice as many), and what it has beyond the span's end is not a difference
    ops = difflib.SequenceMatcher(None, served, other[:2 * n + 8], autojunk=False).get_opcodes()
    differ, first = 0, None
    for tag, i1, i2, _, _ in ops:
        if tag == "equal" or tag == "insert" and i1 == n:
            continue
        differ += max(i2 - i1, 1)  # the served tokens in the stretch (an extra token of the other side: 1)
        first = i1 if first is None else first
    return {"scored": n, "differ": differ, "first": first, "scored_ids": "the server's"}


class LocalSide:
    """The local side of a mixed run: a model folder run by transformers on the served side's windows (the same
    token ids, the BOS the server adds put in front as the server does), its positions keyed as the server keys
    its tokens and truncated to the top k and the target: what the server would return for it."""

    def __init__(self, folder: str, *, option: str, device: str = "auto", dtype: str = "auto",
                 kv_cache_dtype: str = "auto", kv_scales: str = "checkpoint", progress: bool | None = None):
        self.model = self.url = folder
        self.option, self.device, self.dtype, self.progress = option, device, dtype, progress
        self.kv_cache_dtype, self.kv_scales = kv_cache_dtype, kv_scales
        self.family = None
        self._pool = self._m = self._emu = self._names = None

    def connect(self, served: Server) -> "LocalSide":
        from kvtool.eval import api
        from kvtool.runtime.torch_utils import pick_device, pick_dtype

        if self.option == "baseline" and self.model in served.names:
            raise UsageError(f"{self.model!r} is a model folder here and a model {served.url} serves; name the "
                             "folder another way (./NAME) for the local one, or give --baseline-server URL for the "
                             "served one", option="baseline")
        self.family = served.family
        dev = pick_device(self.device)
        self._dtype = pick_dtype(self.dtype, dev)
        self._pool = api._ModelPool(dev, self._dtype, None, self.progress)
        self._m = self._pool.get(self.model, None)
        self._emu = api._emulation(api.Candidate(self.model, self.kv_cache_dtype, self.kv_scales), self._m)
        if self._m.tokenizer is None:
            raise UsageError("has no tokenizer; a mixed run checks that it tokenizes the text as the server does",
                             file=self.model, option=self.option)
        if not self.family.token_prompts:  # the server names tokens by their text: name the local ones alike
            self._names = _token_texts(self._m.tokenizer)
        self._bos = served.bos
        return self

    def check_ids(self, ids: list[int]) -> None:
        """The served ids must exist in the local model (its embedding rows): else the local side cannot run them."""
        rows = self._m.model.get_input_embeddings().weight.shape[0]
        bad = next((i for i in ids if not 0 <= i < rows), None)
        if bad is not None:
            raise UsageError(f"the server's token id {bad} is past the {rows} token embeddings of this model; it does "
                             "not share the server's vocabulary", file=self.model, field="tokenizer")

    def describe(self) -> dict:
        emu = self._emu
        return {"device": str(self._pool.device), "dtype": str(self._dtype).replace("torch.", ""),
                "kv_cache_dtype": emu.kv["dtype"] if emu else str(self._dtype).replace("torch.", ""),
                "kv_scales": emu.scales.describe() if emu else None, "kv_cache": emu.kv if emu else None}

    def tokenize(self, text: str) -> list[int]:
        """The text's ids as the local tokenizer gives them, with the server's own BOS (when it adds one) in front
        as the server's /tokenize gives it, so that the two lists compare."""
        ids = list(self._m.tokenizer(text, add_special_tokens=True)["input_ids"])
        if self._bos is not None and ids[:1] != [self._bos]:
            ids = [self._bos] + ids
        return ids

    def score(self, sw: ServedWindow, k: int) -> list:
        import contextlib

        import torch

        from kvtool.eval import api
        from kvtool.eval.protocol import Position, id_key

        ids = ([sw.bos] if sw.bos is not None else []) + list(sw.ids)
        n = sw.n_prompt - 1  # every prompt position after the first
        with torch.inference_mode(), (api._hooked(self._m, self._emu.hook) if self._emu else contextlib.nullcontext()):
            logits = self._m.logits(torch.tensor([ids], dtype=torch.long), n)
        lp = torch.log_softmax(logits[0].double(), dim=-1).cpu().numpy()  # [n, V]: predicts sw.ids[1:]
        out: list = [None]
        for j in range(1, sw.n_prompt):
            row, target = lp[j - 1], int(sw.ids[j])
            if self._names is None:
                top = topk.truncate(row, target, k)
                out.append(Position(id_key(target), top[id_key(target)], top, k))
                continue
            order = np.argsort(-row, kind="stable")[:k]
            top = {}
            for i in order:  # llama-cpp-python's order: the lower of two tokens with one text wins
                top[self._names[i]] = float(row[i])
            key = self._names[target]
            top[key] = float(row[target])
            out.append(Position(key, float(row[target]), top, k))
        return out


def _token_texts(tokenizer) -> list[str]:
    """Each id's text as llama-cpp-python prints it in top_logprobs (llama_cpp/llama.py 0.3.36,
    Llama._create_completion: detokenize([i]).decode("utf-8", errors="ignore"), special tokens as ""): the
    tokenizer's decoding of the one id, special tokens skipped, U+FFFD (half of a UTF-8 character) dropped."""
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=True)
    return [t.replace("\ufffd", "") for t in texts]


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
            raise InputError(f"the two sides name the same prompt token differently ({pb.key!r} and {pc.key!r})",
                             file=cand.url, field="tokenizer")
    lb = np.array([p.logprob for p in b], dtype=np.float64)
    sums.base_nll.add(-lb)
    sums.diff.add(lb - lc)
    sums.kld.add([topk.kld(pb.top, pc.top, k) for pb, pc in zip(b, c)])
    sums.top1.add([float(topk.top1(pb.top) == topk.top1(pc.top)) for pb, pc in zip(b, c)])
    sums.dp.add(np.exp(lc) - np.exp(lb))


def evaluate(model: str, *, server: str | None, baseline: str | None = None, baseline_server: str | None = None,
             texts=None, text_name: str | None = None, max_length: int = 1024, stride: int | None = None,
             max_tokens: int | None = None, top_logprobs: int = 20, timeout: float = 300.0, gates=None,
             progress: bool | None = None, local: dict | None = None, served_kv_cache_dtype: str | None = None,
             served_chunk: int | None = None):
    """`kvtool eval MODEL --server URL [--baseline NAME] [--baseline-server URL]` as a library: the
    kvtool.eval.api.EvalReport of the model served under the name MODEL at URL, against the baseline served under
    NAME (default MODEL) at --baseline-server (default URL) when either is given. Mixed runs (sides(): one side a
    local model folder): `--server URL --baseline FOLDER`, or `FOLDER --baseline-server URL --baseline NAME`;
    local: the local side's device, dtype, kv_cache_dtype and kv_scales. served_kv_cache_dtype / served_chunk:
    what the server serves where it does not tell (the report's `cache_reads`, kvtool.eval.served_reads)."""
    from kvtool.eval.api import EvalReport

    stride = stride if stride is not None else max(1, max_length // 2)
    cand, base = sides(model, server=server, baseline=baseline, baseline_server=baseline_server, timeout=timeout,
                       local=dict(local or {}, progress=progress))
    sums, about = evaluate_served(cand, base, _text(texts), max_length=max_length, stride=stride,
                                  max_tokens=max_tokens, k=top_logprobs, progress=progress,
                                  served_kv_cache_dtype=served_kv_cache_dtype, served_chunk=served_chunk)
    seconds, n_windows = about.pop("seconds"), about.pop("windows")
    served = cand if isinstance(cand, Server) else base
    r = EvalReport(model=_name(cand), label=None, baseline=_name(base) if base is not None else None,
                   metrics=sums.summary(), windows=n_windows,
                   device=f"served by {served.family.name}", dtype="as served", window=max_length, stride=stride,
                   batch_size=1, text=text_name or ("pydoc (built-in evaluation text)" if texts is None else "text"),
                   kv_cache_dtype="as served", kv_scales=None, seconds=seconds,
                   forwards_per_window=2 if base is not None else 1, memory=about)
    if gates:
        r.apply_gates(gates)
    return r


def _name(side) -> str:
    return f"{side.model} @ {side.url}" if isinstance(side, Server) else f"{side.model} (local)"


def sides(model: str, *, server: str | None, baseline: str | None, baseline_server: str | None, timeout: float,
          local: dict | None = None) -> tuple:
    """(candidate, baseline or None), each a Server or a LocalSide:
    --server URL                        candidate served as MODEL
      --baseline NAME                   baseline served as NAME on URL
      --baseline-server URL2 [--baseline NAME]   baseline served as NAME (default MODEL) on URL2
      --baseline FOLDER                 baseline: the local model folder (mixed); a FOLDER the server also serves
                                        by that name is refused as ambiguous when connecting
    FOLDER --baseline-server URL2 --baseline NAME   candidate: the local folder, baseline served (mixed)."""
    local = local or {}
    if server is None:
        if baseline_server is None:
            raise UsageError("no server: give --server or --baseline-server", option="server")
        if baseline is None:
            raise UsageError("names the baseline on --baseline-server; give it (the local candidate MODEL is a "
                             "folder, not a served name)", option="baseline")
        return (LocalSide(model, option="model", **local),
                Server(baseline_server, baseline, timeout=timeout, option="baseline_server"))
    cand = Server(server, model, timeout=timeout, option="server")
    if baseline_server is not None:
        return cand, Server(baseline_server, baseline or model, timeout=timeout, option="baseline_server")
    if baseline is None:
        return cand, None
    if local_folder(baseline):
        return cand, LocalSide(baseline, option="baseline", **local)
    return cand, Server(server, baseline, timeout=timeout, option="server")


def local_folder(path: str | None) -> bool:
    """A --baseline that names a model folder here (a config.json in it) is a local baseline."""
    from pathlib import Path

    return path is not None and (Path(path) / "config.json").is_file()
