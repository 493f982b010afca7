"""kvtool.eval.server.Server.request in process, against a loopback server (tests/fake_server.py): the deadline of
the whole request, the redirect policy, the bounded read and Basic authentication (the subprocess cases of
each class are in tests/hostile/test_served_gate.py)."""

from __future__ import annotations

import base64
import json
import time

import pytest

from fake_server import FakeServer
from kvtool.errors import InputError
from kvtool.eval.server import MAX_REDIRECTS, Server


def _drip(every: float, n: int = 40):
    def intercept(h, m, p, body):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % n)
        try:
            for _ in range(n):
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(every)
        except OSError:
            pass
        return True

    return intercept


@pytest.mark.parametrize("every", [0.3, 0.1])
def test_a_drip_fails_at_the_deadline_not_after_the_whole_answer(every):
    """40 bytes at 0.3 s is 12 s, and no single read waits more than 0.3 s: a per-read timeout of 1 s never
    trips; the deadline does, at 1 s."""
    with FakeServer(intercept=_drip(every)) as s:
        t0 = time.monotonic()
        with pytest.raises(InputError, match="no complete answer within 1 s"):
            Server(s.url, "m", timeout=1).request("/v1/models")
        took = time.monotonic() - t0
    assert 0.9 < took < 2.0, took


def test_an_answer_within_the_deadline_is_read():
    with FakeServer(intercept=_drip(0.01, n=20)) as s:
        with pytest.raises(InputError, match="not JSON"):  # 20 spaces: read whole, then refused as no JSON
            Server(s.url, "m", timeout=5).request("/v1/models")


def _redirect(code, location):
    def intercept(h, m, p, body):
        if p != "/v1/models":
            return False
        h.send_response(code)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()
        return True

    return intercept


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_get_is_redirected_within_the_origin_only(code):
    with FakeServer() as other:
        with FakeServer(intercept=_redirect(code, "/v1/models/")) as s:
            def moved(h, m, p, body, inner=s.intercept):
                if p == "/v1/models/":
                    return s.route(h, m, "/v1/models", body) or True
                return inner(h, m, p, body)

            s.intercept = moved
            assert Server(s.url, "m", timeout=5).request("/v1/models")["data"] == [{"id": "honest"}]
        with FakeServer(intercept=_redirect(code, other.url + "/v1/models")) as s:
            with pytest.raises(InputError, match=f"HTTP {code} redirects to http://127.0.0.1:{other.port}/v1/models"):
                Server(s.url, "m", timeout=5).request("/v1/models")
        assert other.requests == []


def test_a_redirect_loop_stops_after_the_limit():
    with FakeServer(intercept=_redirect(307, "/v1/models")) as s:
        with pytest.raises(InputError, match=f"more than {MAX_REDIRECTS} redirects"):
            Server(s.url, "m", timeout=5).request("/v1/models")
        assert len(s.requests) == MAX_REDIRECTS + 1


def test_a_redirect_location_with_credentials_is_shown_without_them():
    with FakeServer(intercept=_redirect(302, "http://evil:hunter2@other.example/")) as s:
        with pytest.raises(InputError) as e:
            Server(s.url, "m", timeout=5).request("/v1/models")
    assert "hunter2" not in str(e.value) and "http://***@other.example/" in str(e.value)


def test_credentials_go_in_the_authorization_header_not_the_url():
    with FakeServer() as s:
        server = Server(s.url.replace("://", "://kv:p%40ss@"), "m", timeout=5)
        server.request("/v1/models")
    method, path, headers = s.requests[0]
    assert path == "/v1/models" and headers["Authorization"] == "Basic " + base64.b64encode(b"kv:p@ss").decode()
    assert server.url == s.url.replace("://", "://***@")


def test_a_content_length_past_the_limit_is_refused_unread():
    def intercept(h, m, p, body):
        h.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 99999999999\r\n\r\n")
        h.wfile.flush()
        time.sleep(5)  # sends nothing more: only the header can have refused it, at once
        return True

    with FakeServer(intercept=intercept) as s:
        t0 = time.monotonic()
        with pytest.raises(InputError, match="larger than the 1048576 bytes"):
            Server(s.url, "m", timeout=30).request("/v1/models")
        assert time.monotonic() - t0 < 3


def test_an_error_body_nested_deep_gives_the_status_reason():
    def intercept(h, m, p, body):
        payload = b'{"detail":' * 10_000 + b"1" + b"}" * 10_000
        h.send_response(500, "Internal Server Error")
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)
        return True

    with FakeServer(intercept=intercept) as s:
        with pytest.raises(InputError, match="HTTP 500: Internal Server Error"):
            Server(s.url, "m", timeout=5).request("/v1/models")


def test_an_error_message_is_one_short_line():
    def intercept(h, m, p, body):
        payload = json.dumps({"detail": "bad\nrequest\r\n" + "x" * 1000}).encode()
        h.send_response(400)
        h.send_header("Content-Length", str(len(payload)))
        h.end_headers()
        h.wfile.write(payload)
        return True

    with FakeServer(intercept=intercept) as s:
        with pytest.raises(InputError) as e:
            Server(s.url, "m", timeout=5).request("/v1/models")
    assert "\n" not in e.value.message and "bad request x" in e.value.message and len(e.value.message) < 400
