"""An adapter standing in front of another and passing every call through: the base of the wrappers
that change one or two calls (`ResponsesBridge`: Responses served as chat; `CredentialedAdapter`:
the backend's API key on each request). Interpreted, like its subclasses (a compiled class cannot
have interpreted subclasses, see setup.py)."""

from __future__ import annotations

from backends.base import (
    Adapter,
    ClientRequest,
    ErrorBody,
    Load,
    Probe,
    Reply,
    Runtime,
    StreamTranslator,
    UpstreamRequest,
)


class DelegatingAdapter:
    """Every `Adapter` call answered by `inner`; subclasses override the ones they change."""

    def __init__(self, inner: Adapter) -> None:
        self._inner = inner
        self.runtime: Runtime = inner.runtime

    @property
    def liveness(self) -> Probe:
        return self._inner.liveness

    @property
    def readiness(self) -> Probe:
        return self._inner.readiness

    @property
    def load_path(self) -> str:
        return self._inner.load_path

    def parse_load(self, body: bytes, previous: Load | None) -> Load:
        return self._inner.parse_load(body, previous)

    def build_request(self, req: ClientRequest, *, model: str, request_id: str) -> UpstreamRequest:
        return self._inner.build_request(req, model=model, request_id=request_id)

    def stream_translator(self, req: ClientRequest, *, model: str, request_id: str) -> StreamTranslator | None:
        return self._inner.stream_translator(req, model=model, request_id=request_id)

    def translate_response(
        self, req: ClientRequest, status: int, body: bytes, *, model: str, request_id: str
    ) -> Reply:
        return self._inner.translate_response(req, status, body, model=model, request_id=request_id)

    def normalise_error(self, status: int, body: bytes) -> ErrorBody:
        return self._inner.normalise_error(status, body)
