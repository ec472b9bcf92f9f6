"""The classes every request builds keep their value semantics with a hand-written `__init__`
(`backends/values.py`): each field is set from the argument of its name, `dataclasses.replace` and
equality work, and in the compiled build the `__init__` really is compiled."""

from __future__ import annotations

import dataclasses
import inspect
import sys
from typing import Any

import pytest

from backends.base import ClientRequest, Endpoint, Reply, Runtime, UpstreamRequest, Usage
from backends.capabilities import Feature
from gateway.http.reader import Message
from gateway.observability.outcome import Gaps, Outcome
from gateway.proxy.attempts import Opened
from gateway.proxy.exchange import Exchange
from gateway.proxy.request import ParsedRequest
from gateway.proxy.sse import StreamStats
from gateway.routing.base import (
    NO_PREFIXES,
    BackendView,
    Decision,
    RequestFeatures,
    RouteRequest,
    SlaTarget,
    Snapshot,
)
from gateway.routing.capabilities import Needs
from gateway.routing.latency import LatencyModel
from gateway.routing.prefix_index import Sent
from gateway.routing.state import EXACT, Ticket
from gateway.routing.tokens import TokenPrompt
from gateway.state.outliers import Verdict
from gateway.stats.window import Sample

USAGE = Usage(prompt_tokens=11, completion_tokens=7, cached_tokens=3)
CLIENT = ClientRequest(endpoint=Endpoint.CHAT, body={"model": "m"}, stream=True, include_usage=True, created=5)
GAPS = Gaps.of([0.01, 0.02])
SLA = SlaTarget(ttft_s=0.5, tpot_s=0.05, strict=True)
FEATURES = RequestFeatures(chain=(1, 2), prompt_bytes=128, prompt_tokens=32, affinity_key=7, prefix_key="p",
                           session_key="s", sticky_key="u", sla=SLA, tokens=TokenPrompt([1, 2, 3]))
VIEW = BackendView(name="b", runtime=Runtime.SGLANG, healthy=True, in_flight=2, waiting=1.0, running=3.0,
                   kv_usage=0.5, usd_per_hour=9.0, block_size=16, output_tokens_per_s=100.0)
SENT = Sent(backend="b", chain=(1, 2), stride=1, prompt_bytes=128, predicted_blocks=1, tick=4)

# every field with a value unlike its default, by name
VALUES: list[tuple[type[Any], dict[str, Any]]] = [
    (Usage, {"prompt_tokens": 11, "completion_tokens": 7, "cached_tokens": 3}),
    (Reply, {"body": b"{}", "usage": USAGE}),
    (UpstreamRequest, {"path": "/v1/chat/completions", "body": b"{}", "headers": {"x-request-id": "r"}}),
    (ClientRequest, {"endpoint": Endpoint.RESPONSES, "body": {"input": "hi"}, "stream": True,
                     "include_usage": True, "created": 9}),
    (ParsedRequest, {"model": "m", "request": CLIENT}),
    (Outcome, {"backend": "b", "runtime": "vllm", "model": "m", "status": "200", "duration_s": 1.5,
               "usage": USAGE, "ttft_s": 0.2, "gaps": GAPS, "reason": "rr", "arm": "a", "sla": "met",
               "finished_at": 10.0, "usage_estimated": True, "generation_s": 1.2, "expected_cached_tokens": 256,
               "prediction": "exact", "endpoint": "completions", "rank": 3, "request_id": "r-1", "trace_id": "ab" * 16,
               "sampled": True, "topology": "split", "prefill": "p0", "prefill_s": 0.3, "transfer_s": 0.01}),
    (Sample, {"at": 3.0, "error": True, "prompt_tokens": 1, "completion_tokens": 2, "cached_tokens": 3,
              "ttft_s": 0.1, "gaps": GAPS, "tpot_s": 0.01, "e2e_s": 0.5, "sla": "missed", "generation_s": 0.4}),
    (Verdict, {"eject_for_s": 5.0, "spared": True, "reason": "5 consecutive failures"}),
    (SlaTarget, {"ttft_s": 0.5, "tpot_s": 0.05, "strict": True}),
    (RequestFeatures, {"chain": (1, 2), "prompt_bytes": 128, "prompt_tokens": 32, "affinity_key": 7,
                       "prefix_key": "p", "session_key": "s", "sticky_key": "u", "sla": SLA,
                       "tokens": FEATURES.tokens}),
    (BackendView, {"name": "b", "runtime": Runtime.SGLANG, "healthy": True, "in_flight": 2, "waiting": 1.0,
                   "running": 3.0, "kv_usage": 0.5, "usd_per_hour": 9.0, "block_size": 16,
                   "output_tokens_per_s": 100.0, "backend": "w", "rank": 2}),
    (Snapshot, {"backends": (VIEW,), "prefix": NO_PREFIXES, "latency": {"b": LatencyModel()}}),
    (RouteRequest, {"model": "m", "seq": 3, "exclude": frozenset({"a"}), "features": FEATURES}),
    (Decision, {"backend": "b", "reason": "sla", "expected_hit_tokens": 16, "predicted_ttft_s": 0.2,
                "reject": True, "retry_after_s": 1.5}),
    (Sent, {"backend": "b", "chain": (1, 2), "stride": 1, "prompt_bytes": 128, "predicted_blocks": 1, "tick": 4}),
    (Ticket, {"sent": SENT, "uncached_tokens": 10.0, "ahead_tokens": 5.0, "running": 2.0, "prefilled": True,
              "expected_tokens": 16, "source": EXACT, "exact_tokens": 16, "prompt": FEATURES.tokens, "counter": 3,
              "server": "w", "rank": 1, "remote": "before"}),
    (Needs, {"endpoint": Endpoint.RESPONSES, "serves": (Feature.RESPONSES, Feature.CHAT),
             "features": frozenset({Feature.TOOLS}), "untranslatable": "previous_response_id"}),
]


@pytest.mark.parametrize(("cls", "kwargs"), VALUES, ids=[c.__name__ for c, _ in VALUES])
def test_each_field_is_set_from_its_argument_and_replace_round_trips(cls: type[Any], kwargs: dict[str, Any]) -> None:
    made = cls(**kwargs)
    assert {f.name: getattr(made, f.name) for f in dataclasses.fields(made)} == kwargs
    assert dataclasses.replace(made) == made == cls(**kwargs)
    assert repr(made).startswith(f"{cls.__name__}(")


def test_defaults_are_the_documented_ones() -> None:
    assert Usage(1, 2).cached_tokens is None
    assert UpstreamRequest("/p", b"").headers == {}
    assert ClientRequest(Endpoint.CHAT, {}, False, False).created is None
    assert Outcome("b", "r", "m", "200", 1.0) == Outcome("b", "r", "m", "200", 1.0, None, None, None, "none", None,
                                                         None, 0.0, False, None, None, None, "chat")
    assert Verdict() == Verdict(None, False, "")
    assert hash(Usage(1, 2)) == hash(Usage(1, 2, None))
    assert RequestFeatures() == RequestFeatures((), 0, 0, None, None, None, None, None, None)
    assert SlaTarget() == SlaTarget(None, None, False)
    assert RouteRequest("m", 1) == RouteRequest("m", 1, frozenset(), RequestFeatures())
    assert Decision("b", "r") == Decision("b", "r", 0, None, False, None)
    assert Snapshot(()).latency == {}
    assert Snapshot(()).prefix.held("b") == 0
    assert Needs(Endpoint.CHAT, (Feature.CHAT,)) == Needs(Endpoint.CHAT, (Feature.CHAT,), frozenset(), None)
    view = BackendView("b", Runtime.VLLM, True, 0, None, None, None, None)
    assert (view.block_size, view.output_tokens_per_s) == (None, None)
    ticket = Ticket(SENT, 1.0, 2.0, 3.0)
    assert (ticket.prefilled, ticket.expected_tokens, ticket.source, ticket.exact_tokens, ticket.prompt,
            ticket.counter) == (False, 0, "approximate", None, None, 0)


def test_the_per_request_records_start_empty() -> None:
    ex = Exchange("r", Endpoint.CHAT, 1.0)
    assert (ex.status, ex.model, ex.tried, ex.usage, ex.stream, ex.recorded) == ("500", "none", set(), None, None,
                                                                                 False)
    assert Exchange("r", Endpoint.CHAT, 1.0).tried is not ex.tried
    stats = StreamStats(GAPS)
    assert (stats.gaps, stats.first_token_at, stats.tokens, stats.usage, stats.done) == (GAPS, None, 0, None, False)
    msg = Message()
    assert (msg.method, msg.url, msg.headers, msg.body, msg.keep_alive, msg.http11) == (b"", b"", {}, [], True, True)
    assert Message().headers is not msg.headers


@pytest.mark.parametrize("cls", [*(c for c, _ in VALUES), Exchange, StreamStats, Message, Opened])
def test_compiled_modules_compile_the_init(cls: type[Any]) -> None:
    """A dataclass's generated `__init__` would be interpreted even in the compiled build: there the
    written one is a C function; in the pure build, the Python function written in the source."""
    compiled = (sys.modules[cls.__module__].__file__ or "").endswith(".so")
    assert inspect.isfunction(cls.__init__) is not compiled
    if not compiled:
        # written in the module, not generated by the dataclass (whose code comes from "<string>")
        assert cls.__init__.__code__.co_filename == sys.modules[cls.__module__].__file__
