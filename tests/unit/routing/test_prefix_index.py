from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.routing import PrefixIndex, RequestFeatures, stride_for

from .helpers import view


def feats(chain: tuple[int, ...]) -> RequestFeatures:
    return RequestFeatures(chain=chain, prompt_bytes=64 * len(chain), prompt_tokens=16 * len(chain))


def tree_chain(path: tuple[int, ...]) -> tuple[int, ...]:
    """A chain whose i-th hash identifies the path's first i+1 steps (shared prefixes share hashes)."""
    return tuple(hash(path[: i + 1]) & 0xFFFFFFFF for i in range(len(path)))


def test_match_counts_leading_blocks_at_the_engine_granularity() -> None:
    index = PrefixIndex()
    chain = tuple(range(1, 33))
    index.record("a", feats(chain[:20]), block_size=16)
    assert index.match("a", chain, 1) == 20
    assert index.match("b", chain, 1) == 0
    assert index.match("a", (999, *chain[1:]), 1) == 0
    index.record("c", feats(chain), block_size=64)  # stride 4: only every 4th hash is a block
    assert index.match("c", chain, 4) == 8
    assert index.match("c", chain[:10], 4) == 2


def test_record_returns_what_was_predicted_before_the_send() -> None:
    index = PrefixIndex()
    assert index.record("a", feats((1, 2, 3)), block_size=None).predicted_blocks == 0
    sent = index.record("a", feats((1, 2, 3, 4)), block_size=None)
    assert sent.predicted_blocks == 3
    assert sent.predicted_tokens == 48


def test_lru_evicts_tails_first_and_keeps_the_bound() -> None:
    index = PrefixIndex(capacity=10)
    index.record("a", feats((1, 2, 3, 4, 5, 6)), block_size=None)
    index.record("a", feats((7, 8, 9, 10, 11, 12)), block_size=None)
    assert index.size("a") == 10
    assert index.match("a", (1, 2, 3, 4, 5, 6), 1) == 4  # the oldest chain lost its tail, not its head
    assert index.match("a", (7, 8, 9, 10, 11, 12), 1) == 6


def test_engine_report_below_prediction_forgets_the_evicted_blocks() -> None:
    index = PrefixIndex()
    chain = tuple(range(1, 11))
    index.record("a", feats(chain), block_size=None)
    sent = index.record("a", feats(chain), block_size=None)
    assert sent.predicted_blocks == 10
    assert index.observe(sent, cached_tokens=160, prompt_tokens=160) == 0  # as predicted
    assert index.observe(sent, cached_tokens=144, prompt_tokens=160) == 0  # one block short: noise
    assert index.observe(sent, cached_tokens=48, prompt_tokens=160) == 7  # the engine kept 3 blocks
    assert index.match("a", chain, 1) == 3


def test_correction_uses_the_engines_own_token_units() -> None:
    index = PrefixIndex()
    chain = tuple(range(1, 11))
    index.record("a", feats(chain), block_size=None)
    sent = index.record("a", feats(chain), block_size=None)
    # A tokenizer at 5 chars/token reports 128 prompt tokens, all cached: nothing was evicted.
    assert index.observe(sent, cached_tokens=128, prompt_tokens=128) == 0
    assert index.observe(sent, cached_tokens=None, prompt_tokens=128) == 0


def test_correction_spares_blocks_a_later_send_reconfirmed() -> None:
    index = PrefixIndex()
    chain = tuple(range(1, 11))
    index.record("a", feats(chain), block_size=None)
    early = index.record("a", feats(chain), block_size=None)
    index.record("a", feats(chain[:6]), block_size=None)  # a later send re-confirms the first 6
    assert index.observe(early, cached_tokens=0, prompt_tokens=160) == 4
    assert index.match("a", chain, 1) == 6


def test_abandon_undoes_a_send_that_never_reached_the_engine() -> None:
    index = PrefixIndex()
    index.record("a", feats((1, 2)), block_size=None)
    sent = index.record("a", feats((1, 2, 3, 4)), block_size=None)
    index.abandon(sent)
    assert index.match("a", (1, 2, 3, 4), 1) == 2


def test_forget_and_retain_drop_whole_backends() -> None:
    index = PrefixIndex()
    for name in "abc":
        index.record(name, feats((1, 2)), block_size=None)
    index.forget("a")
    index.retain({"b"})
    assert [index.size(n) for n in "abc"] == [0, 2, 0]


def linear_match(index: PrefixIndex, chain: tuple[int, ...], stride: int) -> int:
    """The reference: walk from the first block to the first miss."""
    n = 0
    while n < len(chain) // stride and index.holds("a", chain[(n + 1) * stride - 1]):
        n += 1
    return n


def test_a_correction_cannot_leave_orphans_visible() -> None:
    index = PrefixIndex()
    index.record("a", feats((1, 2, 3, 4)), block_size=None)
    sent = index.record("a", feats((1, 2, 3)), block_size=None)
    index.observe(sent, cached_tokens=16, prompt_tokens=48)  # the engine kept block 0 only
    assert index.holds("a", 4)  # block 3 of the longer chain is orphaned...
    assert index.match("a", (1, 2, 3, 4), 1) == 1  # ...and not counted


paths = st.lists(st.integers(0, 2), min_size=1, max_size=12).map(tuple)
strides = st.sampled_from([1, 2, 4])
ops = st.lists(st.tuples(st.sampled_from(["record", "observe", "abandon"]), paths, st.integers(0, 200)), max_size=60)


@settings(max_examples=200, deadline=None)
@given(ops, st.integers(3, 30), st.sampled_from([1, 2, 4]))
def test_bounded_and_corrected_under_any_history(history: list[tuple[str, tuple[int, ...], int]],
                                                 capacity: int, stride: int) -> None:
    """Under any interleaving of sends, engine reports and abandoned sends: the LRU never exceeds
    its capacity, a send is fully remembered (up to capacity), an engine report below the
    prediction caps the match at what the engine really had, an abandoned send is undone, and the
    logarithmic match always equals a walk to the first miss."""
    index = PrefixIndex(capacity=capacity)
    for op, path, cached in history:
        chain = tree_chain(tuple(x for x in path for _ in range(stride)))
        blocks = len(chain) // stride
        sent = index.record("a", feats(chain), block_size=16 * stride)
        assert index.match("a", chain, stride) == min(blocks, capacity)
        if op == "observe":
            prompt_tokens = 16 * len(chain)
            index.observe(sent, cached_tokens=cached, prompt_tokens=prompt_tokens)
            kept = min(cached, prompt_tokens) // (16 * stride)
            if kept + 1 < sent.predicted_blocks:
                assert index.match("a", chain, stride) <= kept
        elif op == "abandon":
            index.abandon(sent)
            assert index.match("a", chain, stride) <= sent.predicted_blocks
        assert index.size("a") <= capacity
    for _, path, _ in history:
        chain = tree_chain(tuple(x for x in path for _ in range(stride)))
        assert index.match("a", chain, stride) == linear_match(index, chain, stride)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["record", "observe"]), paths, st.integers(0, 200), strides), max_size=40),
       st.integers(3, 30), strides)
def test_exact_when_the_block_size_changes(history: list[tuple[str, tuple[int, ...], int, int]],
                                           capacity: int, query_stride: int) -> None:
    index = PrefixIndex(capacity=capacity)
    for op, path, cached, stride in history:
        chain = tree_chain(tuple(x for x in path for _ in range(4)))
        sent = index.record("a", feats(chain), block_size=16 * stride)
        if op == "observe":
            index.observe(sent, cached_tokens=cached, prompt_tokens=16 * len(chain))
    for _, path, _, _ in history:
        chain = tree_chain(tuple(x for x in path for _ in range(4)))
        assert index.match("a", chain, query_stride) == linear_match(index, chain, query_stride)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), paths, st.sampled_from(["record", "observe"]), st.integers(0, 200)),
                max_size=60), st.lists(paths, min_size=1, max_size=5), st.integers(3, 40))
def test_hits_over_many_backends_equal_a_walk_per_backend(history: list[tuple[int, tuple[int, ...], str, int]],
                                                         queries: list[tuple[int, ...]], capacity: int) -> None:
    """`hits` (what every decision calls) reuses one backend's run as a hint for the next, across
    engine granularities: whatever the histories, each answer is the walk to that backend's first miss."""
    block_sizes = [None, 16, 32, 64, 128, 16]
    views = [view(f"b{i}", block_size=bs) for i, bs in enumerate(block_sizes)]
    index = PrefixIndex(capacity=capacity)
    for who, path, op, cached in history:
        chain = tree_chain(tuple(x for x in path for _ in range(4)))
        sent = index.record(f"b{who}", feats(chain), block_size=block_sizes[who])
        if op == "observe":
            index.observe(sent, cached_tokens=cached, prompt_tokens=16 * len(chain))
    for path in queries:
        chain = tree_chain(tuple(x for x in path for _ in range(4)))
        expected = []
        for v in views:
            stride = stride_for(v.block_size)
            n = 0
            while n < len(chain) // stride and index.holds(v.name, chain[(n + 1) * stride - 1]):
                n += 1
            expected.append(n * stride * 16)
        assert index.hits(chain, views) == expected
        assert index.hits(chain, views[::-1]) == expected[::-1]
