"""What a served figure includes: whether vLLM's attention read each scored token's K/V back from its cache while
it computed the prompt log-probabilities `kvtool eval --server` scores (per --kv-cache-dtype, cited: the `reads` of
kvtool/model/kv_emulations.json, kv_emulations.reads()). No torch.

Decoding writes every token into the cache and attends over the cache; local eval scores the model that way. A
prefill chunk instead may attend over its own K/V as computed (`raw`): for TurboQuant and UltraQuant the first
chunk always does, Octave does for chunks over 128 tokens. Earlier chunks of a request are read from the cache by
every backend. So how much of a served window went through the cache depends on the dtype and on the chunk the
server's scheduler prefills at once (vLLM `--max-num-batched-tokens` with chunked prefill; a prompt_logprobs
request never reads the prefix cache: kv_emulations.json `prompt_logprobs_skip_prefix_cache_citation`).

`observe` asks the server what it can tell: the cache dtype (vLLM's /metrics `vllm:cache_config_info`) and the
chunk (its /server_info, present only with VLLM_SERVER_DEV_MODE=1); `--served-kv-cache-dtype` / `--served-chunk`
declare what it does not tell (a declaration the server contradicts is refused). `account` counts the scored
tokens whose attention read every key from the cache, only the earlier chunks', or none.
"""

from __future__ import annotations

import re
from typing import Any, Mapping

from kvtool.errors import InputError, UsageError
from kvtool.model.engine_tables import Citation, citation
from kvtool.model.kv_emulations import Reads, reads_of, skip_prefix_cache_citation

METRIC = "vllm:cache_config_info"
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


# --- what the server tells -----------------------------------------------------------------------------------

def metrics_cache_dtype(text: str) -> str | None:
    """The cache_dtype label of vLLM's `vllm:cache_config_info` gauge in a Prometheus /metrics text (None: absent)."""
    for line in text.splitlines():
        if line.startswith(METRIC + "{"):
            labels = dict(_LABEL.findall(line[len(METRIC) + 1:line.rfind("}")]))
            if labels.get("cache_dtype"):
                return labels["cache_dtype"]
    return None


def server_info_facts(info: Any) -> dict:
    """From vLLM's /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1): cache_dtype and the prefill chunk
    (max_num_batched_tokens when chunked prefill is on; None when it is off: a prompt is prefilled whole)."""
    cfg = info.get("vllm_config") if isinstance(info, dict) else None
    if not isinstance(cfg, dict):
        return {}
    out: dict = {}
    cache = cfg.get("cache_config")
    if isinstance(cache, dict) and isinstance(cache.get("cache_dtype"), str):
        out["cache_dtype"] = cache["cache_dtype"]
    sched = cfg.get("scheduler_config")
    if isinstance(sched, dict) and isinstance(sched.get("max_num_batched_tokens"), int):
        chunked = sched.get("enable_chunked_prefill")
        if isinstance(chunked, bool):
            out["chunk"] = sched["max_num_batched_tokens"] if chunked else 0  # 0: whole prompts
    return out


def observe(server, *, declared_dtype: str | None, declared_chunk: int | None) -> dict:
    """The served dtype and prefill chunk: what the server tells (vLLM only), else what was declared.
    {"kv_cache_dtype", "dtype_from", "chunk" (None: whole prompts), "chunk_from"}."""
    told: dict = {}
    sources: dict = {}
    if server.family is not None and server.family.name == "vllm":
        text = _optional(server, "/metrics", text=True)
        if isinstance(text, str):
            dtype = metrics_cache_dtype(text)
            if dtype:
                told["cache_dtype"], sources["cache_dtype"] = dtype, f"the server's /metrics {METRIC}"
        info = _optional(server, "/server_info?config_format=json")
        for key, value in server_info_facts(info).items():
            told.setdefault(key, value)
            sources.setdefault(key, "the server's /server_info")
    if declared_dtype is not None and "cache_dtype" in told and told["cache_dtype"] != declared_dtype:
        raise UsageError(f"{server.url} serves kv_cache_dtype {told['cache_dtype']!r} ({sources['cache_dtype']}), "
                         f"not {declared_dtype!r}", option="served_kv_cache_dtype")
    if declared_chunk is not None and told.get("chunk") not in (None, declared_chunk):
        said = told["chunk"] or "whole prompts (chunked prefill off)"
        raise UsageError(f"{server.url} prefills {said} ({sources['chunk']}), not chunks of {declared_chunk}",
                         option="served_chunk")
    dtype = told.get("cache_dtype", declared_dtype)
    chunk = told.get("chunk", declared_chunk)
    return {"kv_cache_dtype": dtype,
            "dtype_from": sources.get("cache_dtype") or ("--served-kv-cache-dtype" if dtype else None),
            "chunk": chunk or None,
            "chunk_from": sources.get("chunk") or ("--served-chunk" if declared_chunk else None)}


def _optional(server, path: str, text: bool = False):
    """An endpoint that only tells more: absent, refused or malformed, it tells nothing (None), never an error
    (a server may sit behind a proxy that serves only the OpenAI routes; --server-timeout still bounds it)."""
    try:
        return server.request(path, text=text, missing_ok=True)
    except InputError:
        return None


# --- what the scored tokens read -----------------------------------------------------------------------------

def account(row: Reads | None, windows, chunk: int | None) -> dict:
    """Count the scored tokens by what their attention read from the cache: "cache" every key, "prefix" only the
    earlier chunks' keys (its own chunk raw), "raw" none; "unknown" where the row is unknown. windows: served
    windows as (tokens the engine prefills, prompt index of the first scored target, scored targets); the target
    at prompt index j is scored by the query at j - 1. chunk None: each window is prefilled whole."""
    counts = {"cache": 0, "prefix": 0, "raw": 0, "unknown": 0}
    for n_prompt, first_target, n_scored in windows:
        size = chunk or n_prompt
        for j in range(first_target, first_target + n_scored):
            c = (j - 1) // size
            length = min(size, n_prompt - c * size)
            own = None if row is None else row.own_chunk_cached(c == 0, length)
            if own is None:
                counts["unknown"] += 1
            elif own:
                counts["cache"] += 1
            else:
                counts["prefix" if c > 0 else "raw"] += 1
    return counts


def summary(facts: dict, windows, *, max_length: int, stride: int) -> dict:
    """The report's `cache_reads`: facts (observe) + the row, its citation and the token counts, and whether the
    figure includes the cache's cost: "all" | "part" | "none" | "no cost" (auto) | "unknown"."""
    name = facts["kv_cache_dtype"]
    row = reads_of(name) if name else None
    counts = account(row, windows, facts["chunk"])
    scored = sum(counts.values())
    if row is None or counts["unknown"]:
        includes = "unknown"
    elif row.lossless:
        includes = "no cost"
    elif counts["cache"] == scored:
        includes = "all"
    elif counts["cache"] or counts["prefix"]:
        includes = "part"
    else:
        includes = "none"
    out = dict(facts, tokens=counts, includes_cache_cost=includes,
               prefix_cache="not read: vLLM skips it for prompt_logprobs requests "
                            f"({_cite(skip_prefix_cache_citation())})")
    if row is not None:
        out.update(first=row.first, later=row.later, citation=row.citation.as_json())
        if row.why:
            out["why"] = row.why
    if includes in ("part", "none", "unknown"):
        out["advice"] = advice(row, max_length=max_length, stride=stride)
    return out


def advice(row: Reads | None, *, max_length: int, stride: int) -> str:
    """How to put every scored token through the cache, for a row that reads raw K/V somewhere."""
    context = max_length - stride - 1  # a window's first scored target is scored by the query at overlap - 1
    later = row.later if row is not None and isinstance(row.later, int) else None
    small = min(later, context) if later else context
    if small < 1:
        return ("give eval a --stride well below --max-length and serve with chunked prefill and "
                "--max-num-batched-tokens under the windows' overlap, so each window's first chunk holds only "
                "unscored context")
    return (f"serve with --enable-chunked-prefill --max-num-batched-tokens {small} (under the windows' overlap "
            f"--max-length - --stride = {context + 1}, so each window's first chunk holds only context"
            + (f"; at most {later}, the longest chunk this dtype reads back from its cache" if later else "")
            + "; the first window's first chunk stays raw) and pass --served-chunk if the server does not tell it")


def _cite(c: Citation | Mapping[str, str]) -> str:
    """A citation, or its JSON form (a report's summary), as the report cites it."""
    return (c if isinstance(c, Citation) else citation(c)).cited("vLLM")


def line(s: dict) -> str:
    """The report's one line about it."""
    name = s["kv_cache_dtype"]
    if not name:
        return ("cache     served kv_cache_dtype not known (the server does not tell it; --served-kv-cache-dtype "
                "declares it): for a dtype whose first prefill chunk attends over raw K/V (TurboQuant, UltraQuant; "
                "Octave over 128 tokens) the figure leaves the cache's cost out for each window's first chunk")
    t = s["tokens"]
    scored = sum(t.values())
    chunk = f"chunks of {s['chunk']} ({s['chunk_from']})" if s["chunk"] else (
        "each window in one chunk" + (f" ({s['chunk_from']})" if s["chunk_from"] else
                                      " (assumed: the server does not tell its chunk; --served-chunk declares it)"))
    head = f"cache     served {name} ({s['dtype_from']}), {chunk}: "
    inc = s["includes_cache_cost"]
    if inc == "no cost":
        return head + "the cache holds the model's dtype (nothing to include)"
    if inc == "unknown":
        return head + f"what its prefill reads is not known ({s.get('why', 'no reads row in kvtool/model/kv_emulations.json')})"
    body = (f"{t['cache']} of {scored} scored tokens read every K/V back from the cache"
            + (f", {t['prefix']} only earlier chunks' (their own chunk raw)" if t["prefix"] else "")
            + (f", {t['raw']} none (first chunk, raw K/V)" if t["raw"] else "")
            + f" ({_cite(s['citation'])})")
    if inc == "all":
        return head + body + ": the figure includes the cache's cost"
    left = "part of the cache's cost" if inc == "part" else "the cache's cost"
    return head + body + f": the figure leaves {left} out; " + s["advice"]
