"""The Hugging Face hub, asked only when it can answer: one line and a bounded wait without a network.

huggingface_hub retries a failed request 5 times with growing pauses (utils/_http.py http_backoff) and logs
each retry: with no network, `kvtool lint org/name` took 24 s and printed a dozen lines. kvtool first
checks, in at most PROBE_S seconds, that the endpoint answers at all; when it does not (or HF_HUB_OFFLINE /
TRANSFORMERS_OFFLINE is set) only the local cache is read, and a miss is one line (exit 2).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from urllib.parse import urlsplit

PROBE_S = 3.0  # a TCP connect to the endpoint; DNS and connect together, in a thread we stop waiting for
ETAG_TIMEOUT_S = 10.0  # huggingface_hub's wait for the metadata of one file once the endpoint answered
_PROXY_VARS = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy")
_TRUE = ("1", "on", "yes", "true")


def offline_reason() -> str | None:
    """Why the hub is not asked (the offline variables, or an endpoint that does not answer), or None."""
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(var, "").strip().lower() in _TRUE:
            return f"{var} is set"
    if any(os.environ.get(v) for v in _PROXY_VARS):
        return None  # the proxy decides what is reachable: let huggingface_hub go through it
    from huggingface_hub import constants

    return _unreachable(constants.ENDPOINT)


def stay_offline() -> None:
    """The rest of this run reads the local cache only: transformers' own hub calls (eval, quantize-kv of a hub
    id) would otherwise retry as huggingface_hub does. huggingface_hub reads the variable once, at import."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = True


def _unreachable(endpoint: str) -> str | None:
    url = urlsplit(endpoint)
    host = url.hostname or endpoint
    port = url.port or (443 if url.scheme == "https" else 80)
    result: list[str | None] = []

    def probe() -> None:
        try:
            socket.create_connection((host, port), timeout=PROBE_S).close()
            result.append(None)
        except OSError as exc:
            result.append(exc.strerror or type(exc).__name__)

    worker = threading.Thread(target=probe, daemon=True)  # getaddrinfo has no timeout of its own
    worker.start()
    worker.join(PROBE_S)
    if not result:
        return f"{host} did not answer within {PROBE_S:g} s"
    return None if result[0] is None else f"{host} cannot be reached: {result[0]}"


@contextlib.contextmanager
def quiet_hub():
    """huggingface_hub's retry and progress messages off: kvtool says what failed in one line."""
    logger = logging.getLogger("huggingface_hub")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)
