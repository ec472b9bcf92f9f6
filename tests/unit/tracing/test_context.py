"""The W3C trace context and the sampling decision (pure): what a header means, and that deciding
before any span exists decides exactly as the OpenTelemetry SDK's own samplers would."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from opentelemetry.sdk.trace.sampling import Decision, ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, set_span_in_context

from gateway.tracing.context import Parent, Sampler, format_traceparent, parent_of, parse_traceparent

IDS = st.integers(min_value=1, max_value=(1 << 128) - 1)
SPANS = st.integers(min_value=1, max_value=(1 << 64) - 1)
RATIOS = st.sampled_from([0.0, 0.01, 0.25, 0.5, 0.999, 1.0]) | st.floats(min_value=0.0, max_value=1.0)


@given(IDS, SPANS, st.booleans())
def test_what_is_sent_upstream_reads_back_as_the_same_span(trace_id: int, span_id: int, sampled: bool) -> None:
    header = format_traceparent(trace_id, span_id, sampled)
    assert len(header) == 55
    assert parse_traceparent(header) == Parent(trace_id, span_id, sampled)


@pytest.mark.parametrize("header", [
    "", "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",  # three fields
    "00-00000000000000000000000000000000-00f067aa0ba902b7-01",  # an all-zero trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",  # an all-zero span id
    "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",  # upper case
    "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",  # version ff
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",  # version 00 has four fields
    "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",  # short trace id
    "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1",  # short flags
    "0x-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
])
def test_a_header_that_is_not_a_valid_traceparent_starts_a_new_trace(header: str) -> None:
    assert parse_traceparent(header) is None


def test_a_later_version_may_carry_more_fields_and_the_sampled_flag_is_one_bit() -> None:
    parent = parse_traceparent("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-03-future", "a=1,b=2")
    assert parent == Parent(0x4bf92f3577b34da6a3ce929d0e0e4736, 0x00f067aa0ba902b7, True, "a=1,b=2")
    assert parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-02") is not None
    assert not parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-02").sampled  # type: ignore[union-attr]
    assert parent_of({"x": "y"}) is None
    assert parent_of({"traceparent": " 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01 "}) is not None


def test_an_oversized_tracestate_is_dropped_not_truncated() -> None:
    parent = parse_traceparent("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "k=" + "v" * 600)
    assert parent is not None
    assert parent.tracestate is None


def _sdk(ratio: float, parent_based: bool, parent: Parent | None, trace_id: int) -> bool:
    root = TraceIdRatioBased(ratio)
    sampler = ParentBased(root) if parent_based else root
    context = None
    if parent is not None:
        flags = TraceFlags(TraceFlags.SAMPLED if parent.sampled else TraceFlags.DEFAULT)
        remote = SpanContext(parent.trace_id, parent.span_id, is_remote=True, trace_flags=flags)
        context = set_span_in_context(NonRecordingSpan(remote))
    result = sampler.should_sample(context, trace_id, "chat m")
    return result.decision is Decision.RECORD_AND_SAMPLE


@given(RATIOS, st.booleans(), IDS, st.none() | st.tuples(SPANS, st.booleans()))
def test_the_decision_is_the_sdks_for_every_ratio_trace_and_parent(
    ratio: float, parent_based: bool, trace_id: int, caller: tuple[int, bool] | None,
) -> None:
    parent = None if caller is None else Parent(trace_id, caller[0], caller[1])
    assert Sampler(ratio, parent_based).sampled(trace_id, parent) == _sdk(ratio, parent_based, parent, trace_id)


def test_the_ratio_is_the_share_of_traces_sampled() -> None:
    ids = [(i * 0x9E3779B97F4A7C15 * 0x10000000000000001) % (1 << 128) for i in range(1, 20001)]
    share = sum(Sampler(0.1).sampled(t, None) for t in ids) / len(ids)
    assert 0.09 < share < 0.11
    assert not any(Sampler(0.0).sampled(t, None) for t in ids[:100])
    assert all(Sampler(1.0).sampled(t, None) for t in ids[:100])
