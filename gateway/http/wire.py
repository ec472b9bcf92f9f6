"""Bytes both fronts write themselves: status lines, the `Date` header, and complete error responses
(the native front's, and the refusals our aiohttp protocol answers before aiohttp sees a request)."""

from __future__ import annotations

import functools
import time
from email.utils import formatdate
from http import HTTPStatus

from ..errors import GatewayError

_date_second = -1
_date_line = ""


@functools.cache
def status_line(status: int) -> str:
    try:
        phrase = HTTPStatus(status).phrase
    except ValueError:
        phrase = "Unknown"
    return f"HTTP/1.1 {status} {phrase}\r\n"


def date_line() -> str:
    """`Date: <IMF-fixdate>\\r\\n` for now (RFC 9110 6.6.1), formatted once per second."""
    global _date_second, _date_line
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_line = f"Date: {formatdate(now, usegmt=True)}\r\n"
    return _date_line


def error_bytes(error: GatewayError, request_id: str | None = None, *, close: bool = True) -> bytes:
    """A complete OpenAI-shaped error response."""
    body = error.render()
    head = [status_line(error.status), date_line(), "Content-Type: application/json\r\n",
            f"Content-Length: {len(body)}\r\n"]
    head.extend(f"{k}: {v}\r\n" for k, v in error.headers.items())
    if request_id:
        head.append(f"x-request-id: {request_id}\r\n")
    head.append("Connection: close\r\n\r\n" if close else "\r\n")
    return "".join(head).encode("latin-1") + body
