"""The upstream HTTP client of the request path: pooled keep-alive connections to backends.
Imports nothing from the rest of the gateway."""

from .errors import (
    UpstreamClientError,
    UpstreamConnectError,
    UpstreamLocalExhaustion,
    UpstreamProtocolError,
    UpstreamResetError,
)
from .pool import UpstreamPool
from .response import HIGH_WATER_BYTES, UpstreamResponse

__all__ = [
    "HIGH_WATER_BYTES",
    "UpstreamClientError",
    "UpstreamConnectError",
    "UpstreamLocalExhaustion",
    "UpstreamPool",
    "UpstreamProtocolError",
    "UpstreamResetError",
    "UpstreamResponse",
]
