"""Parse only what the gateway needs from an OpenAI request; everything else is forwarded untouched.

Validation here is deliberately shallow: the backend validates sampling parameters itself and its
error reaches the client normalised. We reject only what would make routing or accounting wrong,
with the OpenAI error shape and a 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

from backends.base import ClientRequest, Endpoint
from backends.ranks import strip_client_ranks

from .. import json_codec
from ..errors import InvalidRequest

MAX_N: Final = 128
MAX_TOKENS: Final = 10_000_000
STREAMING: Final = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS, Endpoint.RESPONSES})


@dataclass(slots=True, unsafe_hash=True)
class ParsedRequest:
    model: Final[str]
    request: Final[ClientRequest]

    def __init__(self, model: str, request: ClientRequest) -> None:
        self.model = model
        self.request = request


def with_body(parsed: ParsedRequest, body: dict[str, Any]) -> ParsedRequest:
    """The client's request with `body` in place of its own: a P/D decode leg's body, or an empty
    one once nothing reads it any more (`Relay.stream`: an open stream does not keep its prompt)."""
    r = parsed.request
    return ParsedRequest(parsed.model, ClientRequest(r.endpoint, body, r.stream, r.include_usage, r.created))


def _int_field(body: dict[str, Any], name: str, lo: int, hi: int) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(f"'{name}' must be an integer, got {type(value).__name__}", param=name)
    if not lo <= value <= hi:
        raise InvalidRequest(f"'{name}' must be between {lo} and {hi}, got {value}", param=name)


def _non_empty(value: object) -> bool:
    return isinstance(value, str) or (isinstance(value, list) and bool(value))


def _check_other(body: dict[str, Any], endpoint: Endpoint) -> None:
    """The fields routing needs on the endpoints beyond chat and completions."""
    if endpoint is Endpoint.RESPONSES or endpoint is Endpoint.EMBEDDINGS:
        if not _non_empty(body.get("input")):
            raise InvalidRequest("'input' is required and must be a string or a non-empty array", param="input")
    elif endpoint is Endpoint.TOKENIZE:
        messages = body.get("messages")
        if not _non_empty(body.get("prompt")) and not (isinstance(messages, list) and messages):
            raise InvalidRequest("'prompt' (a string or an array) or 'messages' is required", param="prompt")
    elif endpoint is Endpoint.DETOKENIZE:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise InvalidRequest("'tokens' is required and must be an array of integers", param="tokens")


def parse_request(raw: bytes, endpoint: Endpoint, *, created: int = 0) -> ParsedRequest:
    try:
        body = json_codec.loads(raw)
    except json_codec.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise InvalidRequest("Request body must be a JSON object")
    strip_client_ranks(body)  # a data-parallel rank is the gateway's to choose (`backends/ranks.py`)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidRequest("'model' is required and must be a non-empty string", param="model")
    if endpoint is Endpoint.CHAT:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequest("'messages' is required and must be a non-empty array", param="messages")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str):
                raise InvalidRequest(f"'messages.{i}' must be an object with a string 'role'", param="messages")
    elif endpoint is Endpoint.COMPLETIONS:
        prompt = body.get("prompt")
        if not isinstance(prompt, str | list) or (isinstance(prompt, list) and not prompt):
            raise InvalidRequest("'prompt' is required and must be a string or an array", param="prompt")
    else:
        _check_other(body, endpoint)
    stream = body.get("stream", False)
    if stream is None or endpoint not in STREAMING:
        stream = False  # embeddings and tokenize answer in one body whatever the client asked
    if not isinstance(stream, bool):
        raise InvalidRequest("'stream' must be a boolean", param="stream")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise InvalidRequest("'stream_options' must be an object", param="stream_options")
    include_usage = bool(stream and options and options.get("include_usage")) and endpoint is not Endpoint.RESPONSES
    _int_field(body, "n", 1, MAX_N)
    _int_field(body, "max_output_tokens", 1, MAX_TOKENS)
    _int_field(body, "max_tokens", 1, MAX_TOKENS)
    _int_field(body, "max_completion_tokens", 1, MAX_TOKENS)
    return ParsedRequest(
        model=model,
        request=ClientRequest(
            endpoint=endpoint, body=body, stream=stream, include_usage=include_usage, created=created
        ),
    )
