"""Prefix caches with each runtime's granularity and eviction policy.

All caches answer one question for the engine, "how many leading tokens of this prompt are resident?",
and shrink to a token capacity the engine sets every step (cached KV lives in the free part of the KV
pool, so it is evicted as running requests need room). Recency is a logical counter, never a clock.

* `BlockHashCache`: vLLM and TensorRT-LLM. Only full blocks are cached, each keyed by a hash chained
  over all previous blocks, evicted least-recently-used (vLLM's free-block queue; TRT-LLM's LRU).
* `RadixCache`: SGLang's RadixAttention: a radix tree over pages (`page_size` tokens, 1 by default:
  token granularity), whole least-recently-used leaves evicted, as SGLang's `evict` does.
* `NoCache`: Triton's TensorRT-LLM backend with `enable_kv_cache_reuse: false` (its default).

With a `KvEventSink` a cache reports exactly what it stores and evicts (`kv_events`): the block
hashes are the runtime's own (`block_hashes`), and a chain is always resident from its first
block (parents are refreshed after their children, so eviction trims chains from the tail), so a
stored run of blocks always has its parent resident.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Protocol

from backends.emulator.block_hashes import Hasher, python_hashes, sglang_page_hashes
from backends.emulator.kv_events import Cleared, KvEventSink, Removed, Stored


class PrefixCache(Protocol):
    granularity: int

    def match(self, tokens: Sequence[int]) -> int:
        """Number of leading tokens already resident (a multiple of `granularity`); refreshes them."""
        ...

    def insert(self, tokens: Sequence[int]) -> None: ...

    def evict_to(self, capacity_tokens: int) -> None: ...

    def clear(self) -> None:
        """Drop everything (vLLM `/reset_prefix_cache`, SGLang `/flush_cache`)."""
        ...

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

    def clear(self) -> None:
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

    def __init__(self, block_size: int, *, hasher: Hasher = python_hashes, sink: KvEventSink | None = None) -> None:
        self.granularity = block_size
        self._hasher = hasher
        self._sink = sink
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def _keys(self, tokens: Sequence[int]) -> list[int]:
        return self._hasher(tokens, self.granularity)

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
        keys = self._keys(tokens)
        resident = 0
        while resident < len(keys) and keys[resident] in self._blocks:
            resident += 1
        for key in reversed(keys):
            self._blocks[key] = None
            self._blocks.move_to_end(key)
        if self._sink is not None and resident < len(keys):
            bs = self.granularity
            parent = keys[resident - 1] if resident else None
            self._sink.emit(Stored(tuple(keys[resident:]), parent, tuple(tokens[resident * bs : len(keys) * bs]), bs))

    def evict_to(self, capacity_tokens: int) -> None:
        limit = max(0, capacity_tokens // self.granularity)
        while len(self._blocks) > limit:
            key, _ = self._blocks.popitem(last=False)
            if self._sink is not None:
                self._sink.emit(Removed((key,)))

    def clear(self) -> None:
        self._blocks.clear()
        if self._sink is not None:
            self._sink.emit(Cleared())

    @property
    def size_tokens(self) -> int:
        return len(self._blocks) * self.granularity

    def resident_hashes(self) -> set[int]:
        """The keys of every resident block (for tests and diagnostics)."""
        return set(self._blocks)


class _Node:
    __slots__ = ("children", "digests", "hashes", "key", "last_use", "parent")

    def __init__(self, key: tuple[Hashable, ...], parent: _Node | None, last_use: int) -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, _Node] = {}
        self.last_use = last_use
        self.hashes: list[int] = []  # one event hash per page of `key` (only with a sink)
        self.digests: list[bytes] = []


class RadixCache:
    """A radix tree over pages with LRU leaf eviction, like SGLang's RadixCache. Page size 1 (the
    default) is token granularity; with a larger page only whole pages are matched and inserted."""

    def __init__(self, page_size: int = 1, *, sink: KvEventSink | None = None) -> None:
        self.granularity = page_size
        self._sink = sink
        self._root = _Node((), None, 0)
        self._tick = 0
        self._size = 0  # in pages

    def _atoms(self, tokens: Sequence[int]) -> tuple[Hashable, ...]:
        p = self.granularity
        if p == 1:
            return tuple(tokens)
        return tuple(tuple(tokens[i : i + p]) for i in range(0, len(tokens) - p + 1, p))

    @staticmethod
    def _page_tokens(atom: Hashable) -> list[int]:
        return [int(t) for t in atom] if isinstance(atom, tuple) else [int(str(atom))]

    def _walk(self, atoms: tuple[Hashable, ...], *, split: bool) -> tuple[_Node, int]:
        """Follow `atoms` from the root; return the deepest node fully matched and the matched length.
        With `split`, a partially matched edge is split so the match ends on a node."""
        self._tick += 1
        node, i = self._root, 0
        while i < len(atoms):
            child = node.children.get(atoms[i])
            if child is None:
                break
            k = 0
            while k < len(child.key) and i + k < len(atoms) and child.key[k] == atoms[i + k]:
                k += 1
            if k < len(child.key):
                if not split:
                    child.last_use = self._tick
                    return node, i + k
                mid = _Node(child.key[:k], node, self._tick)
                mid.hashes, child.hashes = child.hashes[:k], child.hashes[k:]
                mid.digests, child.digests = child.digests[:k], child.digests[k:]
                node.children[atoms[i]] = mid
                child.key = child.key[k:]
                child.parent = mid
                mid.children[child.key[0]] = child
                return mid, i + k
            child.last_use = self._tick
            node, i = child, i + k
        return node, i

    def match(self, tokens: Sequence[int]) -> int:
        return self._walk(self._atoms(tokens), split=False)[1] * self.granularity

    def insert(self, tokens: Sequence[int]) -> None:
        atoms = self._atoms(tokens)
        node, i = self._walk(atoms, split=True)
        if i >= len(atoms):
            return
        rest = atoms[i:]
        leaf = _Node(rest, node, self._tick)
        node.children[rest[0]] = leaf
        self._size += len(rest)
        if self._sink is not None:
            prior = node.digests[-1] if node.digests else None
            pages = [self._page_tokens(a) for a in rest]
            pairs = sglang_page_hashes(pages, prior)
            leaf.hashes, leaf.digests = [h for h, _ in pairs], [d for _, d in pairs]
            parent = node.hashes[-1] if node.hashes else None
            for page, h in zip(pages, leaf.hashes, strict=True):
                self._sink.emit(Stored((h,), parent, tuple(page), len(page)))
                parent = h

    def evict_to(self, capacity_tokens: int) -> None:
        capacity = max(0, capacity_tokens // self.granularity)
        if self._size <= capacity:
            return
        leaves = sorted(self._leaves(), key=lambda n: n.last_use)
        while self._size > capacity and leaves:
            leaf = leaves.pop(0)
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            self._size -= len(leaf.key)
            if self._sink is not None:
                for h in leaf.hashes:
                    self._sink.emit(Removed((h,)))
            if parent is not self._root and not parent.children:
                # The parent became a leaf; keep LRU order by re-inserting it.
                idx = 0
                while idx < len(leaves) and leaves[idx].last_use <= parent.last_use:
                    idx += 1
                leaves.insert(idx, parent)

    def clear(self) -> None:
        self._root = _Node((), None, 0)
        self._size = 0
        if self._sink is not None:
            self._sink.emit(Cleared())

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
        return self._size * self.granularity

    def resident_hashes(self) -> set[int]:
        out: set[int] = set()
        stack = [self._root]
        while stack:
            n = stack.pop()
            out.update(n.hashes)
            stack.extend(n.children.values())
        return out
