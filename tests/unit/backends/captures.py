"""Read the real vLLM 0.32.0 transcripts vendored in tests/data (request, then status, headers, body)."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.openmetrics.exposition import generate_latest

from tests.data import VLLM_CAPTURES as CAPTURES


@dataclass(frozen=True)
class Response:
    status: int
    headers: dict[str, str]
    body: bytes


def response(name: str) -> Response:
    raw = (CAPTURES / name).read_bytes()
    _, _, reply = raw.partition(b"### response\n")
    head, _, body = reply.partition(b"\n\n")
    status_line, *header_lines = head.decode().splitlines()
    headers = dict(line.split(": ", 1) for line in header_lines if ": " in line)
    return Response(int(status_line.split()[1]), {k.lower(): v for k, v in headers.items()}, body)


def openmetrics_latest(registry: CollectorRegistry) -> bytes:
    """What a prometheus_client server sends Prometheus 3.x (OpenMetrics, `escaping=underscores`)."""
    body: bytes = generate_latest(registry)  # type: ignore[no-untyped-call]
    return body
