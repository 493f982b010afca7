"""A server's answers are untrusted input: a tiny http.server speaking vLLM's protocol (a protocol test beside the
real-engine tests of test_eval_served.py) answers /v1/completions with hostile bodies, chosen by the model name.
Each is one line naming the URL and --server, exit 2; an honest answer from the same server scores (exit 0), so
the refusals are the bodies', not the server's."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from kvtool.cli import main
from kvtool.eval.server import response_limit

WINDOW = ["--max-length", "16", "--stride", "8", "--max-tokens", "40"]


def _rows(prompt: list[int], value=-1.0) -> list:
    return [None] + [{str(t): {"logprob": value, "rank": 1}, "999": {"logprob": -2.0, "rank": 2}} for t in prompt[1:]]


def _completion(model: str, prompt: list[int]) -> bytes:
    choice = {"index": 0, "text": "x", "prompt_token_ids": prompt, "prompt_logprobs": _rows(prompt)}
    if model == "nan":
        choice["prompt_logprobs"] = _rows(prompt, float("nan"))
    elif model == "positive":
        choice["prompt_logprobs"] = _rows(prompt, 0.5)
    elif model == "infinity":
        choice["prompt_logprobs"] = _rows(prompt, float("inf"))
    elif model == "string-ids":
        choice["prompt_token_ids"] = [str(t) for t in prompt]
    elif model == "oversize":  # honest numbers, padded past what the request can produce
        limit = response_limit("/v1/completions", {"prompt": prompt, "prompt_logprobs": 20})
        choice["padding"] = "x" * limit
    elif model == "deep":
        return b"[" * 200_000 + b"]" * 200_000
    return json.dumps({"id": "c", "object": "text_completion", "model": model, "choices": [choice]}).encode()


MODELS = ("honest", "nan", "positive", "infinity", "string-ids", "oversize", "deep")


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):  # quiet
        pass

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # kvtool refused mid-body and closed (a deep nest): fine,
            pass  # and socketserver's traceback would land in the captured stderr the test reads

    def do_GET(self):  # noqa: N802 - http.server's name
        self._send(json.dumps({"object": "list", "data": [{"id": m} for m in MODELS]}).encode())

    def do_POST(self):  # noqa: N802
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path == "/tokenize":  # one id per character, no BOS
            self._send(json.dumps({"tokens": [2 + ord(c) % 50 for c in req["prompt"]]}).encode())
        elif self.path == "/v1/completions":
            self._send(_completion(req["model"], req["prompt"]))
        else:
            self.send_error(404)


@pytest.fixture(scope="module")
def hostile():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()
    t.join()


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    p = tmp_path_factory.mktemp("text") / "t.txt"
    p.write_text("The quick brown fox jumps over the lazy dog. " * 3, encoding="utf-8")
    return str(p)


def test_an_honest_answer_scores(hostile, text, capsys):
    rc = main(["eval", "honest", "--server", hostile, "--text", text, *WINDOW, "--format", "json"])
    out, err = capsys.readouterr()
    d = json.loads(out)
    assert rc == 0 and d["tokens"] == 39 and abs(d["ppl"] - 2.718281828) < 1e-6, err


@pytest.mark.parametrize("model, said", [
    ("nan", "expected a log-probability, got 'nan'"),
    ("positive", "expected a log-probability, got '0.5'"),
    ("infinity", "expected a log-probability, got 'inf'"),
    ("string-ids", "prompt_token_ids: expected a list of token ids"),
    ("oversize", "larger than the"),
    ("deep", "nested more than 64 levels"),
])
def test_a_hostile_answer_is_one_line(model, said, hostile, text, capsys):
    rc = main(["eval", model, "--server", hostile, "--text", text, *WINDOW])
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert rc == 2 and out == "" and len(lines) == 1 and "Traceback" not in err, (rc, err)
    assert lines[0].startswith(f"kvtool: error: {hostile}") and "--server" in lines[0]
    assert "/v1/completions" in lines[0] and said in lines[0], lines[0]


def test_the_response_limit_follows_the_request():
    """The cap is derived from the request: more tokens or more alternatives allow more, a /v1/models listing a
    fixed MiB; a real answer's size sits far below it (a vLLM entry is ~60 bytes plus the token's text)."""
    small = response_limit("/v1/completions", {"prompt": [1] * 16, "prompt_logprobs": 20})
    assert response_limit("/v1/completions", {"prompt": [1] * 32, "prompt_logprobs": 20}) > small
    assert response_limit("/v1/completions", {"prompt": [1] * 16, "prompt_logprobs": 100}) > small
    assert response_limit("/v1/completions", {"prompt": "abcd", "echo": True, "logprobs": 20}) < small
    honest = len(_completion("honest", list(range(16))))
    assert honest < small // 10
    assert response_limit("/v1/models", None) == 2**20


def test_a_local_baseline_folder_the_server_also_serves_is_ambiguous(hostile, text, smollm2_path, tmp_path,
                                                                      monkeypatch, capsys):
    """`--baseline honest` names both a model folder here and a model the server lists: refused, not guessed."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "honest").symlink_to(smollm2_path, target_is_directory=True)
    rc = main(["eval", "nan", "--server", hostile, "--baseline", "honest", "--text", text, *WINDOW])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "--baseline: 'honest' is a model folder here and a model" in err[0]
    assert main(["eval", "honest", "--server", hostile, "--baseline", "./honest", "--text", text, *WINDOW,
                 "--dry-run"]) == 0
    assert "against ./honest (local)" in capsys.readouterr().out


def test_the_report_says_what_the_served_figure_includes(hostile, text, capsys):
    """A server that does not tell its KV-cache dtype or chunk (no vLLM /metrics gauge, no /server_info): the
    report says so; declared, it counts the scored tokens by what their attention read from the cache
    (kvtool.eval.served_reads, tests/eval/test_served_reads.py)."""
    rc = main(["eval", "honest", "--server", hostile, "--text", text, *WINDOW])
    out, _ = capsys.readouterr()
    assert rc == 0 and "cache     served kv_cache_dtype not known" in out
    rc = main(["eval", "honest", "--server", hostile, "--text", text, *WINDOW, "--format", "json",
               "--served-kv-cache-dtype", "turboquant_k8v4"])
    d = json.loads(capsys.readouterr().out)["memory"]["cache_reads"]
    assert rc == 0 and d["includes_cache_cost"] == "none" and d["tokens"]["raw"] == 39 and d["chunk"] is None
    # windows of 16, stride 8: a chunk of 4 leaves in each window only context and the first targets raw
    rc = main(["eval", "honest", "--server", hostile, "--text", text, *WINDOW, "--served-kv-cache-dtype",
               "turboquant_k8v4", "--served-chunk", "4"])
    out = capsys.readouterr().out
    assert rc == 0 and "chunks of 4 (--served-chunk)" in out and "only earlier" not in out
    assert "leaves part of the cache's cost out" in out and "turboquant_attn.py" in out
    rc = main(["eval", "honest", "--text", text, *WINDOW, "--served-chunk", "4"])
    err = capsys.readouterr().err
    assert rc == 2 and "--served-chunk" in err and "goes with --server" in err
