"""A server URL has one grammar (kvtool/io/urls.py SERVER_URL): the option's pattern, the parser and urllib agree
on it (issue 39, class 7), and its credentials are never shown (class 6). URLs are generated from parts, valid
and broken, so the agreement is checked over the grammar, not over a few examples."""

from __future__ import annotations

import itertools
import random
import re
import urllib.parse
import urllib.request

import pytest

from kvtool.errors import UsageError
from kvtool.io import urls
from kvtool.options.eval import EvalOptions

HOSTS_OK = ["127.0.0.1", "localhost", "gpu-a", "a" * 63, "x.example.com", "srv_1.lan", "host.", "[::1]",
            "[2001:db8::8a2e:370:7334]", "[::ffff:192.0.2.128]", "[fe80::]", "[1:2:3:4:5:6:7:8]", "xn--bcher-kva.de"]
HOSTS_BAD = ["", "a" * 64, "a..b", ".a", "[::1", "::1]", "[::g]", "[1:2:3:4:5:6:7:8:9]", "[fe80::1%25eth0]",
             "[v1.x]", "bücher.de", "h h", "h\tb", "[::1.2.3.256]", "[01.2.3.4]", "h%41"]
PORTS_OK = ["", ":1", ":80", ":8000", ":65535"]
PORTS_BAD = [":", ":0", ":65536", ":99999", ":08x", ":-1", ":٣"]
PATHS_OK = ["", "/", "/v1", "/v1/completions", "/api/v1/", "/a%20b", "/~u/x;y=1"]
PATHS_BAD = ["?x=1", "#f", "/a b", "/\u202e", "/%zz", "/a?b"]
USERS_OK = ["", "u@", "u:p@", "u:p%40ss@", ":p@", "u:p!$&'()*+,;=@"]
USERS_BAD = ["u:p/q@", "u p@", "u:p@q@"]
SCHEMES_OK = ["http://", "https://"]
SCHEMES_BAD = ["", "ftp://", "file://", "HTTP://", "http:/", "http:///"]


def _cases():
    ok = ["".join(p) for p in itertools.product(SCHEMES_OK, USERS_OK[:2], HOSTS_OK, PORTS_OK[:3], PATHS_OK[:3])]
    bad = []
    rng = random.Random(7)
    parts = [SCHEMES_OK, USERS_OK, HOSTS_OK, PORTS_OK, PATHS_OK]
    broken = [SCHEMES_BAD, USERS_BAD, HOSTS_BAD, PORTS_BAD, PATHS_BAD]
    for which, choices in enumerate(broken):
        for b in choices:
            for _ in range(3):
                p = [rng.choice(c) for c in parts]
                p[which] = b
                bad.append("".join(p))
    return ok, bad


OK, BAD = _cases()


def _accepted(url: str) -> bool:
    try:
        urls.parse(url)
        return True
    except urls.BadURL:
        return False


@pytest.mark.parametrize("url", OK)
def test_the_pattern_the_parser_and_urllib_accept_a_valid_url(url):
    assert re.fullmatch(urls.SERVER_URL, url) and _accepted(url)
    u = urls.parse(url)
    parts = urllib.parse.urlsplit(u.base + "/v1/models")
    assert parts.port is None or 1 <= parts.port <= 65535
    urllib.request.Request(u.base + "/v1/models")  # urllib takes it
    host = u.host.strip("[]")
    if ":" not in host:
        host.encode("idna")  # what the resolver is given: no 'label too long' later
    assert u.scheme in ("http", "https") and "@" not in u.base


@pytest.mark.parametrize("url", BAD)
def test_the_pattern_and_the_parser_refuse_the_same_broken_url(url):
    matched = bool(re.fullmatch(urls.SERVER_URL, url))
    assert matched == _accepted(url)
    if matched:  # a broken part the grammar still takes must be one urllib takes too (e.g. a user "u:p@q@")
        assert urllib.parse.urlsplit(url).port in (None, *range(1, 65536))
    else:
        with pytest.raises(UsageError, match="must be one of http://HOST"):
            EvalOptions(model="m", server=url)


def test_the_option_declares_the_parsers_grammar():
    from kvtool.options.fields import field_named

    for name in ("server", "baseline_server"):
        spec = field_named(EvalOptions, name).spec
        assert spec.pattern == urls.SERVER_URL and spec.shown is urls.redact


@pytest.mark.parametrize("text, shown", [
    ("http://u:secret@h:1", "http://***@h:1"),
    ("http://secret@h", "http://***@h"),
    ("u:secret@h:80", "***@h:80"),
    ("http://u:sec/ret@h", "http://***@h"),
    ("http://u:sec#ret@h/x", "http://***@h/x"),
    ("http://h:1/path", "http://h:1/path"),
])
def test_redact_hides_whatever_precedes_the_last_at(text, shown):
    assert urls.redact(text) == shown


def test_a_refusal_never_shows_the_password():
    for url in ("http://u:s3cr3t@[::1", "ftp://u:s3cr3t@h", "http://u:s3cr3t@h:0"):
        with pytest.raises(UsageError) as e:
            EvalOptions(model="m", server=url)
        assert "s3cr3t" not in str(e.value) and "***@" in str(e.value)


def test_credentials_become_basic_auth_and_the_api_root_is_dropped():
    u = urls.parse("https://kv:p%40ss@Host.Example:8443/v1/completions")
    assert u.base == "https://host.example:8443" and u.shown == "https://***@host.example:8443"
    assert u.authorization() == {"Authorization": "Basic a3Y6cEBzcw=="}  # base64 of kv:p@ss
    assert u.origin == ("https", "host.example", 8443)
    assert urls.same_origin(u, "https://HOST.example:8443/x") and not urls.same_origin(u, "http://host.example:8443")
    assert not urls.same_origin(u, "https://host.example/x") and not urls.same_origin(u, "ftp://host.example:8443")
