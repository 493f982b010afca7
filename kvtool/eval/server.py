"""A running OpenAI-compatible server as kvtool scores it: stdlib HTTP (urllib, with kvtool's own handlers), one
deadline per request, no retries (a server that does not answer in time is an error, not a reason to send more
load). Every failure is one InputError naming the URL (its credentials shown as ***) and the option (`--server` /
`--baseline-server`): refused, timed out, not JSON, an HTTP error with the server's own message, a redirect kvtool
does not follow, a model name it does not serve, a family kvtool does not know.

What a request may do (docs/eval.md, "Against a running server"):
- `--server-timeout` is a deadline for the whole request: name resolution, connecting, sending, every read of the
  status line, headers and body, and any redirect, together (`_Deadline`: a timer shuts the socket down when it
  passes, so a server that drips one byte at a time stops there too);
- a redirect is followed only to the same scheme, host and port (`urls.same_origin`), at most MAX_REDIRECTS
  times: 307 / 308 keep the method and body, 301 / 302 / 303 only for a GET (a scoring POST is never turned into a
  GET); any other is one line naming the status and where it pointed. Only http and https are spoken at all: the
  opener has no ftp, file or data handler;
- the answer is read up to `response_limit` bytes (a larger Content-Length is refused before reading), must be
  JSON (a Content-Type other than JSON is refused; only vLLM's Prometheus /metrics is read as text/plain), UTF-8, with bounded integers and nesting
  (kvtool.io.jsonfile.parse_json) and no key twice in an object.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
import urllib.error
import urllib.request
from typing import Any, Sequence

from kvtool.errors import InputError, UsageError, listed
from kvtool.eval import protocol
from kvtool.eval.protocol import FAMILIES, Family
from kvtool.io import jsonfile, urls

# An answer is untrusted input: kvtool reads at most what the request can honestly produce, derived from the request
# (response_limit), and refuses more unread. ENTRY_BYTES bounds one token's entry on the average: its id, its text
# JSON-escaped (a 100-byte token of \\uXXXX escapes is 600 bytes) and its numbers (logprob, rank, offset).
OVERHEAD = 64 * 2**10  # the envelope: ids, names, usage, the generated token
ENTRY_BYTES = 2048
MODELS_LIMIT = 2**20  # GET /v1/models: a list of names (also /server_info)
METRICS_LIMIT = 8 * 2**20  # GET /metrics: Prometheus text (kvtool.eval.served_reads reads one gauge of it)
ERROR_BODY_LIMIT = 65536  # an HTTP error's body: read for its message only
MAX_REDIRECTS = 4
READ_CHUNK = 1 << 16


def response_limit(path: str, body: dict | None) -> int:
    """The most bytes an honest answer to this request can take: /v1/completions n prompt tokens x (k
    alternatives + the token itself + the generated one) entries; /tokenize 16 bytes per byte of text (an id and
    its separator per byte at most); /detokenize an entry per id; anything else (/v1/models) MODELS_LIMIT."""
    if body is None:
        return METRICS_LIMIT if path == "/metrics" else MODELS_LIMIT
    prompt = body.get("prompt", body.get("input", body.get("tokens")))
    if path.endswith("completions"):
        k = int(body.get("prompt_logprobs") or body.get("logprobs") or 0)
        n = len(prompt) if isinstance(prompt, list) else len(str(prompt).encode("utf-8"))  # text: <= 1 token a byte
        return OVERHEAD + n * (k + 3) * ENTRY_BYTES
    if isinstance(prompt, list):  # detokenize
        return OVERHEAD + len(prompt) * ENTRY_BYTES
    return OVERHEAD + 16 * (len(str(prompt).encode("utf-8")) + 8)


class _Expired(Exception):
    """The request's deadline passed."""


class _Refused(Exception):
    """A redirect kvtool does not follow (its message says why; safe to print)."""


class _Deadline:
    """One request's deadline: the time left for each step, and a timer that shuts every socket the request opened
    down when it passes (a blocked read then returns, whatever the server keeps sending)."""

    def __init__(self, seconds: float):
        self.seconds = seconds
        self.end = time.monotonic() + seconds
        self.expired = False
        self._socks: list[socket.socket] = []
        self._lock = threading.Lock()
        self._timer = threading.Timer(seconds, self._fire)
        self._timer.daemon = True

    def __enter__(self) -> "_Deadline":
        self._timer.start()
        return self

    def __exit__(self, *exc) -> None:
        self._timer.cancel()

    def left(self) -> float:
        left = self.end - time.monotonic()
        if left <= 0 or self.expired:
            raise _Expired
        return left

    def watch(self, sock: socket.socket) -> None:
        with self._lock:
            self._socks.append(sock)
            if self.expired:
                _shut(sock)

    def _fire(self) -> None:
        with self._lock:
            self.expired = True
            for sock in self._socks:
                _shut(sock)


def _shut(sock: socket.socket) -> None:
    try:  # the plain socket's shutdown (an SSL socket's own one would unwrap TLS first)
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass


def _connect(address: tuple[str, int], deadline: _Deadline, source) -> socket.socket:
    """socket.create_connection within the deadline, name resolution included (getaddrinfo cannot be interrupted:
    it runs on a thread that is left behind when the deadline passes)."""
    host, port = address
    found: list = []

    def resolve():
        try:
            found.append(socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    t = threading.Thread(target=resolve, daemon=True)
    t.start()
    t.join(deadline.left())
    if not found:
        raise _Expired
    if isinstance(found[0], OSError):
        raise found[0]
    error: OSError | None = None
    for family, kind, proto, _, sockaddr in found[0]:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(deadline.left())
            if source:
                sock.bind(source)
            sock.connect(sockaddr)
            deadline.watch(sock)
            return sock
        except OSError as exc:
            sock.close()
            error = exc
    raise error or OSError(f"cannot resolve {host}")


def _connection_class(base: type, deadline: _Deadline) -> type:
    class Connection(base):  # http.client's, connecting within the deadline and watched by it
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._create_connection = lambda address, timeout=None, source=None: _connect(address, deadline, source)

    return Connection


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(_connection_class(http.client.HTTPConnection, self.deadline), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline: _Deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):
        return self.do_open(_connection_class(http.client.HTTPSConnection, self.deadline), req,
                            context=self._context)


def _opener(deadline: _Deadline) -> urllib.request.OpenerDirector:
    """http and https only (no ftp, file or data handler), proxies from the environment as urllib's default, no
    redirect handler (Server.request follows what it follows itself), every non-2xx status an HTTPError."""
    opener = urllib.request.OpenerDirector()
    for handler in (urllib.request.ProxyHandler(), _HTTP(deadline), _HTTPS(deadline), urllib.request.UnknownHandler(),
                    urllib.request.HTTPDefaultErrorHandler(), urllib.request.HTTPErrorProcessor()):
        opener.add_handler(handler)
    return opener


class Server:
    """One served model: its URL, its name there, and the server family (found by `connect`)."""

    def __init__(self, url: str, model: str, *, timeout: float, option: str = "server"):
        try:
            self.target = urls.parse(url)
        except urls.BadURL as exc:
            raise UsageError(str(exc), option=option) from None
        self.url = self.target.shown  # what every message and report shows: no credentials
        self.model, self.timeout, self.option = model, timeout, option
        self.family: Family | None = None
        self.names: list[str] = []  # what /v1/models lists (connect)
        self._names_of: dict[int, str | None] = {}  # token id -> its text as the server prints it (token_names)

    def error(self, message: str) -> InputError:
        return InputError(message, file=self.url, option=self.option)

    def request(self, path: str, body: dict | None = None, *, missing_ok: bool = False, text: bool = False) -> Any:
        """GET (body None) or POST JSON; the decoded JSON answer (text: a text/plain answer as str, e.g.
        Prometheus' /metrics). missing_ok: a 404 / 405 returns None.
        The whole request, redirects included, within one --server-timeout."""
        data = None if body is None else json.dumps(body).encode()
        limit = response_limit(path, body)
        method = "GET" if body is None else "POST"
        url = self.target.base + path
        headers = {"Content-Type": "application/json", "Accept": "text/plain" if text else "application/json",
                   **self.target.authorization()}
        timed_out = self.error(f"{path}: no complete answer within {self.timeout:g} s (--server-timeout: the "
                               "deadline of the whole request)")
        with _Deadline(self.timeout) as deadline:
            try:
                for hop in range(MAX_REDIRECTS + 1):
                    req = urllib.request.Request(url, data=data, method=method, headers=headers)
                    try:
                        resp = _opener(deadline).open(req, timeout=deadline.left())
                    except urllib.error.HTTPError as exc:
                        with exc:
                            if exc.code in (301, 302, 303, 307, 308):
                                url = self._redirect(path, exc, method, url, hop)
                                continue
                            if missing_ok and exc.code in (404, 405):
                                return None
                            message = _server_message(exc, deadline)
                        if deadline.expired:
                            raise _Expired from None
                        raise self.error(f"{path}: HTTP {exc.code}: {message}") from None
                    with resp:
                        raw = self._read(path, resp, limit, deadline, text)
                    break
            except _Expired:
                raise timed_out from None
            except _Refused as exc:
                raise self.error(f"{path}: {exc}") from None
            except urllib.error.URLError as exc:
                if deadline.expired or isinstance(exc.reason, (socket.timeout, TimeoutError)):
                    raise timed_out from None
                if isinstance(exc.reason, ConnectionRefusedError):
                    raise self.error("connection refused (is the server running on that port?)") from None
                raise self.error(f"{path}: cannot connect: {_said(exc.reason)}") from None
            except (OSError, http.client.HTTPException, ValueError) as exc:  # reset, cut short, bad framing
                if deadline.expired or isinstance(exc, (socket.timeout, TimeoutError)):
                    raise timed_out from None
                raise self.error(f"{path}: {type(exc).__name__}: {_said(exc)}") from None
            if deadline.expired:
                raise timed_out
        if text:
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                raise self.error(f"{path}: the answer is not UTF-8 text ({raw[:60]!r})") from None
        return self._decode(path, raw)

    def _redirect(self, path: str, exc: urllib.error.HTTPError, method: str, url: str, hop: int) -> str:
        """Where a redirect leads, when kvtool follows it (see the module docstring); else _Refused."""
        import urllib.parse

        location = exc.headers.get("Location") if exc.headers is not None else None
        if not location:
            raise _Refused(f"HTTP {exc.code} redirect without a Location")
        target = urllib.parse.urljoin(url, location.strip())
        shown = urls.redact(target)[:200]
        if hop == MAX_REDIRECTS:
            raise _Refused(f"more than {MAX_REDIRECTS} redirects (the last to {shown})")
        if not urls.same_origin(self.target, target):
            raise _Refused(f"HTTP {exc.code} redirects to {shown}, another scheme, host or port than the server's: "
                           "not followed (kvtool follows a redirect only on the same scheme, host and port)")
        if exc.code not in (307, 308) and method != "GET":
            raise _Refused(f"HTTP {exc.code} redirects the {method} to {shown}: not followed (it would be resent "
                           "as a GET without its body; only 307 and 308 keep them)")
        return target

    def _read(self, path: str, resp, limit: int, deadline: _Deadline, text: bool = False) -> bytes:
        """The body, at most limit bytes: a Content-Length past it, or more bytes, are refused unread."""
        kind = (resp.headers.get("Content-Type") or "application/json").split(";")[0].strip().lower()
        if text:
            if kind != "text/plain":
                raise self.error(f"{path}: the answer is {kind[:60]!r}, not text/plain (Content-Type)")
        elif kind != "application/json" and not kind.endswith("+json"):
            raise self.error(f"{path}: the answer is {kind[:60]!r}, not JSON (Content-Type)")
        length = resp.headers.get("Content-Length")
        too_large = self.error(f"{path}: the answer is larger than the {limit} bytes this request can produce "
                               "(refused unread)")
        if length is not None and length.strip().isdigit() and int(length.strip()[:30]) > limit:
            raise too_large
        parts, size = [], 0
        while size <= limit:
            deadline.left()
            chunk = resp.read(min(READ_CHUNK, limit + 1 - size))
            if not chunk:
                break
            parts.append(chunk)
            size += len(chunk)
        if deadline.expired:
            raise _Expired
        if size > limit:
            raise too_large
        return b"".join(parts)

    def _decode(self, path: str, raw: bytes) -> Any:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{path}: the answer is not UTF-8 JSON ({raw[:60]!r})") from None
        try:
            return jsonfile.parse_json(text, self.url, what="server answer", raw=raw, unique_keys=True)
        except InputError as exc:
            raise self.error(f"{path}: the answer is not JSON kvtool reads: {exc.message}") from None

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

    def token_names(self, ids: Sequence[int]) -> list[str | None]:
        """Each id as the server names it in an echo (its text alone: /extras/detokenize of the one id, which
        llama-cpp-python 0.3.36 decodes as its echo does, llama_cpp/llama.py Llama._create_completion); None where
        the server cannot decode the id alone (half of a UTF-8 character). One request per new id, cached."""
        for i in ids:
            if i not in self._names_of:
                self._names_of[i] = self.detokenize([i])
        return [self._names_of[i] for i in ids]

    def expected(self, ids: Sequence[int]) -> list:
        """What an answer must name at each prompt position (kvtool.eval.protocol.parse_positions): the ids sent,
        or, for a family that names tokens by text, each id's text (a name the server cannot give alone is taken
        from the answer itself, checked by position only)."""
        return list(ids) if self.family.token_prompts else self.token_names(ids)

    def score(self, sw, k: int) -> list:
        """The positions of one kvtool.eval.served.ServedWindow."""
        return self.positions(sw.prompt, sw.n_prompt, k, sw.ids)

    def positions(self, prompt, n_prompt: int, k: int, ids: Sequence[int]) -> list:
        """protocol.Position per prompt token of one window (see kvtool.eval.protocol); ids: the prompt's tokens,
        which the answer must be about, position by position."""
        body = protocol.completion_request(self.family, self.model, prompt, k)
        expected = self.expected(ids)
        try:
            answer = self.request("/v1/completions", body)
            if None in expected:  # ids the server cannot name alone: whatever it echoes there
                echoed = protocol.echoed_tokens(answer, n_prompt)
                expected = [e if e is not None or echoed is None else echoed[j] for j, e in enumerate(expected)]
            return protocol.parse_positions(self.family, answer, n_prompt, k, expected)
        except InputError as exc:
            if exc.file:
                raise
            raise self.error(f"/v1/completions: {exc.message}") from None


def _server_message(exc: urllib.error.HTTPError, deadline: _Deadline) -> str:
    """The error text a server put in its JSON body (FastAPI: detail; OpenAI: error.message), shortened; the status
    reason when the body is no such JSON (cut short, nested too deep, not UTF-8, too large)."""
    reason = _said(exc.reason or "error")
    try:
        raw = exc.read(ERROR_BODY_LIMIT + 1)
    except (OSError, http.client.HTTPException, ValueError):
        return reason
    if deadline.expired or len(raw) > ERROR_BODY_LIMIT:
        return reason
    try:
        body = jsonfile.parse_json(raw.decode("utf-8"), "error body", raw=raw)
    except (InputError, UnicodeDecodeError, ValueError):
        return reason
    msg = body.get("detail") or body.get("message") or body.get("error") if isinstance(body, dict) else None
    if isinstance(msg, dict):
        msg = msg.get("message")
    return _said(msg or reason)


def _said(value: object) -> str:
    """What a server or the system said, as one short line (kvtool.console escapes what is left)."""
    return " ".join(str(value).split())[:300]
