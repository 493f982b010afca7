"""Prompt log-probabilities over the OpenAI-compatible completions API: the request kvtool sends for one window and
the parsing of what comes back, for each server family (torch-free, no I/O: kvtool.eval.server sends them).

A family is data: how to tokenize, whether a prompt may be token ids, which response layout carries the prompt's
log-probabilities, each with its citation. Parsing yields one `Position` per prompt token: the log-probability of
that token given the tokens before it, and the top-k alternatives the server returned, keyed by token identity
("id:N" where the server names tokens by id, else the token's text as the server prints it).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any, Sequence

from kvtool.errors import InputError
from kvtool.model.engine_tables import newest_read


@dataclass(frozen=True)
class Family:
    name: str
    tokenize_path: str  # POST: text -> token ids
    detokenize_path: str  # POST: token ids -> text
    token_prompts: bool  # the completions prompt may be a list of token ids (else text, re-tokenized by the server)
    layout: str  # "prompt_logprobs" (vLLM, id-keyed) | "echo" (OpenAI legacy: token strings)
    max_logprobs: int | None  # the server's default cap on alternatives per token (None: no cap)
    source: str  # where the facts above are read


FAMILIES = {
    "vllm": Family(
        "vllm", "/tokenize", "/detokenize", True, "prompt_logprobs", 20,
        f"vLLM {newest_read('vllm')}: vllm/entrypoints/openai/completion/protocol.py (CompletionRequest.prompt_logprobs, "
        "return_token_ids; CompletionResponseChoice.prompt_logprobs: list[dict[int, Logprob] | None]), "
        "vllm/entrypoints/serve/tokenize/protocol.py (TokenizeCompletionRequest, TokenizeResponse), "
        "vllm/config/model.py (ModelConfig.max_logprobs = 20), vllm/sampling_params.py "
        "(SamplingParams._validate_logprobs refuses prompt_logprobs > max_logprobs)"),
    "llama-cpp-python": Family(
        "llama-cpp-python", "/extras/tokenize", "/extras/detokenize", False, "echo", None,
        "llama-cpp-python 0.3.36: llama_cpp/server/app.py (create_completion: a text prompt; /extras/tokenize, "
        "/extras/detokenize), llama_cpp/llama.py (Llama._create_completion: echo + logprobs, tokens keyed by "
        "text; the first prompt token's entry is null)"),
}

# llama-cpp-python 0.3.36, llama_cpp/llama.py, Llama._create_completion: with echo, the entries start at logits
# row 0 but at prompt token 0 only when the prompt starts with BOS (which it drops); without a BOS every entry is
# the distribution of the *next* token, paired with this one: the figures would be off by one position.
SHIFTED_WITHOUT_BOS = ("llama-cpp-python echoes prompt log-probabilities one position off when its model adds no "
                       "BOS token (llama_cpp/llama.py, Llama._create_completion, 0.3.36); start the server with "
                       "kv_overrides tokenizer.ggml.add_bos_token=bool:true, or score with vLLM")


@dataclass(frozen=True)
class Position:
    """One prompt token as the server scored it."""

    key: str  # the token's identity in `top`'s keys
    logprob: float  # log p(token | the tokens before it)
    top: dict[str, float]  # the alternatives returned (the top-k, and the token itself)
    k: int  # alternatives requested: the k-th largest value in `top` bounds every token not in it


def id_key(token_id: int) -> str:
    return f"id:{int(token_id)}"


def completion_request(family: Family, model: str, prompt: Sequence[int] | str, k: int) -> dict:
    """The body of POST /v1/completions that returns the prompt's log-probabilities with k alternatives each and
    generates one token (vLLM: max_tokens 1 with prompt_logprobs; llama-cpp-python: max_tokens 0 generates up to
    the context length, so 1)."""
    body: dict[str, Any] = {"model": model, "prompt": list(prompt) if family.token_prompts else prompt,
                            "max_tokens": 1, "temperature": 0.0}
    if family.layout == "prompt_logprobs":
        body.update({"prompt_logprobs": k, "return_token_ids": True})
    else:
        body.update({"echo": True, "logprobs": k})
    return body


def _finite(x, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x) or x > 1e-3:
        raise InputError(f"{where}: expected a log-probability, got {str(x)[:40]!r}")
    return max(float(x), -1e30)  # -inf (a masked token) as a finite floor


_TOKEN_ID = re.compile(r"[0-9]{1,18}")  # a token id as a JSON key: ASCII digits, no sign, bounded (never int("²"))
PROBABILITY_SLACK = 1e-3  # the alternatives' probabilities may sum past 1 by this much (float rounding), no more


def _row(top: dict[str, float], k: int, where: str) -> dict[str, float]:
    """One position's alternatives, checked against the request: at most k + 1 (the k asked for and the prompt
    token itself), and probabilities of distinct tokens summing to at most 1."""
    if len(top) > k + 1:
        raise InputError(f"{where}: {len(top)} alternatives for a request of {k} (and the prompt token)")
    total = math.fsum(math.exp(v) for v in top.values())
    if total > 1 + PROBABILITY_SLACK:
        raise InputError(f"{where}: the alternatives' probabilities sum to {total:.4g}, more than 1")
    return top


def _mismatch(where: str, got, sent) -> InputError:
    return InputError(f"{where}: the answer is for the token {str(got)[:40]!r} where the request sent "
                      f"{str(sent)[:40]!r}; an answer must be about the prompt it was sent")


def parse_positions(family: Family, response: Any, n_prompt: int, k: int,
                    expected: Sequence[int | str]) -> list[Position | None]:
    """The prompt's positions (None for the first, which has no context) from a completions response, for a
    prompt the server tokenized to n_prompt tokens (a leading BOS the server adds is not counted). `expected`:
    each prompt token as the family names it (vLLM: the ids sent; llama-cpp-python: each id's text as the server
    prints it), checked at every position: an answer about other tokens, in another order or with positions
    missing is refused, whatever its numbers. Raises InputError naming what is missing, malformed or mismatched."""
    try:
        choice = response["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise InputError("the response has no choices[0]") from None
    if not isinstance(choice, dict):
        raise InputError("choices[0] is not an object")
    if len(expected) != n_prompt:
        raise ValueError(f"{len(expected)} expected tokens for a prompt of {n_prompt}")  # a caller's bug
    if family.layout == "prompt_logprobs":
        rows = choice.get("prompt_logprobs")
        ids = choice.get("prompt_token_ids")
        if not isinstance(rows, list) or not isinstance(ids, list):
            raise InputError("choices[0]: no prompt_logprobs / prompt_token_ids (the server returns no prompt "
                             "log-probabilities)")
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InputError("choices[0].prompt_token_ids: expected a list of token ids")
        if len(rows) != len(ids) or len(ids) != n_prompt:
            raise InputError(f"choices[0]: {len(rows)} prompt_logprobs for {len(ids)} prompt tokens; expected "
                             f"{n_prompt}")
        for j, (got, sent) in enumerate(zip(ids, expected)):
            if got != sent:
                raise _mismatch(f"choices[0].prompt_token_ids[{j}]", got, sent)
        out: list[Position | None] = [None]
        for j in range(1, n_prompt):
            row = rows[j]
            where = f"choices[0].prompt_logprobs[{j}]"
            if not isinstance(row, dict):
                raise InputError(f"{where}: expected an object")
            top = {}
            for tid, lp in row.items():
                if not _TOKEN_ID.fullmatch(tid):
                    raise InputError(f"{where}: expected token ids as keys, got {tid[:40]!r}")
                value = lp.get("logprob") if isinstance(lp, dict) else None
                top[id_key(int(tid))] = _finite(value, f"{where}[{tid}].logprob")
            key = id_key(ids[j])
            if key not in top:
                raise InputError(f"{where}: no entry for the prompt token {ids[j]}")
            out.append(Position(key, top[key], _row(top, k, where), k))
        return out
    lp = choice.get("logprobs")
    if not isinstance(lp, dict) or not isinstance(lp.get("tokens"), list) \
            or not isinstance(lp.get("token_logprobs"), list) or not isinstance(lp.get("top_logprobs"), list):
        raise InputError("choices[0].logprobs: no tokens / token_logprobs / top_logprobs (the server returns no "
                         "prompt log-probabilities)")
    tokens, values, tops = lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]
    if min(len(tokens), len(values), len(tops)) < n_prompt:
        raise InputError(f"choices[0].logprobs: {min(len(tokens), len(values), len(tops))} echoed tokens for a "
                         f"prompt of {n_prompt}")
    for j in range(n_prompt):
        if tokens[j] != expected[j]:
            raise _mismatch(f"choices[0].logprobs.tokens[{j}]", tokens[j], expected[j])
    out = [None]
    for j in range(1, n_prompt):
        top = tops[j]
        where = f"choices[0].logprobs.top_logprobs[{j}]"
        if not isinstance(top, dict):
            raise InputError(f"{where}: expected an object")
        top = {str(t): _finite(v, where) for t, v in top.items()}
        value = _finite(values[j], f"choices[0].logprobs.token_logprobs[{j}]")
        top[tokens[j]] = value
        out.append(Position(tokens[j], value, _row(top, k, where), k))
    return out


def echoed_tokens(response: Any, n_prompt: int) -> list | None:
    """The first n_prompt echoed token names of an echo answer, or None where it has none (parse_positions says
    what is wrong with it)."""
    try:
        tokens = response["choices"][0]["logprobs"]["tokens"]
    except (KeyError, IndexError, TypeError):
        return None
    return tokens[:n_prompt] + [None] * (n_prompt - len(tokens)) if isinstance(tokens, list) else None


def tokenize_request(family: Family, model: str, text: str) -> dict:
    if family.name == "vllm":
        return {"model": model, "prompt": text, "add_special_tokens": True}
    return {"model": model, "input": text}


def parse_tokens(response: Any, what: str) -> list[int]:
    toks = response.get("tokens") if isinstance(response, dict) else None
    if not isinstance(toks, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
        raise InputError(f"{what}: the response has no list of token ids")
    return toks


def detokenize_request(family: Family, model: str, ids: Sequence[int]) -> dict:
    return {"model": model, "tokens": list(ids)}


def parse_text(response: Any, what: str) -> str:
    for name in ("text", "prompt"):  # llama-cpp-python: text; vLLM: prompt
        if isinstance(response, dict) and isinstance(response.get(name), str):
            return response[name]
    raise InputError(f"{what}: the response has no text")


def served_names(response: Any) -> list[str]:
    """The model names GET /v1/models lists."""
    data = response.get("data") if isinstance(response, dict) else None
    if not isinstance(data, list):
        raise InputError("/v1/models: the response has no data list")
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
