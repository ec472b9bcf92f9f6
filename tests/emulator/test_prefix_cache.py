from backends.emulator.prefix_cache import BlockHashCache, NoCache, RadixCache


def test_block_cache_matches_full_blocks_only() -> None:
    cache = BlockHashCache(16)
    tokens = list(range(40))
    cache.insert(tokens)
    assert cache.match(tokens) == 32  # two full blocks; the partial third is never cached
    assert cache.match(tokens[:20]) == 16
    assert cache.match([999, *tokens[1:]]) == 0  # blocks are chained: a different first block misses all


def test_block_cache_evicts_least_recently_used_and_trims_chains_from_the_tail() -> None:
    cache = BlockHashCache(4)
    a, b = list(range(12)), list(range(100, 112))
    cache.insert(a)
    cache.insert(b)
    assert cache.match(a) == 12  # refresh a: b is now least recently used
    cache.evict_to(16)  # room for 4 blocks of 4 tokens
    assert cache.match(a) == 12
    assert cache.match(b) == 4  # b lost its tail blocks first, keeping its head
    assert cache.size_tokens == 16


def test_radix_cache_is_token_granular_and_splits_edges() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4, 5])
    cache.insert([1, 2, 3, 9, 9])
    assert cache.match([1, 2, 3, 4, 7]) == 4
    assert cache.match([1, 2, 3, 9]) == 4
    assert cache.match([2]) == 0
    assert cache.size_tokens == 7


def test_radix_cache_evicts_lru_leaves_first() -> None:
    cache = RadixCache()
    cache.insert([1, 2, 3, 4])
    cache.insert([1, 2, 7, 8])
    cache.match([1, 2, 3, 4])  # refresh the first branch
    cache.evict_to(4)
    assert cache.match([1, 2, 3, 4]) == 4
    assert cache.match([1, 2, 7, 8]) == 2
    cache.evict_to(0)
    assert cache.match([1, 2, 3, 4]) == 0
    assert cache.size_tokens == 0


def test_no_cache_never_hits() -> None:
    cache = NoCache()
    cache.insert([1, 2, 3])
    assert cache.match([1, 2, 3]) == 0
