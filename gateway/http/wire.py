"""Bytes both fronts write themselves: status lines, the `Date` header, and complete error responses
(the native front's, and the refusals our aiohttp protocol answers before aiohttp sees a request)."""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

from ..errors import GatewayError

_date_second = -1
_date_line = ""
_status_lines: dict[int, str] = {}


def status_line(status: int) -> str:
    line = _status_lines.get(status)
    if line is None:
        try:
            phrase = HTTPStatus(status).phrase
        except ValueError:
            phrase = "Unknown"
        line = _status_lines[status] = f"HTTP/1.1 {status} {phrase}\r\n"
    return line


def date_line() -> str:
    """`Date: <IMF-fixdate>\\r\\n` for now (RFC 9110 6.6.1), formatted once per second. (The native
    front reads `Front.date` instead, refreshed by its once-a-second sweep: no clock read per response.)"""
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
