"""When a backend's event-built index is trusted: in sequence from the start it is live; a gap,
a late join, a missed restart or a silent publisher make it rebuild (routing falls back) until
events flow and predictions are verified again; restarts and clears make it live and empty."""

from __future__ import annotations

from backends.emulator.block_hashes import vllm_hashes
from gateway.kvcache.cache import BackendCache, State
from gateway.kvcache.events import Batch, Cleared, Created, KvEvent, Removed, Stored
from gateway.routing.tokens import TokenPrompt

BS = 16
DOCS = [list(range(1000 * d, 1000 * d + 16 * 6 + 1)) for d in range(1, 5)]  # 6 blocks + the last token each
HASHES = [vllm_hashes(d, BS) for d in DOCS]


def store(doc: int, first: int = 0, count: int = 6) -> Stored:
    parent = HASHES[doc][first - 1] if first else None
    toks = DOCS[doc][first * BS : (first + count) * BS]
    return Stored(tuple(HASHES[doc][first : first + count]), parent, tuple(toks), BS)


def remove(doc: int, first: int, count: int = 1) -> Removed:
    return Removed(tuple(HASHES[doc][first : first + count]))


def batch(seq: int, *events: KvEvent, rank: int = 0) -> Batch:
    return Batch(seq, 0.0, rank, events)


def prompt(doc: int) -> TokenPrompt:
    return TokenPrompt(DOCS[doc])


def test_in_sequence_from_zero_is_live_and_exact() -> None:
    cache = BackendCache("a")
    assert cache.state is State.WAITING
    assert cache.receive(batch(0, store(0)), now=1.0) is None
    assert cache.live
    assert cache.match(prompt(0)) == 96
    assert cache.receive(batch(1, remove(0, 3, 3)), now=2.0) is None
    assert cache.match(prompt(0)) == 48
    assert cache.describe(now=3.0)["last_event_age_s"] == 1.0


def test_a_gap_filled_by_replay_stays_live() -> None:
    cache = BackendCache("a")
    cache.receive(batch(0, store(0)), now=0.0)
    assert cache.receive(batch(3, store(2)), now=1.0) == 1  # 1 and 2 are missing; 3 is held
    assert cache.fill(0, [batch(1, remove(0, 5)), batch(2, store(1)), batch(3, store(2)), batch(4, store(3))], now=1.0)
    assert cache.live
    assert [cache.match(prompt(d)) for d in range(4)] == [80, 96, 96, 0]  # 4 arrives live, not from the replay
    assert cache.receive(batch(4, store(3)), now=2.0) is None
    assert cache.match(prompt(3)) == 96
    assert cache.stats.resets == {}


def test_an_unfilled_gap_rebuilds_until_events_flow_and_predictions_verify() -> None:
    cache = BackendCache("a", verify=2)
    cache.receive(batch(0, store(0), store(1)), now=0.0)
    assert cache.receive(batch(5, store(2)), now=1.0) == 1
    assert not cache.fill(0, [batch(4, store(3))], now=1.0)  # the replay buffer no longer has 1-3
    assert cache.state is State.REBUILDING
    assert cache.reason == "gap"
    assert cache.stats.resets == {"gap": 1}
    # what it knew stays, as suspects; the held batch was applied
    assert cache.match(prompt(2)) == 96
    assert sum(len(r.index.ghosts) for r in cache.ranks.values()) == 12
    # the engine had evicted doc 0's tail meanwhile: a report removes suspects past what it served
    cache.observe(prompt(0), predicted=96, cached_tokens=32, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=2.0)
    assert cache.match(prompt(0)) == 32
    # ... and confirms blocks the engine still holds that events never named
    cache.observe(prompt(3), predicted=0, cached_tokens=64, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=2.0)
    assert cache.match(prompt(3)) == 64
    assert cache.state is State.REBUILDING
    for _ in range(2):
        cache.observe(prompt(1), predicted=96, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                      now=3.0)
    assert cache.live
    assert cache.reason == "rebuilt: predictions verified"


def test_verification_needs_events_to_flow_again() -> None:
    cache = BackendCache("a", verify=1)
    cache.receive(batch(0, store(0)), now=0.0)
    cache.lose(0, "silent", now=1.0)
    cache.observe(prompt(0), predicted=96, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=2.0)
    assert cache.state is State.REBUILDING  # no batch since the loss: a dead publisher must not look live
    cache.receive(batch(1, store(1)), now=3.0)
    cache.observe(prompt(0), predicted=96, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=4.0)
    assert cache.live


def test_joining_late_without_replay_rebuilds() -> None:
    cache = BackendCache("a")
    assert cache.receive(batch(7, store(0)), now=0.0) == 0
    cache.lose(0, "joined late", now=0.0)
    assert cache.state is State.REBUILDING
    assert cache.match(prompt(0)) == 96  # the held batch was applied


def test_joining_late_with_the_whole_buffer_replayed_is_live() -> None:
    cache = BackendCache("a")
    assert cache.receive(batch(2, store(2)), now=0.0) == 0
    assert cache.fill(0, [batch(0, store(0)), batch(1, remove(0, 2, 4)), batch(2, store(2))], now=0.0)
    assert cache.live
    assert [cache.match(prompt(d)) for d in (0, 2)] == [32, 96]


def test_a_restart_at_sequence_zero_empties_and_stays_live() -> None:
    cache = BackendCache("a")
    cache.receive(batch(0, store(0)), now=0.0)
    cache.receive(batch(1, store(1)), now=0.0)
    assert cache.receive(batch(0, store(2)), now=1.0) is None
    assert cache.live
    assert [cache.match(prompt(d)) for d in range(3)] == [0, 0, 96]
    assert cache.stats.resets == {"restart": 1}


def test_a_restart_whose_first_batches_were_missed_rebuilds_empty() -> None:
    cache = BackendCache("a")
    for seq in range(5):
        cache.receive(batch(seq, store(0) if seq == 0 else remove(3, 0)), now=0.0)
    assert cache.receive(batch(2, store(1)), now=1.0) == 0  # seq went back, not to 0
    cache.lose(0, "joined late", now=1.0)
    assert cache.match(prompt(0)) == 0  # the old process's blocks are gone
    assert cache.match(prompt(1)) == 96
    assert cache.state is State.REBUILDING


def test_all_blocks_cleared() -> None:
    cache = BackendCache("a")
    cache.receive(batch(0, store(0)), now=0.0)
    cache.lose(0, "gap", now=0.5)
    cache.receive(batch(3, Cleared(), store(1)), now=1.0)  # a gap, but the cache was emptied
    cache.lose(0, "gap", now=1.0)
    cache.receive(batch(4, Cleared()), now=2.0)
    assert cache.live
    assert cache.match(prompt(1)) == 0


def test_a_silent_publisher_is_noticed() -> None:
    cache = BackendCache("a", silent_after_s=5.0)
    cache.receive(batch(0, store(0)), now=0.0)
    counter = cache.counter
    # a response that made the engine store blocks, and no batch since its dispatch
    cache.observe(prompt(1), predicted=0, cached_tokens=0, prompt_tokens=97, counter_at_dispatch=counter, now=10.0)
    cache.tick(now=14.0)
    assert cache.live
    cache.tick(now=15.5)
    assert cache.state is State.REBUILDING
    assert cache.reason == "silent"
    # a batch arriving in time clears the suspicion
    other = BackendCache("b", silent_after_s=5.0)
    other.receive(batch(0, store(0)), now=0.0)
    other.observe(prompt(1), predicted=0, cached_tokens=0, prompt_tokens=97, counter_at_dispatch=other.counter,
                  now=10.0)
    other.receive(batch(1, store(1)), now=10.1)
    other.tick(now=20.0)
    assert other.live


def test_fully_cached_responses_are_no_evidence_of_silence() -> None:
    cache = BackendCache("a", silent_after_s=1.0)
    cache.receive(batch(0, store(0)), now=0.0)
    cache.observe(prompt(0), predicted=96, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=1.0)
    cache.tick(now=10.0)
    assert cache.live
    assert (cache.stats.checked, cache.stats.exact) == (1, 1)


def test_data_parallel_ranks_are_tracked_apart() -> None:
    cache = BackendCache("a")
    cache.receive(batch(0, store(0), rank=0), now=0.0)
    cache.receive(batch(0, store(1), rank=1), now=0.0)
    cache.receive(batch(1, store(2, 0, 2), rank=1), now=0.0)
    assert cache.live
    assert [cache.match(prompt(d)) for d in range(3)] == [96, 96, 32]  # the best rank's hit
    assert cache.receive(batch(3, remove(0, 0), rank=0), now=1.0) == 1  # a gap on rank 0 only
    cache.lose(0, "gap", now=1.0)
    assert cache.state is State.REBUILDING
    ranks = cache.describe(now=1.0)["ranks"]
    assert isinstance(ranks, dict)
    assert (ranks["0"]["trusted"], ranks["1"]["trusted"]) == (False, True)
    assert ranks["1"]["next_seq"] == 2


def test_trtllm_event_ids() -> None:
    cache = BackendCache("t")
    cache.receive_trtllm([(0, Created()), (1, store(0))], now=0.0)
    assert cache.live
    assert cache.match(prompt(0)) == 96
    cache.receive_trtllm([(2, remove(0, 4, 2))], now=1.0)
    assert cache.match(prompt(0)) == 64
    cache.receive_trtllm([(9, store(1))], now=2.0)  # the queue dropped events 3-8
    assert cache.state is State.REBUILDING
    assert cache.match(prompt(1)) == 96
    cache.receive_trtllm([(0, Created()), (1, store(2))], now=3.0)  # a restarted trtllm-serve
    assert cache.live
    assert [cache.match(prompt(d)) for d in (0, 1, 2)] == [0, 0, 96]
    late = BackendCache("late")
    late.receive_trtllm([(40, store(0))], now=0.0)
    assert late.state is State.REBUILDING
    assert late.reason == "joined late"
