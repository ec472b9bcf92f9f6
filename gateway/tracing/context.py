"""W3C trace context (`traceparent`, `tracestate`) and the sampling decision: pure functions.

The decision is made here, before any span exists, so that a request that is not sampled costs no
SDK call at all: it only carries its trace id (for `x-trace-id` and the access log) and passes a
`traceparent` with the sampled flag off upstream, so the engine does not record it either. It is the
SDK's own rule, written out (`tests/unit/tracing` checks it against the SDK's samplers): with a
parent, a parent-based sampler follows the parent's sampled flag; otherwise the trace id's lower 64
bits below `ratio * 2**64` are sampled (`TraceIdRatioBased`), so every process that sees the same
trace id decides alike.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

TRACEPARENT: Final = "traceparent"
TRACESTATE: Final = "tracestate"
_HEX: Final = frozenset("0123456789abcdef")
_LOW64: Final = (1 << 64) - 1
MAX_TRACESTATE: Final = 512  # W3C: a vendor may drop a longer tracestate rather than truncate it


@dataclass(frozen=True, slots=True)
class Parent:
    """A caller's span, from its `traceparent` (and `tracestate`, kept verbatim)."""

    trace_id: int
    span_id: int
    sampled: bool
    tracestate: str | None = None


def _hex(field: str, length: int) -> int | None:
    if len(field) != length or not _HEX.issuperset(field):
        return None
    value = int(field, 16)
    return value or None  # all zeros is invalid


def parse_traceparent(value: str, tracestate: str | None = None) -> Parent | None:
    """The caller's span, or None for a header that is not a valid W3C `traceparent` (then the
    request starts a trace of its own, as the spec says). Version 00 has exactly four fields; a
    later version may append fields, which are ignored; version ff is invalid."""
    parts = value.strip().split("-")
    if len(parts) < 4:
        return None
    version, trace, span, flags = parts[0], parts[1], parts[2], parts[3]
    if len(version) != 2 or not _HEX.issuperset(version) or version == "ff" or (version == "00" and len(parts) != 4):
        return None
    trace_id, span_id = _hex(trace, 32), _hex(span, 16)
    if trace_id is None or span_id is None or len(flags) != 2 or not _HEX.issuperset(flags):
        return None
    state = tracestate.strip() if tracestate else None
    if state is not None and (not state or len(state) > MAX_TRACESTATE):
        state = None
    return Parent(trace_id, span_id, bool(int(flags, 16) & 1), state)


def parent_of(headers: Mapping[str, str]) -> Parent | None:
    """The caller's span from a request's headers (any mapping with lowercase-insensitive `get`: the
    native front's lowercase dict, aiohttp's CIMultiDict, gRPC metadata as a dict)."""
    value = headers.get(TRACEPARENT)
    return parse_traceparent(value, headers.get(TRACESTATE)) if value else None


def format_traceparent(trace_id: int, span_id: int, sampled: bool) -> str:
    return f"00-{trace_id:032x}-{span_id:016x}-{'01' if sampled else '00'}"


def trace_id_hex(trace_id: int) -> str:
    return f"{trace_id:032x}"


@dataclass(frozen=True, slots=True)
class Sampler:
    """`OTEL_TRACES_SAMPLER` as a value: `ratio` of the traces started here (1.0: all, 0.0: none),
    and whether a caller's sampled flag decides instead (the `parentbased_*` samplers)."""

    ratio: float
    parent_based: bool = True

    @property
    def bound(self) -> int:
        return round(self.ratio * (1 << 64))

    def sampled(self, trace_id: int, parent: Parent | None) -> bool:
        if parent is not None and self.parent_based:
            return parent.sampled
        return (trace_id & _LOW64) < self.bound


SAMPLERS: Final = {
    "always_on": (1.0, False), "always_off": (0.0, False), "traceidratio": (None, False),
    "parentbased_always_on": (1.0, True), "parentbased_always_off": (0.0, True),
    "parentbased_traceidratio": (None, True),
}
