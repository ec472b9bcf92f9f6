"""What vLLM, SGLang and trtllm-serve share: they already speak OpenAI, so the adapter only rewrites.

Requests: the body goes through with `model` set to the backend's model and, when streaming,
`stream_options.include_usage` forced on so the gateway always learns token usage (it strips the usage
chunk again when the client did not ask). Responses: only the top-level `model` is rewritten back to
the name the client used. Errors from any runtime shape are normalised to OpenAI's nested form here,
once, for every adapter (Triton included).
"""

from __future__ import annotations

import http
from collections.abc import Mapping
from typing import Any, Final

import orjson

from backends.base import (
    ClientRequest,
    Endpoint,
    ErrorBody,
    Load,
    Probe,
    Reply,
    Runtime,
    StreamTranslator,
    UpstreamRequest,
    Usage,
)

PATHS: Final = {
    Endpoint.CHAT: "/v1/chat/completions",
    Endpoint.COMPLETIONS: "/v1/completions",
    Endpoint.RESPONSES: "/v1/responses",
    Endpoint.EMBEDDINGS: "/v1/embeddings",
    Endpoint.TOKENIZE: "/tokenize",
    Endpoint.DETOKENIZE: "/detokenize",
}
# the endpoints whose streams are chat/completions chunks (the gateway asks them for a usage chunk)
CHUNKED: Final = frozenset({Endpoint.CHAT, Endpoint.COMPLETIONS})

_TYPE_BY_STATUS: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    429: "rate_limit_error",
}
_MAX_TEXT_IN_MESSAGE: Final = 500


class OpenAICompatAdapter:
    """Base for the OpenAI-compatible runtimes; subclasses supply probes and `parse_load`."""

    __slots__ = ("runtime",)

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @property
    def liveness(self) -> Probe:
        return Probe("/health")

    @property
    def readiness(self) -> Probe:
        return Probe("/health")

    @property
    def load_path(self) -> str:
        return "/metrics"

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        raise NotImplementedError

    def prepare_body(self, req: ClientRequest, *, model: str) -> dict[str, Any]:
        """The JSON object to send. Copies, never mutates, the client's body."""
        body = dict(req.body)
        body["model"] = model
        if req.endpoint not in CHUNKED:
            return body  # Responses streams end with their usage; the other endpoints do not stream
        if req.stream:
            body["stream_options"] = force_include_usage(body.get("stream_options"))
        else:
            # stream_options without stream: vLLM and trtllm-serve answer 400, SGLang ignores it.
            # Dropping it everywhere makes a route behave the same whichever backend serves it.
            body.pop("stream_options", None)
        return body

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        return UpstreamRequest(
            path=PATHS[req.endpoint],
            body=orjson.dumps(self.prepare_body(req, model=model)),
            headers={"content-type": "application/json", "x-request-id": request_id},
        )

    def stream_translator(self, req: ClientRequest, *, model: str, request_id: str) -> StreamTranslator | None:
        return None

    def translate_response(
        self, req: ClientRequest, status: int, body: bytes, *, model: str, request_id: str
    ) -> Reply:
        return rewrite_model(body, model)

    def normalise_error(self, status: int, body: bytes) -> ErrorBody:
        return normalise_error(status, body)


def force_include_usage(options: object) -> object:
    """`stream_options` with `include_usage: true`, keeping the client's other keys.

    A non-object value is returned unchanged: the runtime rejects it with its own 400, which is a
    better answer to the client than a silent repair.
    """
    if options is None:
        return {"include_usage": True}
    if isinstance(options, dict):
        return {**options, "include_usage": True}
    return options


def rewrite_model(body: bytes, model: str) -> Reply:
    """Set the top-level `model` of a JSON object body that has one and read its usage; other
    bodies pass through untouched.

    The rename is a byte replacement of the backend's `"model":"<name>"` (with or without the space
    after the colon) when that key occurs exactly once, which is the top-level one; the body is only
    re-serialised when the bytes do not allow that. A compact body is read without parsing it whole
    (`_read_in_place`); any other is parsed once."""
    reply = _read_in_place(body, model)
    return reply if reply is not None else _rewrite_parsed(body, model)


def _rewrite_parsed(body: bytes, model: str) -> Reply:
    """`rewrite_model` by parsing the whole body."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return Reply(body, None)
    if not isinstance(obj, dict):
        return Reply(body, None)
    usage = parse_usage(obj)
    old = obj.get("model")
    if old == model or "model" not in obj:  # tokenize answers name no model: nothing to rename
        return Reply(body, usage)
    if isinstance(old, str) and body.count(b'"model"') == 1:
        for key, new in _model_keys(old, model):
            if body.find(key) >= 0:  # (not `in`: bytes' `in` raises and clears a TypeError)
                return Reply(body.replace(key, new, 1), usage)
    obj["model"] = model
    return Reply(orjson.dumps(obj), usage)


_COMMA: Final = 44  # ord(","): in compact JSON a key follows a comma or the object's opening brace
_BRACE: Final = 123  # ord("{")


def _read_in_place(body: bytes, model: str) -> Reply | None:
    """`rewrite_model` for a compact JSON object whose `model` is an unescaped string, reading only
    the part before `model` and the part from the top-level `usage` on (an 800-byte chat answer
    parses in a fifth of the instructions); None when the body is not of that shape.

    Why the keys found are the top-level ones: a `"usage"` after `,` or `{` begins a key (a quote
    after those is never escaped, so it opens a string, and a string that `:` follows is a key).
    Parsed with a `{` in front, the rest of the body from there is one object exactly when that key
    sits directly in the outermost object: at a deeper level the rest closes more objects than it
    opens. The `model` key is the outermost object's when nothing before it opens another one. A
    body that is not JSON between the two parts is not noticed (its model is renamed, its usage
    read), where the full parse would pass it on unread: backends answer a 2xx with JSON."""
    if not body.startswith(b"{") or body.count(b'"model"') > 1:
        return None
    usage = None
    at = body.rfind(b'"usage"')
    if at >= 0:
        before = body[at - 1]
        if before != _COMMA and before != _BRACE:
            return None
        try:
            rest = orjson.loads(b"{" + body[at:])
        except orjson.JSONDecodeError:
            return None  # not the outermost object's usage (or not JSON): the full parse decides
        usage = parse_usage(rest)
    at = body.find(b'"model"')
    if at < 0:
        return Reply(body, usage)  # tokenize answers name no model: nothing to rename
    before = body[at - 1]
    head = body[:at]
    if (before != _COMMA and before != _BRACE) or head.count(b"{") != 1 or head.find(b"[") >= 0:
        return None
    start = at + 7  # past `"model"`
    if body[start:start + 2] == b':"':
        start += 2
    elif body[start:start + 3] == b': "':
        start += 3
    else:
        return None  # not a string: the full parse renames it
    end = body.find(b'"', start)
    old = body[start:end]
    if end < 0 or old.find(b"\\") >= 0:
        return None  # escapes: the full parse reads the name
    try:
        if old.decode() == model:
            return Reply(body, usage)
    except UnicodeDecodeError:
        return None
    return Reply(b"%b%b%b" % (body[:start - 1], _quoted(model), body[end + 1:]), usage)


_QUOTED: dict[str, bytes] = {}


def _quoted(model: str) -> bytes:
    """`model` as a JSON string, encoded once per name (a handful: the routes' models)."""
    quoted = _QUOTED.get(model)
    if quoted is None:
        if len(_QUOTED) >= 256:  # names come from clients: never let them grow it unbounded
            _QUOTED.clear()
        quoted = _QUOTED[model] = orjson.dumps(model)
    return quoted


_MODEL_KEYS: dict[tuple[str, str], tuple[tuple[bytes, bytes], ...]] = {}


def _model_keys(old: str, new: str) -> tuple[tuple[bytes, bytes], ...]:
    """The `"model":"<old>"` byte patterns (with and without a space) and their replacements, built
    once per pair of names (a handful: the configured backend and route models)."""
    keys = _MODEL_KEYS.get((old, new))
    if keys is None:
        if len(_MODEL_KEYS) >= 256:  # names come from backends' answers: never let them grow it unbounded
            _MODEL_KEYS.clear()
        quoted_old, quoted_new = _quoted(old), _quoted(new)
        keys = _MODEL_KEYS[(old, new)] = tuple(
            (b'"model"' + sep + quoted_old, b'"model"' + sep + quoted_new) for sep in (b":", b": ")
        )
    return keys


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_usage(obj: Mapping[str, Any]) -> Usage | None:
    """Usage from a response or usage chunk; None when absent or malformed.

    Chat and completions say `prompt_tokens`/`completion_tokens`; embeddings `prompt_tokens` and
    `total_tokens` only (no completion: 0); Responses `input_tokens`/`output_tokens` with
    `input_tokens_details.cached_tokens`. `cached_tokens` stays None unless the runtime reported it
    (vLLM and SGLang only do with a server flag), so "0 cached" and "not reported" stay distinct.
    """
    usage = obj.get("usage")
    if not isinstance(usage, dict):
        return None
    prompt = _int(usage.get("prompt_tokens"))
    if prompt is None:
        return _responses_usage(usage)
    completion = _int(usage.get("completion_tokens"))
    if completion is None:  # embeddings: what the total holds beyond the prompt (0)
        total = _int(usage.get("total_tokens"))
        completion = total - prompt if total is not None and total >= prompt else None
    if completion is None:
        return None
    details = usage.get("prompt_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def _responses_usage(usage: Mapping[str, Any]) -> Usage | None:
    prompt = _int(usage.get("input_tokens"))
    completion = _int(usage.get("output_tokens"))
    if prompt is None or completion is None:
        return None
    details = usage.get("input_tokens_details")
    cached = _int(details.get("cached_tokens")) if isinstance(details, dict) else None
    return Usage(prompt_tokens=prompt, completion_tokens=completion, cached_tokens=cached)


def prefix_hit_rate(hits: float | None, queries: float | None, previous: Load | None) -> float | None:
    """Hit ratio over the last scrape interval when possible, else since the engine started.

    The interval ratio needs the previous cumulative totals and a positive query delta; a counter
    reset (engine restart) makes the delta negative, and then the cumulative ratio is the best guess.
    With no traffic since the last scrape the previous interval's ratio stands.
    """
    if hits is None or queries is None:
        return None
    if previous is not None and previous.prefix_hits_total is not None and previous.prefix_queries_total is not None:
        d_hits = hits - previous.prefix_hits_total
        d_queries = queries - previous.prefix_queries_total
        if d_queries > 0 and 0 <= d_hits <= d_queries:
            return d_hits / d_queries
        if d_queries == 0 and d_hits == 0 and previous.prefix_hit_rate is not None:
            return previous.prefix_hit_rate  # no traffic since the last scrape: no news
    return min(1.0, hits / queries) if queries > 0 else None


def default_error_type(status: int) -> str:
    if status in _TYPE_BY_STATUS:
        return _TYPE_BY_STATUS[status]
    return "server_error" if status >= 500 else "invalid_request_error"


def _status_text(status: int) -> str:
    try:
        return f"{status} {http.HTTPStatus(status).phrase}"
    except ValueError:
        return str(status)


def _plain_text(body: bytes) -> str | None:
    """A short plain-text body worth quoting (trtllm-serve's 503 text), not HTML or binary."""
    text = body.decode("utf-8", errors="replace").strip()
    if not text or text.startswith("<") or len(text) > _MAX_TEXT_IN_MESSAGE or not text.isprintable():
        return None
    return text


def normalise_error(status: int, body: bytes) -> ErrorBody:
    """Map any runtime's error body to OpenAI's shape. Never raises.

    Shapes handled: nested `{"error":{...}}` (vLLM >= 0.10.1, OpenAI, SGLang stream errors), flat
    `{"object":"error","message":...}` (SGLang, trtllm-serve, old vLLM), `{"error":"text"}` (auth,
    trtllm validation, Triton), FastAPI `{"detail":...}`, and anything else (HTML, empty, plain text).
    The runtime's `type` string is kept when present; otherwise it is derived from the status.
    """
    try:
        obj: object = orjson.loads(body) if body.strip() else None
    except orjson.JSONDecodeError:
        obj = None
    source: Mapping[str, Any] = {}
    message: str | None = None
    if isinstance(obj, dict):
        err = obj.get("error")
        if isinstance(err, dict):
            source = err
        elif isinstance(err, str) and err:
            message = err
        elif "message" in obj:
            source = obj
        elif "detail" in obj:
            detail = obj["detail"]
            message = detail if isinstance(detail, str) else orjson.dumps(detail).decode()
    if message is None:
        raw = source.get("message")
        message = raw if isinstance(raw, str) and raw else None
    if message is None:
        quoted = _plain_text(body) if obj is None else None
        message = f"Backend returned HTTP {_status_text(status)}" + (f": {quoted}" if quoted else "")
    type_ = source.get("type")
    param = source.get("param")
    code = source.get("code")
    return ErrorBody(
        message=message,
        type=type_ if isinstance(type_, str) and type_ else default_error_type(status),
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str | int) and not isinstance(code, bool) else None,
    )
