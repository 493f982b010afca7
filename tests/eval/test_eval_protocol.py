"""kvtool's completions requests and its parser against vLLM 0.33.0's own protocol (verbatim excerpts in
tests/data/vllm/0.33.0/, copied by tests/data/vllm/extract.py): every field kvtool sends is one vLLM declares, the
response vLLM builds from its types parses, max_logprobs is vLLM's default and its validator refuses more."""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import types
from pathlib import Path

import pytest

from kvtool.errors import InputError
from kvtool.eval import protocol
from kvtool.eval.protocol import FAMILIES
from kvtool.model.engine_tables import newest_read

EXCERPTS = Path(__file__).resolve().parents[1] / "data" / "vllm" / newest_read("vllm")  # what FAMILIES cites
VLLM = FAMILIES["vllm"]
LLAMA = FAMILIES["llama-cpp-python"]


def _segments(source: str) -> dict[str, str]:
    text = (EXCERPTS / (source.replace("/", "__") + ".txt")).read_text(encoding="utf-8")
    assert text.startswith(f"# vLLM {newest_read('vllm')}, {source}")
    return {block.partition("\n")[0].split(" (lines")[0]: block.partition("\n")[2]
            for block in text.split("\n# --- ")[1:]}


def _fields(code: str) -> dict[str, str]:
    """name -> annotation of the annotated assignments at the top of an excerpt (a field, or a class's fields)."""
    tree = ast.parse(code)
    body = tree.body[0].body if isinstance(tree.body[0], ast.ClassDef) else tree.body
    return {n.target.id: ast.unparse(n.annotation) for n in body if isinstance(n, ast.AnnAssign)}


COMPLETION = _segments("vllm/entrypoints/openai/completion/protocol.py")
TOKENIZE = _segments("vllm/entrypoints/serve/tokenize/protocol.py")


def _request_fields() -> dict[str, str]:
    out = {}
    for name, code in COMPLETION.items():
        if name.startswith("CompletionRequest.") and not name.endswith("to_sampling_params"):
            out.update(_fields(code))
    return out


def test_every_field_kvtool_sends_is_a_completion_request_field():
    fields = _request_fields()
    body = protocol.completion_request(VLLM, "m", [1, 2, 3], 5)
    assert set(body) <= set(fields), set(body) - set(fields)
    assert fields["prompt_logprobs"] == "int | None" and fields["return_token_ids"] == "bool | None"
    assert "list[Annotated[int, Field(ge=0)]]" in fields["prompt"]  # token-id prompts: the windows as they are
    assert body["prompt"] == [1, 2, 3] and body["prompt_logprobs"] == 5 and body["max_tokens"] == 1


def test_prompt_logprobs_reach_the_sampling_params():
    code = COMPLETION["CompletionRequest.to_sampling_params"]
    assert "prompt_logprobs = self.prompt_logprobs" in code and "prompt_logprobs=prompt_logprobs," in code


def _logprob_class():
    ns = {"dataclass": dataclasses.dataclass}
    exec(compile(_segments("vllm/logprobs.py")["Logprob"], "vllm/logprobs.py:Logprob", "exec"), ns)  # noqa: S102
    return ns["Logprob"]


def _vllm_response(ids, rows):
    """A completions response as vLLM serializes it: CompletionResponseChoice.prompt_logprobs is
    list[dict[int, Logprob] | None] (JSON turns the int keys into strings), prompt_token_ids list[int]."""
    choice = _fields(COMPLETION["CompletionResponseChoice"])
    assert choice["prompt_logprobs"] == "list[dict[int, Logprob] | None] | None"
    assert choice["prompt_token_ids"] == "list[int] | None"
    logprob = _logprob_class()
    plp = [None] + [{tid: logprob(lp, rank, f"t{tid}") for tid, (lp, rank) in row.items()} for row in rows]
    payload = {"choices": [{"index": 0, "text": "x", "prompt_token_ids": ids,
                            "prompt_logprobs": [None if r is None else {t: dataclasses.asdict(v) for t, v in r.items()}
                                                for r in plp]}]}
    return json.loads(json.dumps(payload))


def test_vllm_prompt_logprobs_parse_by_token_id():
    ids = [7, 3, 9]
    rows = [{3: (-0.5, 1), 4: (-1.5, 2)}, {9: (-4.0, 12), 3: (-0.1, 1), 4: (-3.0, 2)}]
    pos = protocol.parse_positions(VLLM, _vllm_response(ids, rows), 3, 2, ids)
    assert pos[0] is None
    assert pos[1].key == "id:3" and pos[1].logprob == -0.5 and pos[1].top == {"id:3": -0.5, "id:4": -1.5}
    assert pos[2].key == "id:9" and pos[2].logprob == -4.0 and set(pos[2].top) == {"id:9", "id:3", "id:4"}


def test_vllm_response_without_the_prompt_token_is_refused():
    bad = _vllm_response([7, 3], [{4: (-1.5, 1)}])
    with pytest.raises(InputError, match="no entry for the prompt token 3"):
        protocol.parse_positions(VLLM, bad, 2, 1, [7, 3])
    with pytest.raises(InputError, match="expected 5"):
        protocol.parse_positions(VLLM, _vllm_response([7, 3], [{3: (-1.0, 1)}]), 5, 1, [7, 3, 1, 2, 3])
    with pytest.raises(InputError, match="no prompt log-probabilities"):
        protocol.parse_positions(VLLM, {"choices": [{"text": "x"}]}, 2, 1, [7, 3])


def test_echo_layout_parses_token_strings():
    """The OpenAI legacy layout (CompletionLogProbs: tokens, token_logprobs, top_logprobs), llama-cpp-python's."""
    fields = _fields(COMPLETION["CompletionLogProbs"])
    assert fields["top_logprobs"] == "list[dict[str, float] | None]" and fields["tokens"] == "list[str]"
    resp = {"choices": [{"logprobs": {"tokens": ["a", " b", " c", " d"], "token_logprobs": [None, -1.0, -2.0, -0.5],
                                      "top_logprobs": [None, {" x": -0.7}, {" c": -2.0, " y": -0.3}, {" d": -0.5}]}}]}
    pos = protocol.parse_positions(LLAMA, resp, 3, 1, ["a", " b", " c"])  # the generated 4th entry is not the prompt's
    assert len(pos) == 3 and pos[1].top == {" x": -0.7, " b": -1.0} and pos[2].key == " c"
    resp["choices"][0]["logprobs"]["token_logprobs"][2] = float("nan")
    with pytest.raises(InputError, match="expected a log-probability"):
        protocol.parse_positions(LLAMA, resp, 3, 1, ["a", " b", " c"])


def test_tokenize_and_detokenize_bodies_are_vllms():
    tok = _fields(TOKENIZE["TokenizeCompletionRequest"])
    assert set(protocol.tokenize_request(VLLM, "m", "hi")) <= set(tok)
    assert _fields(TOKENIZE["TokenizeResponse"])["tokens"] == "list[int]"
    assert set(protocol.detokenize_request(VLLM, "m", [1])) <= set(_fields(TOKENIZE["DetokenizeRequest"]))
    assert protocol.parse_text({"prompt": "hi"}, "/detokenize") == "hi"  # DetokenizeResponse.prompt
    router = _segments("vllm/entrypoints/serve/tokenize/api_router.py")
    assert f'"{VLLM.tokenize_path}"' in router["tokenize"] and f'"{VLLM.detokenize_path}"' in router["detokenize"]


def test_max_logprobs_is_vllms_default_and_its_validator_refuses_more():
    default = _segments("vllm/config/model.py")["ModelConfig.max_logprobs"]
    assert f"default={VLLM.max_logprobs}" in default
    assert "= ModelConfig.max_logprobs" in _segments("vllm/engine/arg_utils.py")["EngineArgs.max_logprobs"]

    class VLLMValidationError(ValueError):
        def __init__(self, msg, **kw):
            super().__init__(msg)

    ns = {"VLLMValidationError": VLLMValidationError, "MAX_LOGPROB_TOKEN_IDS": 1000}
    code = _segments("vllm/sampling_params.py")["SamplingParams._validate_logprobs"]
    exec(compile(code, "vllm/sampling_params.py:_validate_logprobs", "exec"), ns)  # noqa: S102
    validate = ns["_validate_logprobs"]
    config = types.SimpleNamespace(max_logprobs=VLLM.max_logprobs, get_vocab_size=lambda: 49152)

    def params(k):
        return types.SimpleNamespace(logprobs=None, logprob_token_ids=None, prompt_logprobs=k,
                                     prompt_logprob_token_ids=None, prompt_logprob_start=None)

    validate(params(VLLM.max_logprobs), config)
    with pytest.raises(VLLMValidationError, match="greater than max allowed: 20"):
        validate(params(VLLM.max_logprobs + 1), config)
    assert not math.isnan(VLLM.max_logprobs)


# --- an answer is checked against the request (issue 39, class 1) ---------------------------------------------
def _honest(ids, k=2):
    rows = [{t: (-1.0, 1), 999: (-2.0, 2)} for t in ids[1:]]
    return _vllm_response(list(ids), rows)


SENT = [5, 8, 13, 21, 34, 55]


def _lies(ids):
    """Answers about other tokens than the prompt sent, each consistent with itself (the rows name the ids the
    answer claims): off by N, reordered, a position dropped or repeated, one id changed anywhere."""
    n = len(ids)
    out = {f"off-by-{d}": [t + d for t in ids] for d in (1, -1, 7, 1000)}
    out.update({"reversed": ids[::-1], "rotated": ids[1:] + ids[:1], "sorted-desc": sorted(ids, reverse=True)})
    for j in range(n - 1):
        out[f"swap-{j}"] = ids[:j] + [ids[j + 1], ids[j]] + ids[j + 2:]
    for j in range(n):
        out[f"changed-{j}"] = ids[:j] + [ids[j] + 1] + ids[j + 1:]
        out[f"dropped-{j}-padded"] = ids[:j] + ids[j + 1:] + [ids[0]]
    assert all(lie != ids for lie in out.values())
    return out


@pytest.mark.parametrize("name, claimed", sorted(_lies(SENT).items()))
def test_a_vllm_answer_about_other_tokens_is_refused(name, claimed):
    with pytest.raises(InputError, match="the request sent"):
        protocol.parse_positions(VLLM, _honest(claimed), len(SENT), 2, SENT)


@pytest.mark.parametrize("j", range(len(SENT)))
def test_a_vllm_answer_with_a_position_dropped_is_refused(j):
    claimed = SENT[:j] + SENT[j + 1:]
    with pytest.raises(InputError, match="expected 6"):
        protocol.parse_positions(VLLM, _honest(claimed), len(SENT), 2, SENT)


def test_the_honest_answer_passes_the_same_check():
    pos = protocol.parse_positions(VLLM, _honest(SENT), len(SENT), 2, SENT)
    assert [p.key for p in pos[1:]] == [f"id:{t}" for t in SENT[1:]]


def _echo(tokens):
    return {"choices": [{"logprobs": {"tokens": list(tokens) + ["x"], "token_logprobs": [None] + [-1.0] * len(tokens),
                                      "top_logprobs": [None] + [{t: -1.0} for t in tokens[1:]] + [{"x": -0.5}]}}]}


@pytest.mark.parametrize("name, claimed", [
    ("changed-0", list("Xbcdef")), ("changed-3", list("abcXef")), ("changed-last", list("abcdeX")),
    ("reversed", list("fedcba")), ("rotated", list("bcdefa")), ("swap", list("abdcef")),
    ("dropped", list("abdefx"))])
def test_an_echo_answer_about_other_tokens_is_refused(name, claimed):
    with pytest.raises(InputError, match="the request sent"):
        protocol.parse_positions(LLAMA, _echo(claimed), 6, 2, list("abcdef"))


@pytest.mark.parametrize("row, said", [
    ({3: (-1.0, 1), 4: (-2.0, 2), 5: (-3.0, 3), 6: (-4.0, 4)}, "4 alternatives for a request of 2"),
    ({3: (-0.1, 1), 4: (-0.2, 2)}, "sum to 1.72"),
])
def test_alternatives_the_request_cannot_produce_are_refused(row, said):
    with pytest.raises(InputError, match=said):
        protocol.parse_positions(VLLM, _vllm_response([7, 3], [row]), 2, 2, [7, 3])


@pytest.mark.parametrize("key", ["-3", "abc", "\u00b2", "9" * 5000, "3.0", " 3", ""])
def test_a_row_key_that_is_no_token_id_is_one_error(key):
    key = json.loads(f'"{key}"')
    resp = {"choices": [{"prompt_token_ids": [7, 3], "prompt_logprobs": [None, {key: {"logprob": -1.0}}]}]}
    with pytest.raises(InputError, match="expected token ids as keys"):
        protocol.parse_positions(VLLM, resp, 2, 2, [7, 3])
