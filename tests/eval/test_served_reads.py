"""What vLLM's attention reads while it prefills, per --kv-cache-dtype (the `reads` of kvtool/model/kv_emulations.json:
each emulated row's and not_emulated's; kv_emulations.reads()), checked
against verbatim excerpts of the cited functions (tests/data/vllm/reads/<release>/, tests/data/vllm/extract.py
--reads), and the accounting `kvtool eval --server` reports from it (kvtool.eval.served_reads). vLLM's CPU build
itself is asked in tests/oracle/test_vllm_lane.py."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

from kvtool.errors import UsageError
from kvtool.eval import served_reads
from kvtool.eval.windows import windows
from kvtool.model import kv_dtypes, kv_emulations
from kvtool.model.engine_tables import Citation

DATA = Path(__file__).resolve().parent.parent / "data" / "vllm" / "reads"

# The code that makes each claim true, in the cited function: a first chunk over raw K/V passes the batch's own
# key / value to the kernel; a cache read passes the paged cache. (A backend whose claim is not here fails
# test_every_cited_function_shows_its_claim: add its line when a row cites a new function.)
EVIDENCE = {
    "TurboQuantAttentionImpl._prefill_attention": ("k=key,", "if q_len == seq_len:", "k=k_seq,",
                                                   "q_len <= _CONTINUATION_DECODE_THRESHOLD"),
    "UltraQuantAttentionImpl._prefill_attention": ("k=key,", "if q_len == seq_len:", "k=k_seq,",
                                                   "q_len <= _CONTINUATION_DECODE_THRESHOLD"),
    "RocmOctaveAttentionImpl.forward": ("if attn_metadata.max_query_len <= _DECODE_MAX_QUERY_LEN:",
                                        "self._prefill(out, q, key, value, kv_cache, attn_metadata)"),
    "RocmOctaveAttentionImpl._prefill": ("k_rot = key[ndt:n]", "kv_cache,"),
    "TritonAttentionImpl.forward": ("k=key_cache,", "v=value_cache,"),
    "FlashAttentionImpl.forward": ("k=key_cache,", "v=value_cache,"),
    "FlashInferImpl.forward": ("kv_cache_for_fi = kv_cache_tuple", "prefill_wrapper.run(\n"),
    "FlashMLASparseImpl.forward_mqa": ("kv_c_and_k_pe_cache: torch.Tensor,",),
    "CPUAttentionBackendImpl.forward": ("key_cache=key_cache,", "value_cache=value_cache,"),
    "CacheDType": (),
}


def _excerpt(citation: Citation) -> str:
    path = DATA / citation.release / (citation.file.replace("/", "__") + ".txt")
    assert path.is_file(), f"no excerpt {path} (tests/data/vllm/extract.py --reads)"
    return path.read_text(encoding="utf-8")


def _function(citation: Citation) -> tuple[str, str]:
    """(qualified name, its excerpted source) of the citation's first function."""
    name = citation.function.split(" (")[0].split(", ")[0]
    if name == "CacheDType":  # a module constant: the cache config excerpt of tests/data/vllm/0.33.0
        text = (DATA.parent / citation.release / "vllm__config__cache.py.txt").read_text(encoding="utf-8")
        return name, text
    text = _excerpt(citation)
    parts = re.split(r"^# --- (\S+) \(lines \d+-\d+\)$", text, flags=re.M)
    found = dict(zip(parts[1::2], parts[2::2]))
    assert name in found, f"{citation.file}: {name} is not excerpted"
    return name, found[name]


def _constant(release: str, file: str, name: str) -> int:
    text = _excerpt(Citation(release, file, name))
    tree = ast.parse(text)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{file}: {name} not excerpted")


def test_every_dtype_vllm_accepts_has_a_row():
    assert set(kv_emulations.reads()) == set(kv_dtypes.names())


def test_every_cited_function_shows_its_claim():
    for name, row in kv_emulations.reads().items():
        func, source = _function(row.citation)
        assert func in EVIDENCE, (name, func)
        for snippet in EVIDENCE[func]:
            assert snippet in source, (name, func, snippet)
        if row.first is None:
            assert f'"{name}"' in source  # vLLM accepts the name, yet no backend of the tree lists it


def test_the_raw_first_chunks_are_the_fast_paths_over_the_batch_own_kv():
    raw = {n for n, r in kv_emulations.reads().items() if r.first == "raw"}
    assert raw == {"turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc",
                   "ultraquant_4bit"}
    for n in raw:
        _, source = _function(kv_emulations.reads_of(n).citation)
        # the first chunk: every K/V of the request is in this batch, and attention is over them as computed
        assert "attn_metadata.max_query_len == attn_metadata.max_seq_len" in source


def test_the_thresholds_are_vllms_constants():
    tq = _constant("0.33.0", "vllm/v1/attention/backends/turboquant_attn.py", "_CONTINUATION_DECODE_THRESHOLD")
    octave = _constant("0.33.0", "vllm/v1/attention/backends/rocm_octave_attn.py", "_DECODE_MAX_QUERY_LEN")
    for name, row in kv_emulations.reads().items():
        if name.startswith(("turboquant_", "ultraquant_")):
            assert (row.first, row.later) == ("raw", tq), name
        if name.startswith("octave_"):
            assert (row.first, row.later) == (octave, octave), name
    assert not any(isinstance(r.first, int) or isinstance(r.later, int) for n, r in kv_emulations.reads().items()
                   if not n.startswith(("turboquant_", "ultraquant_", "octave_")))


def test_a_prompt_logprobs_request_skips_the_prefix_cache():
    c = kv_emulations.skip_prefix_cache_citation()
    _, source = _function(c)
    assert "self.skip_reading_prefix_cache = (\n    self.prompt_logprobs is not None" in source.replace("        ", "")


def test_the_cpu_build_reads_its_cache_for_every_token():
    cpu = kv_emulations.cpu_reads()
    _, source = _function(cpu["citation"])
    assert (cpu["first"], cpu["later"]) == ("cache", "cache")
    assert "ops.cpu_attention_with_kv_cache(" in source and "key[" not in source.split("cpu_attention_with_kv_cache")[1]
    listed = _function(dataclasses.replace(cpu["citation"], function="CPUAttentionBackend.supported_kv_cache_dtypes"))[1]
    assert set(re.findall(r'"(\w+)"', listed.split("= [", 1)[1])) == set(cpu["dtypes"])


# --- the accounting ----------------------------------------------------------------------------------------

def _served(n_tokens: int, max_length: int, stride: int) -> list:
    return [(w.length, w.length - w.n_scored, w.n_scored) for w in windows(n_tokens, max_length, stride)]


def test_one_chunk_turboquant_reads_no_scored_token_from_the_cache():
    ws = _served(1024, 256, 255)
    counts = served_reads.account(kv_emulations.reads_of("turboquant_k8v4"), ws, None)
    assert counts == {"cache": 0, "prefix": 0, "raw": 1023, "unknown": 0}


def test_short_later_chunks_read_everything_back_and_the_first_stays_raw():
    row = kv_emulations.reads_of("turboquant_3bit_nc")
    ws = _served(256, 256, 255)  # one window: targets 1..255, queries 0..254
    assert served_reads.account(row, ws, 64) == {"cache": 255 - 64, "prefix": 0, "raw": 64, "unknown": 0}
    assert served_reads.account(row, ws, 200) == {"cache": 55, "prefix": 0, "raw": 200, "unknown": 0}  # 56 left
    # a later chunk over 128 tokens attends over its own K/V raw, over the earlier chunk from the cache
    ws = _served(400, 400, 399)
    assert served_reads.account(row, ws, 200) == {"cache": 0, "prefix": 199, "raw": 200, "unknown": 0}


def test_a_chunk_shorter_than_the_overlap_puts_every_scored_token_through_the_cache():
    """The target at prompt index j is scored by the query at j - 1: the first scored target of a window after the
    first is at index overlap = max_length - stride, so a chunk of overlap - 1 tokens holds only context."""
    row = kv_emulations.reads_of("turboquant_k8v4")
    ws = _served(2048, 256, 128)[1:]  # windows after the first score only their last 128 targets
    assert served_reads.account(row, ws, 127)["cache"] == sum(n for *_, n in ws)
    assert served_reads.account(row, ws, 128)["raw"] == len(ws)  # one token each in the first chunk
    assert "--max-num-batched-tokens 127" in served_reads.advice(row, max_length=256, stride=128)


def test_octave_reads_a_short_first_chunk_from_the_cache():
    row = kv_emulations.reads_of("octave_k3v4")
    ws = _served(256, 256, 255)
    assert served_reads.account(row, ws, 128) == {"cache": 255, "prefix": 0, "raw": 0, "unknown": 0}
    assert served_reads.account(row, ws, None)["raw"] == 255


def test_summary_says_whether_the_figure_includes_the_cache():
    ws = _served(512, 256, 255)
    facts = {"kv_cache_dtype": "fp8", "dtype_from": "x", "chunk": None, "chunk_from": None}
    assert served_reads.summary(facts, ws, max_length=256, stride=255)["includes_cache_cost"] == "all"
    s = served_reads.summary(dict(facts, kv_cache_dtype="turboquant_k8v4"), ws, max_length=256, stride=255)
    assert s["includes_cache_cost"] == "none" and "--max-num-batched-tokens" in s["advice"]
    assert "leaves the cache's cost out" in served_reads.line(s)
    s = served_reads.summary(dict(facts, kv_cache_dtype="turboquant_k8v4", chunk=64), ws, max_length=256, stride=255)
    assert s["includes_cache_cost"] == "part" and s["tokens"]["raw"] == 2 * 64
    assert "leaves part of the cache's cost out" in served_reads.line(s)
    assert served_reads.summary(dict(facts, kv_cache_dtype="auto"), ws, max_length=256,
                                stride=255)["includes_cache_cost"] == "no cost"
    s = served_reads.summary(dict(facts, kv_cache_dtype=None), ws, max_length=256, stride=255)
    assert s["includes_cache_cost"] == "unknown" and "not known" in served_reads.line(s)


# --- what the server tells -----------------------------------------------------------------------------------

METRICS = (DATA / "0.32.0" / "metrics.txt")


def test_the_cache_dtype_is_read_from_vllms_metrics():
    """A /metrics text vLLM's CPU build 0.32.0 served (the lane, --kv-cache-dtype auto), cut around its info gauge."""
    assert served_reads.metrics_cache_dtype(METRICS.read_text(encoding="utf-8")) == "auto"
    assert served_reads.metrics_cache_dtype("# HELP x\nvllm:other{a=\"b\"} 1\n") is None


class _Stub:
    url = "http://stub"
    option = "server"

    def __init__(self, metrics: str | None, info: dict | None):
        from kvtool.eval.protocol import FAMILIES

        self.family = FAMILIES["vllm"]
        self.answers = {"/metrics": metrics, "/server_info?config_format=json": info}

    def request(self, path, body=None, *, missing_ok=False, text=False):
        return self.answers[path]


def test_observe_prefers_what_the_server_tells_and_refuses_a_contradiction():
    metrics = METRICS.read_text(encoding="utf-8")
    info = {"vllm_config": {"cache_config": {"cache_dtype": "auto"},
                            "scheduler_config": {"max_num_batched_tokens": 64, "enable_chunked_prefill": True}}}
    f = served_reads.observe(_Stub(metrics, info), declared_dtype=None, declared_chunk=None)
    assert (f["kv_cache_dtype"], f["chunk"]) == ("auto", 64) and "/metrics" in f["dtype_from"]
    assert "/server_info" in f["chunk_from"]
    with pytest.raises(UsageError, match="serves kv_cache_dtype 'auto'"):
        served_reads.observe(_Stub(metrics, None), declared_dtype="turboquant_k8v4", declared_chunk=None)
    with pytest.raises(UsageError, match="prefills 64"):
        served_reads.observe(_Stub(None, info), declared_dtype=None, declared_chunk=128)
    f = served_reads.observe(_Stub(None, None), declared_dtype="turboquant_k8v4", declared_chunk=32)
    assert f == {"kv_cache_dtype": "turboquant_k8v4", "dtype_from": "--served-kv-cache-dtype", "chunk": 32,
                 "chunk_from": "--served-chunk"}
    off = {"vllm_config": {"scheduler_config": {"max_num_batched_tokens": 2048, "enable_chunked_prefill": False}}}
    assert served_reads.observe(_Stub(None, off), declared_dtype=None, declared_chunk=None)["chunk"] is None


def test_one_table_holds_the_reads_emulated_rows_derive_first_prefill_from_it():
    """The reads live in one table: an emulated dtype's in its kv_emulations.json row (what local eval reports as
    first_prefill derives from it: a threshold row reads raw above it, so raw), the others' in not_emulated."""
    table = kv_emulations.table()
    for name, reads in kv_emulations.reads().items():
        row = table.get(name)
        if row is None:
            assert name in ("auto", "float16", "bfloat16", "fp8_inc"), name  # lossless, or served by no backend
            continue
        assert row.reads is reads, name
        assert row.first_prefill == ("cache" if reads.first == "cache" else "raw"), (name, reads.first)
    assert table["octave_k3v4"].first_prefill == "raw" and table["fp8_e5m2"].first_prefill == "cache"
