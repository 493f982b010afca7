"""A server's URL (`eval --server`, `--baseline-server`, a recipe's `server` / `baseline_server`): one grammar, one
parser, one way to show it.

`SERVER_URL` is the grammar, and the option declaration's pattern (kvtool/options/eval.py): what it accepts,
`parse` accepts and urllib, http.client and the resolver take (tests/io/test_urls.py generates URLs
of every part and checks all three agree), so a URL that passes the option check never fails later as a
traceback. It is RFC 3986's `http` / `https` URL, narrowed to what a server root needs:
- scheme `http` or `https` (lower case);
- optional `user:password@` (RFC 3986 userinfo characters, %XX escapes), sent as HTTP Basic authentication and
  never shown: `redact` replaces it with `***` wherever kvtool prints a URL (errors, plans, reports, JSON);
- host: DNS labels of 1 to 63 letters, digits, `-` or `_` (ASCII; an internationalised name goes in its
  `xn--` form), or an IPv6 address in brackets (RFC 3986 IPv6address; no zone id, no IPvFuture);
- optional port 1..65535;
- optional path (a server mounted under a prefix); no query, no fragment.
"""

from __future__ import annotations

import base64
import re
import urllib.parse
from dataclasses import dataclass

_H16 = r"[0-9A-Fa-f]{1,4}"
_OCTET = r"(?:25[0-5]|2[0-4][0-9]|1[0-9]{2}|[1-9]?[0-9])"
_LS32 = rf"(?:{_H16}:{_H16}|{_OCTET}(?:\.{_OCTET}){{3}})"
_IPV6 = "|".join([  # RFC 3986 section 3.2.2, IPv6address
    rf"(?:{_H16}:){{6}}{_LS32}",
    rf"::(?:{_H16}:){{5}}{_LS32}",
    rf"(?:{_H16})?::(?:{_H16}:){{4}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,1}}{_H16})?::(?:{_H16}:){{3}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,2}}{_H16})?::(?:{_H16}:){{2}}{_LS32}",
    rf"(?:(?:{_H16}:){{0,3}}{_H16})?::{_H16}:{_LS32}",
    rf"(?:(?:{_H16}:){{0,4}}{_H16})?::{_LS32}",
    rf"(?:(?:{_H16}:){{0,5}}{_H16})?::{_H16}",
    rf"(?:(?:{_H16}:){{0,6}}{_H16})?::",
])
_LABEL = r"[A-Za-z0-9_-]{1,63}"
_PCT = r"%[0-9A-Fa-f]{2}"
_USERINFO = rf"(?:[A-Za-z0-9._~!$&'()*+,;=:-]|{_PCT})*@"
_PORT = r"(?:6553[0-5]|655[0-2][0-9]|65[0-4][0-9]{2}|6[0-4][0-9]{3}|[1-5][0-9]{4}|[1-9][0-9]{0,3})"
_PATH = rf"(?:/(?:[A-Za-z0-9._~!$&'()*+,;=:@-]|{_PCT})*)*"

SERVER_URL = (rf"https?://(?:{_USERINFO})?(?:{_LABEL}(?:\.{_LABEL})*\.?|\[(?:{_IPV6})\])"
              rf"(?::{_PORT})?{_PATH}")
SERVER_URL_FORMS = ("http://HOST[:PORT]", "https://HOST[:PORT]")
_COMPILED = re.compile(SERVER_URL)


class BadURL(ValueError):
    """A value that is no server URL of SERVER_URL's grammar (its message is safe to print: no credentials)."""


@dataclass(frozen=True)
class ServerURL:
    scheme: str
    host: str  # as in the URL (an IPv6 address in brackets), lower case
    port: int  # the effective port (80 / 443 when none is given)
    path: str  # the prefix the server is mounted under, without a trailing "/" ("" at the root)
    user: str | None = None  # unquoted
    password: str | None = None

    @property
    def origin(self) -> tuple[str, str, int]:
        """(scheme, host, port): a redirect is followed only within it."""
        return self.scheme, self.host, self.port

    @property
    def base(self) -> str:
        """The URL kvtool sends requests under: no credentials (they go in the Authorization header)."""
        default = {"http": 80, "https": 443}[self.scheme]
        port = "" if self.port == default else f":{self.port}"
        return f"{self.scheme}://{self.host}{port}{self.path}"

    @property
    def shown(self) -> str:
        """How kvtool prints it: credentials as ***."""
        return self.base.replace("://", "://***@", 1) if self.user is not None else self.base

    def authorization(self) -> dict[str, str]:
        """The Authorization header the URL's user:password stands for (HTTP Basic, RFC 7617), or none."""
        if self.user is None:
            return {}
        token = base64.b64encode(f"{self.user}:{self.password or ''}".encode("utf-8")).decode("ascii")
        return {"Authorization": f"Basic {token}"}


def parse(text: object) -> ServerURL:
    """A server URL of SERVER_URL's grammar (the API root `/v1` or `/v1/completions` at its end is dropped: kvtool
    adds the paths itself). Raises BadURL with a message that never holds the credentials."""
    if not isinstance(text, str) or not _COMPILED.fullmatch(text):
        raise BadURL(f"must be one of {', '.join(SERVER_URL_FORMS)}, got {redact(str(text))!r:.80}")
    try:  # the grammar guarantees these; a failure here is a disagreement the tests look for, never a traceback
        parts = urllib.parse.urlsplit(text)
        port = parts.port or {"http": 80, "https": 443}[parts.scheme]
        host = parts.hostname or ""
    except (ValueError, KeyError) as exc:
        raise BadURL(f"cannot be parsed ({exc}), got {redact(text)!r:.80}") from None
    if ":" in host:
        host = f"[{host}]"
    path = parts.path.rstrip("/")
    for suffix in ("/v1/completions", "/v1"):  # the API root as well as the server root
        if path.endswith(suffix):
            path = path[: -len(suffix)]
            break
    user = urllib.parse.unquote(parts.username) if parts.username is not None else None
    password = urllib.parse.unquote(parts.password) if parts.password is not None else None
    return ServerURL(parts.scheme, host.lower(), port, path, user, password)


def redact(text: str) -> str:
    """`text` with anything that may be credentials replaced by ***: everything between `scheme://` (or the
    start) and the last `@` before the end, whether or not the rest is a valid URL (a password holding `/` or
    `#` unescaped would otherwise show its tail)."""
    at = text.rfind("@")
    if at < 0:
        return text
    scheme = text.find("://")
    start = scheme + 3 if 0 <= scheme < at else 0
    return text[:start] + "***" + text[at:]


def same_origin(url: ServerURL, location: str) -> bool:
    """Whether an absolute http(s) URL is on url's scheme, host and port."""
    try:
        parts = urllib.parse.urlsplit(location)
        scheme = parts.scheme
        host = (parts.hostname or "").lower()
        port = parts.port or {"http": 80, "https": 443}.get(scheme)
    except ValueError:
        return False
    if ":" in host:
        host = f"[{host}]"
    return (scheme, host, port) == url.origin
