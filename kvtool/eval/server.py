"""A running OpenAI-compatible server as kvtool scores it: stdlib HTTP (urllib), one bounded timeout per request, no
retries (a server that does not answer in time is an error, not a reason to send more load). Every failure is one
InputError naming the URL and the option (`--server` / `--baseline-server`): refused, timed out, not JSON, an HTTP
error with the server's own message, a model name it does not serve, a family kvtool does not know."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.error
import urllib.request
from typing import Any, Sequence

from kvtool.errors import InputError, listed
from kvtool.eval import protocol
from kvtool.eval.protocol import FAMILIES, Family

# An answer is untrusted input: kvtool reads at most what the request can honestly produce, derived from the request
# (response_limit), and refuses more unread. ENTRY_BYTES bounds one token's entry on the average: its id, its text
# JSON-escaped (a 100-byte token of \\uXXXX escapes is 600 bytes) and its numbers (logprob, rank, offset).
OVERHEAD = 64 * 2**10  # the envelope: ids, names, usage, the generated token
ENTRY_BYTES = 2048
MODELS_LIMIT = 2**20  # GET /v1/models: a list of names


def response_limit(path: str, body: dict | None) -> int:
    """The most bytes an honest answer to this request can take: /v1/completions n prompt tokens x (k
    alternatives + the token itself + the generated one) entries; /tokenize 16 bytes per byte of text (an id and
    its separator per byte at most); /detokenize an entry per id; anything else (/v1/models) MODELS_LIMIT."""
    if body is None:
        return MODELS_LIMIT
    prompt = body.get("prompt", body.get("input", body.get("tokens")))
    if path.endswith("completions"):
        k = int(body.get("prompt_logprobs") or body.get("logprobs") or 0)
        n = len(prompt) if isinstance(prompt, list) else len(str(prompt).encode("utf-8"))  # text: <= 1 token a byte
        return OVERHEAD + n * (k + 3) * ENTRY_BYTES
    if isinstance(prompt, list):  # detokenize
        return OVERHEAD + len(prompt) * ENTRY_BYTES
    return OVERHEAD + 16 * (len(str(prompt).encode("utf-8")) + 8)


class Server:
    """One served model: its URL, its name there, and the server family (found by `connect`)."""

    def __init__(self, url: str, model: str, *, timeout: float, option: str = "server"):
        self.url = url.rstrip("/")
        for suffix in ("/v1/completions", "/v1"):  # accept the API root as well as the server root
            if self.url.endswith(suffix):
                self.url = self.url[: -len(suffix)]
        self.model, self.timeout, self.option = model, timeout, option
        self.family: Family | None = None
        self.names: list[str] = []  # what /v1/models lists (connect)
        if not self.url.startswith(("http://", "https://")):
            raise InputError("expected an http:// or https:// URL", file=url, option=option)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.url, option=self.option)

    def request(self, path: str, body: dict | None = None, *, missing_ok: bool = False) -> Any:
        """GET (body None) or POST JSON; the decoded JSON answer. missing_ok: a 404 / 405 returns None."""
        data = None if body is None else json.dumps(body).encode()
        limit = response_limit(path, body)
        req = urllib.request.Request(self.url + path, data=data, method="GET" if body is None else "POST",
                                     headers={"Content-Type": "application/json", "Accept": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read(limit + 1)
        except urllib.error.HTTPError as exc:
            if missing_ok and exc.code in (404, 405):
                return None
            raise self.error(f"{path}: HTTP {exc.code}: {_server_message(exc)}") from None
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, ConnectionRefusedError):
                raise self.error("connection refused (is the server running on that port?)") from None
            if isinstance(reason, (socket.timeout, TimeoutError)):
                raise self.error(f"{path}: no answer within {self.timeout:g} s (--server-timeout)") from None
            raise self.error(f"{path}: cannot connect: {reason}") from None
        except (socket.timeout, TimeoutError):
            raise self.error(f"{path}: no answer within {self.timeout:g} s (--server-timeout)") from None
        except (ConnectionError, OSError, http.client.HTTPException) as exc:  # reset, closed mid-answer, garbage
            raise self.error(f"{path}: {type(exc).__name__}: {exc}") from None
        if len(raw) > limit:
            raise self.error(f"{path}: the answer is larger than the {limit} bytes this request can produce "
                             "(refused unread)")
        try:
            return json.loads(raw)
        except RecursionError:
            raise self.error(f"{path}: the answer is JSON nested too deep") from None
        except (ValueError, UnicodeDecodeError):
            raise self.error(f"{path}: the answer is not JSON ({raw[:60]!r})") from None

    def connect(self) -> "Server":
        """Check that the server serves self.model and find its family (which tokenize endpoint it has)."""
        try:
            names = protocol.served_names(self.request("/v1/models"))
        except InputError as exc:
            raise self.error(exc.message) from None
        self.names = names
        if self.model not in names:
            raise self.error(f"serves {listed(repr(n) for n in names) or 'no model'}, not {self.model!r} "
                             "(the model name to score)")
        for family in FAMILIES.values():
            answer = self.request(family.tokenize_path, protocol.tokenize_request(family, self.model, ""),
                                  missing_ok=True)
            if answer is not None:
                self.family = family
                self._empty = protocol.parse_tokens(answer, family.tokenize_path)
                break
        else:
            raise self.error("has neither /tokenize (vLLM) nor /extras/tokenize (llama-cpp-python): kvtool needs "
                             "the server's tokenizer to check that both sides score the same tokens")
        if self.family.name == "llama-cpp-python" and not self._empty:
            raise self.error(protocol.SHIFTED_WITHOUT_BOS)
        return self

    @property
    def bos(self) -> int | None:
        """The token the server puts before every text it tokenizes (None: none)."""
        return self._empty[0] if self._empty else None

    def tokenize(self, text: str) -> list[int]:
        return protocol.parse_tokens(self.request(self.family.tokenize_path,
                                                  protocol.tokenize_request(self.family, self.model, text)),
                                     self.family.tokenize_path)

    def detokenize(self, ids: Sequence[int]) -> str | None:
        """The text of ids; None when the server cannot decode them alone (e.g. half of a UTF-8 character)."""
        try:
            answer = self.request(self.family.detokenize_path,
                                  protocol.detokenize_request(self.family, self.model, ids))
        except InputError as exc:
            if "HTTP 5" in exc.message or "HTTP 4" in exc.message:
                return None
            raise
        return protocol.parse_text(answer, self.family.detokenize_path)

    def score(self, sw, k: int) -> list:
        """The positions of one kvtool.eval.served.ServedWindow."""
        return self.positions(sw.prompt, sw.n_prompt, k)

    def positions(self, prompt, n_prompt: int, k: int) -> list:
        """protocol.Position per prompt token of one window (see kvtool.eval.protocol)."""
        body = protocol.completion_request(self.family, self.model, prompt, k)
        try:
            return protocol.parse_positions(self.family, self.request("/v1/completions", body), n_prompt, k)
        except InputError as exc:
            if exc.file:
                raise
            raise self.error(f"/v1/completions: {exc.message}") from None


def _server_message(exc: urllib.error.HTTPError) -> str:
    """The error text a server put in its JSON body (FastAPI: detail; OpenAI: error.message), shortened."""
    try:
        body = json.loads(exc.read(65536) or b"{}")
    except (ValueError, OSError):
        return exc.reason or "error"
    msg = body.get("detail") or body.get("message") or body.get("error") if isinstance(body, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return str(msg or exc.reason or "error")[:300]
