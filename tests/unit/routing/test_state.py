from __future__ import annotations

import pytest

from gateway.routing import RoutingState

from .helpers import doc, features, view


def test_lifecycle_learns_latency_and_keeps_the_index() -> None:
    state = RoutingState()
    a = view("a", running=3)
    f = features(doc(1, 4000))
    ticket = state.dispatched(a, f)
    assert ticket.sent.predicted_blocks == 0
    assert ticket.uncached_tokens == f.prompt_tokens
    assert state.latency["a"].backlog_tokens == f.prompt_tokens
    state.first_token(ticket, 0.5)
    assert state.latency["a"].backlog_tokens == 0
    assert state.latency["a"].prefill_tokens_per_s == pytest.approx(f.prompt_tokens / 0.5)
    state.completed(ticket, cached_tokens=0, prompt_tokens=f.prompt_tokens, itl_s=0.03)
    assert state.latency["a"].tpot_s(4) == 0.03  # observed at running 3 + this request
    again = state.dispatched(a, f)
    assert again.sent.predicted_blocks == len(f.chain)
    assert again.uncached_tokens < 16


def test_engine_reporting_less_cache_than_predicted_corrects_the_index() -> None:
    state = RoutingState()
    a = view("a")
    f = features(doc(1, 4000))
    state.completed(state.dispatched(a, f), cached_tokens=None, prompt_tokens=None, itl_s=None)
    ticket = state.dispatched(a, f)
    state.completed(ticket, cached_tokens=0, prompt_tokens=1000, itl_s=None)
    assert state.index.match("a", f.chain, 1) == 0


def test_failure_before_the_engine_did_work_is_undone() -> None:
    state = RoutingState()
    f = features(doc(1, 4000))
    ticket = state.dispatched(view("a"), f)
    state.failed(ticket, reached_engine=False)
    assert state.index.size("a") == 0
    assert state.latency["a"].backlog_tokens == 0
    kept = state.dispatched(view("a"), f)
    state.failed(kept, reached_engine=True)
    assert state.index.size("a") == len(f.chain)


def test_first_token_is_counted_once_and_forget_drops_a_backend() -> None:
    state = RoutingState()
    f = features(doc(1, 4000))
    ticket = state.dispatched(view("a"), f)
    state.first_token(ticket, 1.0)
    state.first_token(ticket, 1.0)
    state.completed(ticket, cached_tokens=None, prompt_tokens=None, itl_s=None)
    assert state.latency["a"].backlog_tokens == 0
    state.forget("a")
    assert state.index.size("a") == 0
    state.retain({"b"})
    assert "a" not in state.latency
