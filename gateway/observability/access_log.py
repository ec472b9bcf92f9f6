"""One line per finished request on the `gateway.access` logger (with `listen.access_log: true`): a
Recorder observer, so a gateway without it pays nothing, and every request is in it once, however
it ended (it is fed the one `Outcome` accounting builds).

    access chat moe status=200 backend=vllm-a runtime=vllm duration_ms=41.2 ttft_ms=12.0
           prompt_tokens=12 completion_tokens=30 request_id=... trace_id=4bf92f3577b34da6a3ce929d0e0e4736

`trace_id` is there when tracing is on (sampled or not: a log line and a trace meet on it).
"""

from __future__ import annotations

import logging
from typing import Final

from .outcome import Outcome

log: Final = logging.getLogger("gateway.access")


def access_line(o: Outcome) -> str:
    parts = [f"access {o.endpoint} {o.model} status={o.status} backend={o.backend} runtime={o.runtime}",
             f"duration_ms={o.duration_s * 1000:.1f}"]
    if o.ttft_s is not None:
        parts.append(f"ttft_ms={o.ttft_s * 1000:.1f}")
    if o.usage is not None:
        parts.append(f"prompt_tokens={o.usage.prompt_tokens} completion_tokens={o.usage.completion_tokens}")
    parts.append(f"request_id={o.request_id}")
    if o.trace_id is not None:
        parts.append(f"trace_id={o.trace_id}")
    return " ".join(parts)


def record(o: Outcome) -> None:
    """The Recorder observer."""
    log.info("%s", access_line(o))
