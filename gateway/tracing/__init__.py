"""OpenTelemetry traces of the requests the gateway serves, with the GenAI semantic conventions, carried
into the engines by `traceparent`. `trace` is what the request path holds (no SDK: it is imported
by the compiled modules), `context` the W3C header and sampling rules (pure), `config` the config's
`tracing` section with the `OTEL_*` variables, `semconv` every attribute name, `sampled` the spans
(the SDK), `export` the batching and what is dropped, `tracer` one per process (`build`, from the
composition root). May import observability/, routing/, state/, backends/; the proxy imports it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from ..settings import Settings
from .config import TraceConfig, resolve
from .trace import Leg, Trace

if TYPE_CHECKING:
    from .sampled import Throughput
    from .tracer import Tracer

__all__ = ["Leg", "Trace", "TraceConfig", "build", "resolve"]


def build(
    settings: Settings, *, throughput: Throughput, registry: CollectorRegistry | None = None,
    env: Mapping[str, str] | None = None,
) -> Tracer | None:
    """This process's tracer, or None when tracing is off (then the SDK is not even imported)."""
    config = resolve(settings.tracing, os.environ if env is None else env)
    if config is None:
        return None
    from .tracer import Tracer

    return Tracer(config, throughput=throughput, registry=registry)
