"""When a backend's event-built index is trusted: in sequence from the start it is live; a gap,
a late join, a missed restart or a silent publisher make it rebuild (routing falls back) until
events flow and predictions are verified again; restarts and clears make it live and empty. A
restart whose first batches were missed starts a new sequence space that only a replay from 0 or
verified predictions make live; a replay that fills a gap must return the last batch applied."""

from __future__ import annotations

from backends.emulator.block_hashes import vllm_hashes
from gateway.kvcache.cache import BackendCache, Filled, State
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


def batch(seq: int, *events: KvEvent, rank: int = 0, ts: float = 0.0) -> Batch:
    return Batch(seq, ts, rank, events)


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
    assert cache.receive(batch(3, store(2)), now=1.0) == 0  # 1 and 2 are missing; 3 is held; 0 is the overlap
    replayed = [batch(0, store(0)), batch(1, remove(0, 5)), batch(2, store(1)), batch(3, store(2)), batch(4, store(3))]
    assert cache.fill(0, replayed, now=1.0) is Filled.CLOSED
    assert cache.live
    assert [cache.match(prompt(d)) for d in range(4)] == [80, 96, 96, 0]  # 4 arrives live, not from the replay
    assert cache.receive(batch(4, store(3)), now=2.0) is None
    assert cache.match(prompt(3)) == 96
    assert cache.stats.resets == {}


def test_an_unfilled_gap_rebuilds_until_events_flow_and_predictions_verify() -> None:
    cache = BackendCache("a", verify=2)
    cache.receive(batch(0, store(0), store(1)), now=0.0)
    assert cache.receive(batch(5, store(2)), now=1.0) == 0
    assert cache.fill(0, [batch(4, store(3))], now=1.0) is Filled.LOST  # the replay buffer no longer has 0-3
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
    assert cache.fill(0, [batch(0, store(0)), batch(1, remove(0, 2, 4)), batch(2, store(2))], now=0.0) is Filled.CLOSED
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


def restarted(cache: BackendCache) -> None:
    """Five batches of a first engine process, then the third batch of the next one."""
    for seq in range(5):
        cache.receive(batch(seq, store(0) if seq == 0 else remove(3, 0)), now=0.0)
    assert cache.live
    assert cache.receive(batch(2, store(2), ts=9.0), now=1.0) == 0  # seq went back, not to 0: replay from 0


def test_a_restart_whose_first_batches_were_missed_is_distrusted_at_once() -> None:
    cache = BackendCache("a")
    restarted(cache)
    # a new sequence space, empty and untrusted while the replay is asked for
    assert (cache.state, cache.reason) == (State.REBUILDING, "restart")
    assert cache.ranks[0].next_seq is None
    assert not cache.ranks[0].trusted
    assert cache.match(prompt(0)) == 0  # the old process's blocks are gone


def test_a_restart_whose_first_batches_are_replayed_is_live_and_complete() -> None:
    """The replayed batches are the new process's 0 and 1: all are applied (the old sequence
    number must not discard them), and the index is live, as from the engine's start."""
    cache = BackendCache("a")
    restarted(cache)
    replayed = [batch(0, store(1), ts=8.0), batch(1, store(3, 0, 2), ts=8.5), batch(2, store(2), ts=9.0)]
    assert cache.fill(0, replayed, now=1.5) is Filled.CLOSED
    assert (cache.state, cache.reason) == (State.LIVE, "replayed from the engine's start")
    assert [cache.match(prompt(d)) for d in range(4)] == [0, 96, 96, 32]
    assert cache.ranks[0].next_seq == 3
    assert cache.stats.resets == {"restart": 1}


def test_a_restart_whose_first_batches_are_lost_rebuilds_until_verified() -> None:
    cache = BackendCache("a", verify=2)
    restarted(cache)
    assert cache.fill(0, [batch(2, store(2), ts=9.0)], now=1.5) is Filled.LOST  # its buffer lost 0 and 1
    assert (cache.state, cache.reason) == (State.REBUILDING, "restart")
    assert cache.stats.resets == {"restart": 1}  # one restart, counted once
    assert [cache.match(prompt(d)) for d in range(3)] == [0, 0, 96]  # the held batch was applied
    # the engine reports what the missed batches stored: confirmed, then verified
    cache.observe(prompt(1), predicted=0, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=2.0)
    assert cache.state is State.REBUILDING
    for _ in range(2):
        cache.observe(prompt(1), predicted=96, cached_tokens=96, prompt_tokens=97, counter_at_dispatch=cache.counter,
                      now=3.0)
    assert (cache.state, cache.reason) == (State.LIVE, "rebuilt: predictions verified")


def test_a_restart_without_replay_rebuilds_empty() -> None:
    cache = BackendCache("a")
    restarted(cache)
    cache.unfilled(0, now=1.0)  # no replay endpoint
    assert cache.match(prompt(0)) == 0
    assert cache.match(prompt(2)) == 96
    assert (cache.state, cache.reason) == (State.REBUILDING, "restart")
    assert cache.stats.resets == {"restart": 1}


def test_a_gap_whose_replay_shows_another_process_is_a_restart() -> None:
    """The engine restarted and its new sequence passed the old number before the gateway heard
    it: by sequence numbers alone a gap. The replay's batch at the last number applied is not the
    one applied: the rank starts over from the new process's 0."""
    cache = BackendCache("a")
    cache.receive(batch(0, store(0), ts=1.0), now=0.0)
    cache.receive(batch(1, remove(0, 5), ts=2.0), now=0.0)
    assert cache.receive(batch(4, store(2), ts=9.3), now=1.0) == 1  # replay from the last applied
    newer = [batch(s, store(1) if s == 0 else remove(3, 0), ts=9.0 + s / 10) for s in range(4)]
    assert cache.fill(0, newer[1:], now=1.0) is Filled.RESTARTED
    assert (cache.state, cache.reason) == (State.REBUILDING, "restart")
    assert cache.fill(0, newer, now=1.1) is Filled.CLOSED  # the replay from 0
    assert cache.live
    assert [cache.match(prompt(d)) for d in range(3)] == [0, 96, 96]
    assert cache.stats.resets == {"restart": 1}


def test_a_gap_replay_without_the_overlap_rebuilds() -> None:
    cache = BackendCache("a")
    cache.receive(batch(0, store(0)), now=0.0)
    cache.receive(batch(1, store(1)), now=0.0)
    assert cache.receive(batch(3, store(2)), now=1.0) == 1
    assert cache.fill(0, [batch(2, store(3)), batch(3, store(2))], now=1.0) is Filled.LOST  # no batch 1: unproven
    assert (cache.state, cache.reason) == (State.REBUILDING, "gap")


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
    assert cache.receive(batch(3, remove(0, 0), rank=0), now=1.0) == 0  # a gap on rank 0 only (replay from 0)
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


def test_a_source_that_never_hears_anything_becomes_silent_once() -> None:
    """No batch ever, although responses showed the engine stored blocks: `silent` after the grace
    (`silent_after_s`). The block size is not known yet, so only a response with more uncached
    tokens than any runtime's default block is evidence."""
    cache = BackendCache("a", silent_after_s=5.0)
    few = TokenPrompt(list(range(100)))
    cache.observe(few, predicted=0, cached_tokens=0, prompt_tokens=100, counter_at_dispatch=0, now=0.0)
    assert not cache.tick(now=60.0)
    assert cache.state is State.WAITING
    long = TokenPrompt(list(range(400)))
    cache.observe(long, predicted=0, cached_tokens=0, prompt_tokens=400, counter_at_dispatch=0, now=60.0)
    assert not cache.tick(now=64.0)
    assert cache.tick(now=65.5)
    assert (cache.state, cache.reason, cache.silent) == (State.SILENT, "no KV event ever arrived", True)
    assert cache.describe(now=66.0)["silent"] is True
    cache.observe(long, predicted=0, cached_tokens=0, prompt_tokens=400, counter_at_dispatch=0, now=70.0)
    assert not cache.tick(now=80.0)  # reported once, not at every piece of evidence
    assert cache.stats.resets == {}  # nothing was known, nothing was reset
    # heard at last: what the batch says decides (here: the engine's first batch, so live)
    cache.hint = "why"
    cache.receive(batch(0, store(0)), now=81.0)
    assert (cache.state, cache.silent, cache.hint) == (State.LIVE, False, "")


def test_a_publisher_that_stops_is_reported_once_per_silence() -> None:
    cache = BackendCache("a", silent_after_s=1.0)
    cache.receive(batch(0, store(0)), now=0.0)
    for t in (10.0, 20.0):
        cache.observe(prompt(1), predicted=0, cached_tokens=0, prompt_tokens=97, counter_at_dispatch=cache.counter,
                      now=t)
        assert cache.tick(now=t + 2) is (t == 10.0)
    assert cache.stats.resets == {"silent": 1}
    assert cache.silent
    cache.receive(batch(1, store(1)), now=30.0)
    assert not cache.silent
    cache.observe(prompt(2), predicted=0, cached_tokens=0, prompt_tokens=97, counter_at_dispatch=cache.counter,
                  now=40.0)
    assert cache.tick(now=42.0)  # a new silence
    assert cache.stats.resets == {"silent": 2}
