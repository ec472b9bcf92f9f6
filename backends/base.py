"""What every runtime adapter provides, and the values it hands to the gateway.

An adapter never performs I/O. It says which URL to call and how to read the answer; the gateway's
proxy and health poller do the calling. That keeps every translation testable on captured bytes.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol


class LoadParseError(ValueError):
    """A load report the adapter cannot read (the poller keeps the previous value)."""


class TranslationError(ValueError):
    """A client request this runtime cannot express (the gateway answers 400 with the message)."""


class Runtime(enum.StrEnum):
    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"  # trtllm-serve (OpenAI-compatible)
    TRITON = "triton"  # Triton Inference Server with the TensorRT-LLM backend (generate extension)


class Endpoint(enum.StrEnum):
    CHAT = "chat"  # POST /v1/chat/completions
    COMPLETIONS = "completions"  # POST /v1/completions
    RESPONSES = "responses"  # POST /v1/responses
    EMBEDDINGS = "embeddings"  # POST /v1/embeddings
    TOKENIZE = "tokenize"  # POST /tokenize (vLLM and SGLang)
    DETOKENIZE = "detokenize"  # POST /detokenize


@dataclass(frozen=True, slots=True)
class Load:
    """Engine-reported load, normalised across runtimes. `None` means the runtime does not say."""

    running: float | None = None
    waiting: float | None = None
    kv_usage: float | None = None  # fraction 0..1 of KV capacity in use
    prefix_hit_rate: float | None = None  # fraction 0..1 of prompt tokens served from cache
    block_size: int | None = None  # prefix-cache granularity in tokens
    # Cumulative token counters (for rate-based hit ratios); None when not exposed.
    prefix_queries_total: float | None = None
    prefix_hits_total: float | None = None
    # each data-parallel rank's own running/waiting/kv_usage, by rank (vLLM's `engine` label,
    # SGLang's `dp_rank`); empty when the engine reports one set (no DP, or DP it does not break down)
    per_rank: tuple[Load, ...] = ()


@dataclass(slots=True, unsafe_hash=True)
class Usage:
    prompt_tokens: Final[int]
    completion_tokens: Final[int]
    cached_tokens: Final[int | None]  # None when the runtime does not report it

    def __init__(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> None:
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.cached_tokens = cached_tokens


@dataclass(slots=True, unsafe_hash=True)
class Reply:
    """A translated non-streaming response body and the usage read from it (parsed once)."""

    body: Final[bytes]
    usage: Final[Usage | None]

    def __init__(self, body: bytes, usage: Usage | None) -> None:
        self.body = body
        self.usage = usage


@dataclass(slots=True, unsafe_hash=True)
class UpstreamRequest:
    """One HTTP request to a backend: everything the proxy needs to send it."""

    path: Final[str]
    body: Final[bytes]
    headers: Final[Mapping[str, str]]

    def __init__(self, path: str, body: bytes, headers: Mapping[str, str] | None = None) -> None:
        self.path = path
        self.body = body
        self.headers = {} if headers is None else headers


@dataclass(slots=True, unsafe_hash=True)
class ClientRequest:
    """The parts of a client's OpenAI request that adapters translate from.

    `body` is the parsed JSON object (already validated to be a dict with the fields routing needs).
    """

    endpoint: Final[Endpoint]
    body: Final[dict[str, Any]]
    stream: Final[bool]
    include_usage: Final[bool]  # the client asked for a usage chunk (stream_options.include_usage)
    # Unix seconds when the gateway received the request. Adapters that synthesise OpenAI objects
    # (Triton) use it for `created`, since adapters never read the clock themselves; 0 when unset.
    created: Final[int | None]

    def __init__(
        self, endpoint: Endpoint, body: dict[str, Any], stream: bool, include_usage: bool, created: int | None = None
    ) -> None:
        self.endpoint = endpoint
        self.body = body
        self.stream = stream
        self.include_usage = include_usage
        self.created = created


@dataclass(frozen=True, slots=True)
class Probe:
    """How to check a backend: a GET on `path`; `ok` lists the statuses that mean healthy."""

    path: str
    ok: frozenset[int] = frozenset({200})
    timeout_s: float = 5.0


@dataclass(frozen=True, slots=True)
class ErrorBody:
    """An upstream error normalised to OpenAI's nested shape."""

    message: str
    type: str
    param: str | None = None
    code: str | int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class UpstreamFormatError(ValueError):
    """A 2xx upstream body that an adapter must translate (Triton) is not what the runtime promises.
    The gateway answers 502: the backend, not the client, is at fault."""


class StreamTranslator(Protocol):
    """Turns upstream streaming bytes into OpenAI SSE bytes for the client, incrementally.

    `feed` receives whatever bytes arrived (not aligned to events) and returns the bytes to send now
    (possibly empty). `close` returns any trailing bytes (e.g. a synthesised `[DONE]`).
    """

    def feed(self, data: bytes) -> bytes: ...

    def close(self) -> bytes: ...


class Adapter(Protocol):
    """One serving runtime's protocol facts and translations. Implementations are stateless."""

    runtime: Runtime

    @property
    def liveness(self) -> Probe: ...

    @property
    def readiness(self) -> Probe: ...

    @property
    def load_path(self) -> str:
        """GET path whose body `parse_load` understands (metrics)."""
        ...

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        """Read a load snapshot from the body served at `load_path`.

        `previous` lets runtimes with destructive or partial reports (trtllm-serve's JSON queue)
        keep the last known value.
        """
        ...

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        """Translate a client request into the backend's request. Pure."""
        ...

    def stream_translator(self, req: ClientRequest, *, model: str, request_id: str) -> StreamTranslator | None:
        """A translator from the runtime's stream to OpenAI SSE, or None when the runtime already
        speaks OpenAI SSE (the gateway then relays its events, rewriting only the model name)."""
        ...

    def translate_response(
        self, req: ClientRequest, status: int, body: bytes, *, model: str, request_id: str
    ) -> Reply:
        """Translate a non-streaming 2xx body into an OpenAI response body plus its usage. `model` is
        the name the client asked for. Raises UpstreamFormatError when the body is unusable."""
        ...

    def normalise_error(self, status: int, body: bytes) -> ErrorBody:
        """Map a non-2xx upstream body (any runtime shape) to OpenAI's error shape."""
        ...
