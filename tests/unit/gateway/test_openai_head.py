from __future__ import annotations

import pytest

from backends.base import Endpoint
from gateway.errors import InvalidRequest
from gateway.proxy.request import parse_request


def test_parses_what_routing_needs() -> None:
    parsed = parse_request(
        b'{"model":"m","messages":[{"role":"user","content":"hi"}],"stream":true,'
        b'"stream_options":{"include_usage":true},"foo":1}',
        Endpoint.CHAT,
    )
    assert parsed.model == "m"
    assert parsed.request.stream
    assert parsed.request.include_usage
    assert parsed.request.body["foo"] == 1  # unknown fields are kept for the backend


@pytest.mark.parametrize(
    ("raw", "endpoint", "param"),
    [
        (b'{"model": "x", "messages": [', Endpoint.CHAT, None),
        (b"[1,2]", Endpoint.CHAT, None),
        (b'{"messages":[{"role":"user","content":"x"}]}', Endpoint.CHAT, "model"),
        (b'{"model":5,"messages":[{"role":"user","content":"x"}]}', Endpoint.CHAT, "model"),
        (b'{"model":"m"}', Endpoint.CHAT, "messages"),
        (b'{"model":"m","messages":[]}', Endpoint.CHAT, "messages"),
        (b'{"model":"m","messages":["hi"]}', Endpoint.CHAT, "messages"),
        (b'{"model":"m"}', Endpoint.COMPLETIONS, "prompt"),
        (b'{"model":"m","prompt":"x","stream":"yes"}', Endpoint.COMPLETIONS, "stream"),
        (b'{"model":"m","prompt":"x","n":0}', Endpoint.COMPLETIONS, "n"),
        (b'{"model":"m","prompt":"x","max_tokens":-1}', Endpoint.COMPLETIONS, "max_tokens"),
        (b'{"model":"m","prompt":"x","max_tokens":"10"}', Endpoint.COMPLETIONS, "max_tokens"),
        (b'{"model":"m","prompt":"x","max_tokens":true}', Endpoint.COMPLETIONS, "max_tokens"),
        (b"\xff\xfe", Endpoint.CHAT, None),
    ],
)
def test_client_mistakes_are_400s_naming_the_field(raw: bytes, endpoint: Endpoint, param: str | None) -> None:
    with pytest.raises(InvalidRequest) as info:
        parse_request(raw, endpoint)
    assert info.value.status == 400
    assert info.value.param == param
