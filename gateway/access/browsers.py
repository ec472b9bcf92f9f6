"""What a web page in the operator's browser cannot make the admin API do. Pure: headers in, a verdict out.

Two attacks reach a gateway on loopback through the operator's browser:

- cross-site writes (CSRF): any page may POST to `http://127.0.0.1:8080/admin/reload` with a body
  typed `text/plain` (or none): a CORS "simple request", sent without a preflight, and with the
  Basic credentials the browser remembers for the dashboard. Admin writes therefore require
  `Content-Type: application/json` (which a page can send cross-site only after a preflight this
  gateway never approves: it sends no CORS headers) and refuse an `Origin` other than the
  gateway's own (browsers send `Origin` with every cross-origin POST, PUT, DELETE and PATCH).
- DNS rebinding: a page at `evil.example` re-points its name at 127.0.0.1 and reads `/admin/*`
  as its own origin. Its requests carry `Host: evil.example`, so without an admin token (nothing
  else tells a browser's request from the operator's) `/admin` and `/dashboard` answer only a
  `Host` that names loopback (`localhost`, `*.localhost`) or is an IP address, which no rebinding
  can forge. With a token, the rebinding page has no credentials for its own origin.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Final

from yarl import URL

DEFAULT_PORTS: Final = frozenset({80, 443})


def authority(value: str) -> tuple[str, int | None] | None:
    """(host, port) of a `Host` header value, lower-cased, without a trailing dot, the port None
    when absent or a default (80, 443: a TLS-terminating proxy in front leaves the scheme unknown);
    None when it does not parse."""
    value = value.strip().lower()
    if value.startswith("["):  # [v6]:port
        host, sep, rest = value[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            return None
        port_text = rest[1:]
    else:
        host, _, port_text = value.partition(":")
    port: int | None = None
    if port_text:
        if not port_text.isdigit() or not 0 < int(port_text) < 65536:
            return None
        port = int(port_text)
    host = host.removesuffix(".")
    if not host:
        return None
    return host, None if port in DEFAULT_PORTS else port


def local_host(value: str | None) -> bool:
    """Whether a `Host` header names this machine in a way DNS rebinding cannot forge: a loopback
    name (`localhost`, `*.localhost`, RFC 6761) or a literal IP address. A request without `Host`
    (HTTP/1.0) did not come from a browser."""
    if value is None:
        return True
    parsed = authority(value)
    if parsed is None:
        return False
    host = parsed[0]
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def same_origin(origin: str, host: str | None) -> bool:
    """Whether an `Origin` header is the gateway's own: the authority the request was sent to (its
    `Host`). `null` (sandboxed frames, local files) never is."""
    if host is None:
        return False
    try:
        url = URL(origin.strip())
    except ValueError:
        return False
    if url.scheme not in ("http", "https") or not url.host or url.path not in ("", "/"):
        return False
    port = url.explicit_port
    theirs = (url.host.lower().removesuffix("."), None if port in DEFAULT_PORTS else port)
    return theirs == authority(host)


def json_typed(headers: Mapping[str, str]) -> bool:
    """Whether the request says its body is JSON (`application/json`, parameters allowed)."""
    media = headers.get("content-type", "").partition(";")[0].strip().lower()
    return media == "application/json"
