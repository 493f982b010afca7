"""A small OpenAI-compatible server on loopback for the served-eval protocol tests (the real engine is
tests/eval/llama_server.py): honest by default, and told per test how to lie.

Two families, as kvtool tells them apart (kvtool.eval.protocol.FAMILIES):
  vllm               /tokenize (one id per character, 2 + ord(c) % 50, no BOS), token-id prompts,
                     prompt_logprobs keyed by id
  llama-cpp-python   /extras/tokenize ([1] BOS + ord(c) per character), /extras/detokenize, text prompts,
                     echo + logprobs keyed by each token's text

`answer(model, prompt, choice)` may change the honest choice of a completion (or return bytes: the whole body);
`intercept(handler, method, path, body)` may answer any request itself (status, headers, pace) and return True.
Every request is recorded in `requests` as (method, path, headers), and every error of a handler in `errors`.

It writes nothing to this process's stdout or stderr (its errors are recorded, not printed, and its threads say
so: `writes_nothing`), so the hostile harness may run kvtool in this process beside it (tests/hostile/harness.py).
"""

from __future__ import annotations

import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

BOS = 1


class _QuietServer(ThreadingHTTPServer):
    """http.server's threading server whose threads print nothing: a handler's error is recorded in `errors`
    (socketserver would print its traceback to sys.stderr, which an in-process kvtool run reads as its own)."""

    daemon_threads = True

    def __init__(self, address, handler):
        super().__init__(address, handler)
        self.errors: list[BaseException] = []

    def process_request(self, request, client_address):
        # daemon, and not joined on close (as ThreadingMixIn leaves daemon threads): a handler told to stall stalls
        t = threading.Thread(target=self.process_request_thread, args=(request, client_address), daemon=True)
        t.writes_nothing = True  # type: ignore[attr-defined] - read by tests/hostile/harness.in_process
        t.start()

    def handle_error(self, request, client_address):
        self.errors.append(sys.exc_info()[1])


def vllm_ids(text: str) -> list[int]:
    return [2 + ord(c) % 50 for c in text]


def honest_vllm_choice(prompt: list[int]) -> dict:
    rows = [None] + [{str(t): {"logprob": -1.0, "rank": 1}, "999": {"logprob": -2.0, "rank": 2}} for t in prompt[1:]]
    return {"index": 0, "text": "x", "prompt_token_ids": list(prompt), "prompt_logprobs": rows}


def honest_llama_choice(text: str) -> dict:
    tokens = list(text)
    tops = [None] + [{t: -1.0, "~": -2.0} for t in tokens[1:]]
    return {"index": 0, "text": text + "x", "logprobs": {
        "tokens": tokens + ["x"], "token_logprobs": [None] + [-1.0] * (len(tokens) - 1) + [-0.5],
        "top_logprobs": tops + [{"x": -0.5}], "text_offset": list(range(len(tokens) + 1))}}


class FakeServer:
    def __init__(self, *, family: str = "vllm", models: tuple[str, ...] = ("honest",),
                 answer: Callable[[str, Any, dict], dict | bytes | None] | None = None,
                 intercept: Callable[..., bool] | None = None, host: str = "127.0.0.1"):
        self.family, self.models, self.answer, self.intercept = family, models, answer, intercept
        self.requests: list[tuple[str, str, dict]] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):  # quiet
                pass

            def send_json(self, obj: Any, status: int = 200) -> None:
                body = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.wfile.write(body)

            def handle_one(self, method: str) -> None:
                body = None
                if method == "POST":
                    body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"null")
                fake.requests.append((method, self.path, dict(self.headers)))
                try:
                    if fake.intercept is not None and fake.intercept(self, method, self.path, body):
                        return
                    fake.route(self, method, self.path, body)
                except (BrokenPipeError, ConnectionResetError):
                    pass
                self.close_connection = True

            def do_GET(self):  # noqa: N802 - http.server's name
                self.handle_one("GET")

            def do_POST(self):  # noqa: N802
                self.handle_one("POST")

        self.server = _QuietServer((host, 0), Handler)
        self.errors = self.server.errors
        self.port = self.server.server_address[1]
        self.url = f"http://{host}:{self.port}"
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.writes_nothing = True  # type: ignore[attr-defined]

    def _serve(self) -> None:
        try:
            self.server.serve_forever(poll_interval=0.01)  # shutdown() waits up to one interval (0.5 s by default)
        except BaseException as exc:  # noqa: BLE001 - recorded, not printed (see the module's docstring)
            self.errors.append(exc)

    def route(self, h, method: str, path: str, body: Any) -> None:
        if method == "GET" and path == "/v1/models":
            return h.send_json({"object": "list", "data": [{"id": m} for m in self.models]})
        if self.family == "vllm" and path == "/tokenize":
            return h.send_json({"tokens": vllm_ids(body["prompt"])})
        if self.family == "llama-cpp-python" and path == "/extras/tokenize":
            return h.send_json({"tokens": [BOS] + [ord(c) for c in body["input"]]})
        if self.family == "llama-cpp-python" and path == "/extras/detokenize":
            return h.send_json({"text": "".join(chr(i) for i in body["tokens"] if i != BOS)})
        if path == "/v1/completions":
            prompt = body["prompt"]
            choice = honest_vllm_choice(prompt) if self.family == "vllm" else honest_llama_choice(prompt)
            if self.answer is not None:
                changed = self.answer(body["model"], prompt, choice)
                if isinstance(changed, bytes):
                    return h.send_json(changed)
                choice = changed if changed is not None else choice
            return h.send_json({"id": "c", "object": "text_completion", "model": body["model"], "choices": [choice]})
        h.send_json({"detail": "Not Found"}, status=404)

    def __enter__(self) -> "FakeServer":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join()

    def posts(self, path: str = "/v1/completions") -> int:
        return sum(1 for m, p, _ in self.requests if m == "POST" and p == path)
