"""The pair choice and the `auto` decider: pure, over snapshots."""

from __future__ import annotations

from backends.base import Runtime
from gateway.pd_settings import Disaggregation
from gateway.routing import BackendView, RoutingState
from gateway.routing.disaggregation import plan, prefill_again

from ..routing.helpers import RNG, doc, features, req, snap, view, warm

ROLES = {"p0": "prefill", "p1": "prefill", "d0": "decode", "d1": "decode", "b": "both"}
ALWAYS = Disaggregation(when="always")
AUTO = Disaggregation(when="auto", min_uncached_tokens=256)


def kv(name: str, usage: float, load: int = 0) -> BackendView:
    return BackendView(name, Runtime.VLLM, True, load, None, None, usage, None)


def test_always_pairs_a_prefill_with_the_least_loaded_decode() -> None:
    state = RoutingState()
    views = [view("p0"), view("p1"), view("d0", load=3), view("d1", running=1)]
    chosen = plan(req(features(doc(1))), snap(state, *views), ROLES, ALWAYS, RNG)
    assert chosen is not None
    assert chosen.prefill is not None
    assert chosen.decode.backend == "d1"
    assert chosen.prefill.backend in {"p0", "p1"}
    assert (chosen.decision, chosen.reason) == ("split", "always")


def test_the_prefill_follows_its_cached_prefix() -> None:
    state = RoutingState()
    views = [view("p0"), view("p1"), view("d0")]
    f = features(doc(2, 4096))
    warm(state, views[1], f)
    chosen = plan(req(features(doc(2, 4096), "next")), snap(state, *views), ROLES, ALWAYS, RNG)
    assert chosen is not None
    assert chosen.prefill is not None
    assert (chosen.prefill.backend, chosen.prefill.reason) == ("p1", "affinity")


def test_decode_load_counts_kv_usage_after_requests() -> None:
    views = [view("p0"), kv("d0", 0.8), kv("d1", 0.2)]
    chosen = plan(req(features(doc(3))), snap(RoutingState(), *views), ROLES, ALWAYS, RNG)
    assert chosen is not None
    assert chosen.decode.backend == "d1"


def test_a_both_backend_serves_either_leg_but_never_both_of_one_request() -> None:
    views = [view("b"), view("d0", load=5)]
    chosen = plan(req(features(doc(4))), snap(RoutingState(), *views), ROLES, ALWAYS, RNG)
    assert chosen is not None
    assert chosen.prefill is not None
    assert (chosen.prefill.backend, chosen.decode.backend) == ("b", "d0")  # b is less loaded, but the only prefill
    alone = plan(req(features(doc(4))), snap(RoutingState(), view("b")), ROLES, ALWAYS, RNG)
    assert alone is not None
    assert (alone.split, alone.reason, alone.decode.backend) == (False, "no_prefill", "b")


def test_auto_splits_a_long_uncached_prompt_and_keeps_a_short_one_whole() -> None:
    views = [view("p0"), view("d0")]
    long = plan(req(features(doc(5, 4096))), snap(RoutingState(), *views), ROLES, AUTO, RNG)
    short = plan(req(features("tiny")), snap(RoutingState(), *views), ROLES, AUTO, RNG)
    assert long is not None
    assert (long.split, long.reason) == (True, "uncached")
    assert long.uncached_tokens >= 256
    assert short is not None
    assert (short.split, short.reason) == (False, "cached")


def test_auto_keeps_whole_a_long_prompt_the_decode_already_holds() -> None:
    state = RoutingState()
    views = [view("p0"), view("d0")]
    warm(state, views[1], features(doc(6, 4096)))
    chosen = plan(req(features(doc(6, 4096), "more")), snap(state, *views), ROLES, AUTO, RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason) == (False, "cached")
    assert chosen.decode.expected_hit_tokens > 0


def test_auto_keeps_whole_when_the_decode_pool_is_saturated() -> None:
    views = [view("p0"), kv("d0", 0.95), kv("d1", 0.97)]
    chosen = plan(req(features(doc(7, 4096))), snap(RoutingState(), *views), ROLES, AUTO, RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason) == (False, "decode_saturated")
    one_free = plan(req(features(doc(7, 4096))), snap(RoutingState(), view("p0"), kv("d0", 0.95), kv("d1", 0.5)),
                    ROLES, AUTO, RNG)
    assert one_free is not None
    assert one_free.split


def test_never_and_no_healthy_decode() -> None:
    views = [view("p0"), view("d0")]
    chosen = plan(req(features(doc(8, 4096))), snap(RoutingState(), *views), ROLES, Disaggregation(when="never"), RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason, chosen.decode.backend) == (False, "never", "d0")
    dead = [view("p0"), view("d0", healthy=False)]
    assert plan(req(features(doc(8))), snap(RoutingState(), *dead), ROLES, ALWAYS, RNG) is None


def test_a_failed_prefill_is_retried_on_another_never_on_the_decode() -> None:
    views = [view("p0"), view("p1"), view("b"), view("d0")]
    again = prefill_again(req(features(doc(9)), exclude=frozenset({"p0"})), snap(RoutingState(), *views), ROLES,
                          "b", RNG)
    assert again is not None
    assert again.backend == "p1"
    none_left = prefill_again(req(features(doc(9)), exclude=frozenset({"p0", "p1"})),
                              snap(RoutingState(), *views), ROLES, "b", RNG)
    assert none_left is None


def test_ranks_of_one_server_are_decode_units_of_its_role() -> None:
    units = [BackendView(f"d0@{r}", Runtime.VLLM, True, load, None, None, None, None, backend="d0", rank=r)
             for r, load in enumerate((2, 0, 1))]
    chosen = plan(req(features(doc(10))), snap(RoutingState(), view("p0"), *units), ROLES, ALWAYS, RNG)
    assert chosen is not None
    assert chosen.decode.backend == "d0@1"
    assert chosen.prefill is not None
    assert chosen.prefill.backend == "p0"


BOTH = {"b0": "both", "b1": "both"}


def taught(state: RoutingState, *names: str, tokens_per_s: float = 10_000.0, handoff_s: float | None = None) -> None:
    """Latency models as learned: a prefill rate (ten long TTFTs, no fixed part) and a handoff."""
    for name in names:
        for _ in range(10):
            state.observe(name, work_tokens=4096, ttft_s=4096 / tokens_per_s)
        if handoff_s is not None:
            state.observe(name, handoff_s=handoff_s)


def test_auto_keeps_a_long_prompt_whole_when_the_split_is_predicted_slower() -> None:
    """Two equally idle `both` servers: the prefill costs the same on either, the handoff only adds."""
    state = RoutingState()
    taught(state, "b0", "b1", handoff_s=0.2)
    chosen = plan(req(features(doc(20, 8192))), snap(state, view("b0"), view("b1")), BOTH, AUTO, RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason) == (False, "slower")
    assert chosen.uncached_tokens >= 256  # the token rule alone would have split it


def test_auto_splits_a_long_prompt_when_the_decode_is_busy_and_a_prefill_idle() -> None:
    """The decode's queue of prefill work makes the whole request wait; the idle prefill does not."""
    state = RoutingState()
    taught(state, "p0", "d0", handoff_s=0.05)
    busy = view("d0")
    for n in range(6):  # six long prompts sent to d0, no first token yet: 6 x ~2k tokens queued
        state.dispatched(busy, features(doc(30 + n, 8192)))
    chosen = plan(req(features(doc(21, 8192))), snap(state, view("p0"), busy), ROLES, AUTO, RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason) == (True, "uncached")


def test_auto_splits_to_spare_a_decodes_running_streams_the_prefill_stall() -> None:
    """Whole on the decode reaches its own first token sooner (no handoff), but the decode runs 16
    streams that would each wait the 0.8 s prefill: the split onto a `prefill` server stalls none."""
    state = RoutingState()
    taught(state, "p0", "d0", handoff_s=0.2)
    prompt = features(doc(24, 8192))
    idle = plan(req(prompt), snap(state, view("p0"), view("d0")), ROLES, AUTO, RNG)
    assert idle is not None
    assert (idle.split, idle.reason) == (False, "slower")  # nobody to stall: the handoff only adds
    busy = plan(req(prompt), snap(state, view("p0"), view("d0", running=16)), ROLES, AUTO, RNG)
    assert busy is not None
    assert (busy.split, busy.reason) == (True, "uncached")


def test_auto_counts_the_stall_a_both_prefill_puts_on_its_own_streams() -> None:
    """Between `both` servers the stall moves with the prefill: splitting from a decode running 4
    streams onto one running 12 costs more, so the prompt stays whole."""
    state = RoutingState()
    taught(state, "b0", "b1", handoff_s=0.01)
    chosen = plan(req(features(doc(25, 8192))), snap(state, view("b0", running=4), view("b1", running=12)), BOTH,
                  AUTO, RNG)
    assert chosen is not None
    assert chosen.decode.backend == "b0"
    assert (chosen.split, chosen.reason) == (False, "slower")


def test_auto_uses_the_token_rule_while_the_latency_models_know_nothing() -> None:
    chosen = plan(req(features(doc(22, 8192))), snap(RoutingState(), view("b0"), view("b1")), BOTH, AUTO, RNG)
    assert chosen is not None
    assert (chosen.split, chosen.reason) == (True, "uncached")


def test_a_decode_leg_prefilled_elsewhere_teaches_the_handoff_never_the_prefill_rate() -> None:
    state = RoutingState()
    d0 = view("d0")
    long = features(doc(23, 8192))
    ticket = state.dispatched(d0, long, remote="before")
    assert ticket.uncached_tokens == 0  # its prefill is not queued on the decode
    assert state.estimator("d0").backlog_tokens == 0
    state.first_token(ticket, 0.3)
    model = state.latency["d0"]
    assert model.handoff_s == 0.3
    assert model.prefill_tokens_per_s is None
    assert model.base_ttft_s == 0.0
    beside = state.dispatched(d0, long, remote="beside")  # SGLang: the prefill's time is in its TTFT
    state.first_token(beside, 2.0)
    assert state.latency["d0"].handoff_s == 0.3
    whole = state.dispatched(d0, features(doc(24, 8192)))  # (the decode holds `long` now: another prompt)
    assert whole.uncached_tokens > 256
    state.first_token(whole, 0.5)
    assert state.latency["d0"].prefill_tokens_per_s is not None
