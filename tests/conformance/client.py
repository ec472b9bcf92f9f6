"""A raw HTTP/1.1 client on a blocking socket: it sends exactly the bytes a test gives it and checks
every response it reads for what any response must have (a `Date`, one framing, a body that matches
it). HTTP clients are too polite for this suite: they never pipeline, trickle or lie about lengths."""

from __future__ import annotations

import json
import socket
import time
from dataclasses import dataclass, field
from email.utils import parsedate_to_datetime
from typing import Any

CHAT: dict[str, Any] = {"model": "moe", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
COMPLETION: dict[str, Any] = {"model": "moe", "prompt": "hi", "max_tokens": 4}


def request(method: str, path: str, body: bytes | dict[str, Any] | None = None, *, version: str = "1.1",
            headers: tuple[tuple[str, str], ...] = (), length: bool = True) -> bytes:
    """One request's bytes: `Host`, then `headers`, then `Content-Length` for a body (unless
    `length=False`: the caller frames it)."""
    data = json.dumps(body).encode() if isinstance(body, dict) else body
    lines = [f"{method} {path} HTTP/{version}", "Host: gateway"]
    lines += [f"{name}: {value}" for name, value in headers]
    if data is not None and length:
        lines.append(f"Content-Length: {len(data)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + (data or b"")


def chat(body: dict[str, Any] | None = None, **kwargs: Any) -> bytes:
    return request("POST", "/v1/chat/completions", body or CHAT, **kwargs)


def completion(**kwargs: Any) -> bytes:
    return request("POST", "/v1/completions", COMPLETION, **kwargs)


def get(path: str, **kwargs: Any) -> bytes:
    return request("GET", path, **kwargs)


def chunked(data: bytes, size: int) -> bytes:
    pieces = [data[i:i + size] for i in range(0, len(data), size)]
    return b"".join(b"%x\r\n%b\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"


@dataclass
class Response:
    status: int
    version: str
    headers: dict[str, str]  # lower-cased names
    body: bytes
    interim: list[int] = field(default_factory=list)  # 1xx responses read before this one

    def json(self) -> Any:
        return json.loads(self.body)

    def header(self, name: str) -> str | None:
        return self.headers.get(name)


class ServerClosed(Exception):
    """The server closed the connection before a complete response."""


class Conn:
    """One client connection. Reads wait at most `timeout` seconds (a socket timeout, not a sleep)."""

    def __init__(self, address: tuple[str, int], *, timeout: float = 10.0) -> None:
        self.sock = socket.create_connection(address, timeout=timeout)
        self.buf = b""

    def __enter__(self) -> Conn:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def half_close(self) -> None:
        self.sock.shutdown(socket.SHUT_WR)

    def _fill(self) -> None:
        try:
            chunk = self.sock.recv(65536)
        except ConnectionResetError:
            chunk = b""
        if not chunk:
            raise ServerClosed(self.buf[:200])
        self.buf += chunk

    def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            self._fill()
        line, self.buf = self.buf[:i], self.buf[i + 2:]
        return line

    def _exactly(self, n: int) -> bytes:
        while len(self.buf) < n:
            self._fill()
        data, self.buf = self.buf[:n], self.buf[n:]
        return data

    def _rest(self) -> bytes:
        """Everything until the server closes."""
        try:
            while True:
                self._fill()
        except ServerClosed:
            data, self.buf = self.buf, b""
            return data

    def read_response(self, *, sent_version: str = "1.1") -> Response:
        """The next final response (1xx responses before it are recorded in `interim`), checked."""
        interim: list[int] = []
        while True:
            status_line = self._line().decode("latin-1")
            version, status_text, *_ = status_line.split(" ", 2)
            assert version in ("HTTP/1.1", "HTTP/1.0"), status_line
            status = int(status_text)
            headers: dict[str, str] = {}
            dates = 0
            while line := self._line():
                name, sep, value = line.decode("latin-1").partition(":")
                assert sep, line
                assert name == name.strip(), line
                key = name.lower()
                dates += key == "date"
                headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
            if 100 <= status < 200:
                interim.append(status)
                continue
            break
        assert dates == 1, f"one Date header: {headers}"
        sent = parsedate_to_datetime(headers["date"]).timestamp()
        assert abs(sent - time.time()) < 60, headers["date"]
        length, coding = headers.get("content-length"), headers.get("transfer-encoding")
        assert not (length is not None and coding is not None), f"Content-Length with Transfer-Encoding: {headers}"
        if coding is not None:
            assert coding == "chunked", headers
            assert sent_version == "1.1", headers
            body = self._chunked_body()
        elif length is not None:
            body = self._exactly(int(length))
        else:  # close-delimited: only where the response says it closes or the client spoke HTTP/1.0
            assert headers.get("connection", "").lower() == "close" or sent_version == "1.0", headers
            body = self._rest()
        return Response(status, version, headers, body, interim)

    def _chunked_body(self) -> bytes:
        parts = []
        while (size := int(self._line().split(b";")[0], 16)) > 0:
            parts.append(self._exactly(size))
            assert self._line() == b""
        while self._line():  # trailers
            pass
        return b"".join(parts)

    def interim(self) -> int:
        """Read one 1xx response (e.g. `100 Continue`) and return its status."""
        status = int(self._line().split(b" ", 2)[1])
        while self._line():
            pass
        return status

    def closed_by_server(self) -> bool:
        """Whether the server closes the connection (with nothing more sent) within the timeout."""
        try:
            return not self.buf and self.sock.recv(1) == b""
        except ConnectionResetError:
            return True
        except TimeoutError:
            return False


def assert_openai_error(resp: Response, status: int, code: str | None = None) -> dict[str, Any]:
    assert resp.status == status, (resp.status, resp.body)
    assert "application/json" in resp.headers.get("content-type", ""), resp.headers
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"], error
    assert error["type"], error
    if code is not None:
        assert error["code"] == code, error
    return error  # type: ignore[no-any-return]
