"""Prefix caches with each runtime's granularity and eviction policy.

All caches answer one question for the engine, "how many leading tokens of this prompt are resident?",
and shrink to a token capacity the engine sets every step (cached KV lives in the free part of the KV
pool, so it is evicted as running requests need room). Recency is a logical counter, never a clock.

* `BlockHashCache`: vLLM and TensorRT-LLM. Only full blocks are cached, each keyed by a hash chained
  over all previous blocks, evicted least-recently-used (vLLM's free-block queue; TRT-LLM's LRU).
* `RadixCache`: SGLang's RadixAttention: token granularity (page size 1), LRU eviction of leaves.
* `NoCache`: Triton's TensorRT-LLM backend with `enable_kv_cache_reuse: false` (its default).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol


class PrefixCache(Protocol):
    granularity: int

    def match(self, tokens: Sequence[int]) -> int:
        """Number of leading tokens already resident (a multiple of `granularity`); refreshes them."""
        ...

    def insert(self, tokens: Sequence[int]) -> None: ...

    def evict_to(self, capacity_tokens: int) -> None: ...

    @property
    def size_tokens(self) -> int: ...


class NoCache:
    """Prefix reuse disabled: nothing is ever resident."""

    granularity = 1

    def match(self, tokens: Sequence[int]) -> int:
        return 0

    def insert(self, tokens: Sequence[int]) -> None:
        return None

    def evict_to(self, capacity_tokens: int) -> None:
        return None

    @property
    def size_tokens(self) -> int:
        return 0


class BlockHashCache:
    """Full blocks keyed by a chained hash; LRU eviction.

    A block's key covers every token before it, so a block only matches after the same prefix. On a
    match the blocks are refreshed tail first, which leaves parents more recent than their children:
    eviction then trims chains from the end, as vLLM's free queue does.
    """

    def __init__(self, block_size: int) -> None:
        self.granularity = block_size
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        keys, prev = [], 0
        bs = self.granularity
        for start in range(0, len(tokens) - bs + 1, bs):
            prev = hash((prev, tuple(tokens[start : start + bs])))
            keys.append(prev)
        return keys

    def match(self, tokens: Sequence[int]) -> int:
        hit: list[int] = []
        for key in self._keys(tokens):
            if key not in self._blocks:
                break
            hit.append(key)
        for key in reversed(hit):
            self._blocks.move_to_end(key)
        return len(hit) * self.granularity

    def insert(self, tokens: Sequence[int]) -> None:
        for key in reversed(self._keys(tokens)):
            self._blocks[key] = None
            self._blocks.move_to_end(key)

    def evict_to(self, capacity_tokens: int) -> None:
        limit = max(0, capacity_tokens // self.granularity)
        while len(self._blocks) > limit:
            self._blocks.popitem(last=False)

    @property
    def size_tokens(self) -> int:
        return len(self._blocks) * self.granularity


class _Node:
    __slots__ = ("children", "key", "last_use", "parent")

    def __init__(self, key: tuple[int, ...], parent: _Node | None, last_use: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[int, _Node] = {}
        self.last_use = last_use


class RadixCache:
    """A token-level radix tree (page size 1) with LRU leaf eviction, like SGLang's RadixCache."""

    granularity = 1

    def __init__(self) -> None:
        self._root = _Node((), None, 0)
        self._tick = 0
        self._size = 0

    def _walk(self, tokens: Sequence[int], *, split: bool) -> tuple[_Node, int]:
        """Follow `tokens` from the root; return the deepest node fully matched and the matched length.
        With `split`, a partially matched edge is split so the match ends on a node."""
        self._tick += 1
        node, i = self._root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = 0
            while k < len(child.key) and i + k < len(tokens) and child.key[k] == tokens[i + k]:
                k += 1
            if k < len(child.key):
                if not split:
                    child.last_use = self._tick
                    return node, i + k
                mid = _Node(child.key[:k], node, self._tick)
                node.children[tokens[i]] = mid
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                return mid, i + k
            child.last_use = self._tick
            node, i = child, i + k
        return node, i

    def match(self, tokens: Sequence[int]) -> int:
        return self._walk(tokens, split=False)[1]

    def insert(self, tokens: Sequence[int]) -> None:
        node, i = self._walk(tokens, split=True)
        if i < len(tokens):
            rest = tuple(tokens[i:])
            node.children[rest[0]] = _Node(rest, node, self._tick)
            self._size += len(rest)

    def evict_to(self, capacity_tokens: int) -> None:
        if self._size <= capacity_tokens:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.last_use)
        while self._size > capacity_tokens and leaves:
            leaf = leaves.pop(0)
            excess = self._size - capacity_tokens
            if excess < len(leaf.key):
                leaf.key = leaf.key[: len(leaf.key) - excess]
                self._size -= excess
                return
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            if parent is not self._root and not parent.children:
                # The parent became a leaf; keep LRU order by re-inserting it.
                idx = 0
                while idx < len(leaves) and leaves[idx].last_use <= parent.last_use:
                    idx += 1
                leaves.insert(idx, parent)

    def _leaves(self) -> list[_Node]:
        out, stack = [], [self._root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self._root:
                out.append(n)
            stack.extend(n.children.values())
        return out

    @property
    def size_tokens(self) -> int:
        return self._size
