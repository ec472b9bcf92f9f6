"""Routing with the engines' own caches: exact hits where a backend's KV events are live, the
approximate index (in the request's engine tokens) elsewhere, and what each dispatch expected."""

from __future__ import annotations

from backends.base import Endpoint
from backends.emulator import tokenizer as emu
from backends.emulator.block_hashes import vllm_hashes
from gateway.kvcache import KvCaches
from gateway.kvcache.events import Batch, Stored
from gateway.routing import POLICIES, RequestFeatures, RouteRequest, RoutingState, describe
from gateway.routing.state import APPROXIMATE, EXACT
from gateway.routing.tokens import TokenPrompt

from .helpers import RNG, chat, doc, snap, view, warm

BS = 16


def tokens_of(body: dict[str, object]) -> TokenPrompt:
    messages = body["messages"]
    assert isinstance(messages, list)
    return TokenPrompt(emu.encode(emu.render_chat(messages)))


def engine_holds(caches: KvCaches, backend: str, prompt: TokenPrompt, blocks: int, seq: int = 0) -> None:
    """`backend`'s engine published that it stored the first `blocks` blocks of `prompt`."""
    ids = prompt.ids()
    hashes = vllm_hashes(ids, BS)[:blocks]
    cache = caches.add(backend)
    assert cache.receive(Batch(seq, 0.0, 0, (Stored(tuple(hashes), None, tuple(ids[: blocks * BS]), BS),)), 0.0) is None


def routed(body: dict[str, object], now_s: float = 0.0) -> tuple[KvCaches, RoutingState, TokenPrompt, RequestFeatures]:
    """Fresh engine caches (their clock stopped at `now_s`), a routing state over them, and `body`'s
    engine tokens and features."""
    caches = KvCaches(clock=lambda: now_s)
    prompt = tokens_of(body)
    return caches, RoutingState(engines=caches), prompt, describe(body, Endpoint.CHAT, {}, tokens=prompt)


def test_live_backends_answer_exactly_and_the_rest_approximately() -> None:
    caches, state, prompt, feats = routed(chat(doc(1, 3000), "question"))
    assert feats.prompt_tokens == prompt.count
    a, b, c = view("a", block_size=BS), view("b", block_size=BS), view("c", block_size=BS)
    warm(state, b, feats)  # the approximate index believes b holds all of it
    engine_holds(caches, "a", prompt, 10)
    hits = snap(state, a, b, c).prefix.hits(feats, (a, b, c))
    assert hits[0] == 160  # a: exact, from its events
    assert 0 < hits[1] <= prompt.cacheable  # b: approximate, scaled to engine tokens
    assert hits[2] == 0
    # an index that has events but is not live (a gap) does not answer
    cache = caches.get("a")
    assert cache is not None
    cache.lose(0, "gap", 1.0)
    assert snap(state, a, b, c).prefix.hits(feats, (a, b, c))[0] == 0


def test_prefix_affinity_follows_the_engines_truth_over_the_approximate_index() -> None:
    """The approximate index remembers sending the prompt to b; b's engine evicted it and a's
    engine holds it (its events say so): the request goes to a, and the ticket says why."""
    caches, state, prompt, feats = routed(chat(doc(2, 3000), "question"))
    a, b = view("a", block_size=BS), view("b", block_size=BS)
    warm(state, b, feats)
    engine_holds(caches, "a", prompt, prompt.cacheable // BS)
    engine_holds(caches, "b", TokenPrompt([1, 2, 3]), 0)  # b publishes too: it holds nothing
    decision = POLICIES["prefix_affinity"].choose(RouteRequest("m", 0, features=feats), snap(state, a, b), RNG)
    assert decision is not None
    assert (decision.backend, decision.reason) == ("a", "affinity")
    ticket = state.dispatched(a, feats)
    assert (ticket.expected_tokens, ticket.source) == ((prompt.cacheable // BS) * BS, EXACT)
    assert ticket.uncached_tokens == prompt.count - ticket.expected_tokens
    other = state.dispatched(view("c", block_size=BS), feats)
    assert other.source == APPROXIMATE
    assert other.exact_tokens is None


def test_reports_reach_the_engine_cache() -> None:
    caches, state, prompt, feats = routed(chat(doc(3, 2000), "q"), now_s=5.0)
    a = view("a", block_size=BS)
    engine_holds(caches, "a", prompt, 4)
    ticket = state.dispatched(a, feats)
    state.completed(ticket, cached_tokens=64, prompt_tokens=prompt.count, itl_s=None)
    cache = caches.get("a")
    assert cache is not None
    assert (cache.stats.checked, cache.stats.exact) == (1, 1)


def test_without_tokens_nothing_changes() -> None:
    caches = KvCaches(clock=lambda: 0.0)
    state = RoutingState(engines=caches)
    feats = describe(chat(doc(4, 2000)), Endpoint.CHAT, {})
    a = view("a", block_size=BS)
    warm(state, a, feats)
    engine_holds(caches, "a", TokenPrompt(list(range(100))), 2)
    [hit] = snap(state, a).prefix.hits(feats, (a,))
    assert hit == state.index.hits(feats.chain, (a,))[0] > 0
    ticket = state.dispatched(a, feats)
    assert ticket.source == APPROXIMATE
