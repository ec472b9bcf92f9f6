"""The blocks one engine (one data-parallel rank) holds, as its events describe them (pure).

Blocks are keyed by the gateway's own chained hash of their token ids (`routing.tokens`), so the
same code serves every runtime and nothing depends on an engine's hash seed. The engine's hash of
each block maps to our key, for removals and for resolving the parent of the next store; mappings
of removed blocks are kept a while (bounded), because an engine may store a block under a parent
it evicted in between.

A prefix hit is the run of the prompt's leading blocks that are resident, as the engines look it
up (vLLM's `find_longest_cache_hit`, SGLang's radix match, TensorRT-LLM's block reuse): stop at
the first missing block. That run is found by binary search when the resident set is prefix-closed
(every resident block's parent resident), which is the normal state because engines evict chains
from the tail; `orphans` counts resident blocks whose parent is not, and while there are any a
linear walk replaces the search, so the answer stays exact.

Blocks confirmed by an engine's usage report rather than by an event (`confirm`, used while an
index is rebuilt after lost events) have no engine hash; they are `ghosts` until an event stores
them, and `unconfirm` removes them again when a report shows they are gone.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Final

from ..routing.tokens import ROOT_KEY, TokenPrompt, extend, key_tokens, pack
from .events import Hash, Removed, Stored

REMOVED_MEMORY: Final = 65_536  # engine hashes of removed blocks kept for parent resolution


class RankIndex:
    """Resident blocks of one engine rank. Mutated only by the event intake and reports."""

    __slots__ = ("_removed", "block_size", "by_hash", "ghosts", "kids", "orphans", "parent", "unresolved")

    def __init__(self) -> None:
        self.parent: dict[int, int] = {}  # resident key -> its parent's key (ROOT_KEY for a first block)
        self.kids: dict[int, int] = {}  # key (resident or not) -> how many resident blocks name it parent
        self.orphans = 0  # resident blocks whose parent is not resident
        self.by_hash: dict[Hash, int] = {}  # engine hash -> our key, resident blocks
        self._removed: OrderedDict[Hash, int] = OrderedDict()  # ... and recently removed ones
        self.ghosts: set[int] = set()  # resident keys no event has named yet (confirmed by usage)
        self.block_size: int | None = None
        self.unresolved = 0  # stores skipped: unknown parent, or not keyable

    def __len__(self) -> int:
        return len(self.parent)

    def clear(self) -> None:
        self.parent.clear()
        self.kids.clear()
        self.orphans = 0
        self.by_hash.clear()
        self._removed.clear()
        self.ghosts.clear()
        self.block_size = None

    # --- events -----------------------------------------------------------------------------

    def _key_of(self, h: Hash | None) -> int | None:
        if h is None:
            return ROOT_KEY
        key = self.by_hash.get(h)
        return key if key is not None else self._removed.get(h)

    def store(self, ev: Stored) -> int:
        """Apply a store; returns how many blocks became resident."""
        if not ev.usable:
            self.unresolved += len(ev.block_hashes)
            return 0
        if self.block_size != ev.block_size:
            if self.parent:  # engines keep one block size; a change means a different cache
                self.clear()
            self.block_size = ev.block_size
        parent = self._key_of(ev.parent)
        if parent is None:
            self.unresolved += len(ev.block_hashes)
            return 0
        bs = ev.block_size
        ids = ev.token_ids
        added = 0
        for i, h in enumerate(ev.block_hashes):
            key = extend(parent, pack(ids[i * bs : (i + 1) * bs]))
            self._removed.pop(h, None)
            self.by_hash[h] = key
            if self._add(key, parent):
                added += 1
            self.ghosts.discard(key)
            parent = key
        return added

    def _add(self, key: int, parent: int) -> bool:
        if key in self.parent:
            return False
        self.parent[key] = parent
        if parent != ROOT_KEY:
            self.kids[parent] = self.kids.get(parent, 0) + 1
            if parent not in self.parent:
                self.orphans += 1
        # blocks stored before this one under it are no longer orphans
        self.orphans -= self.kids.get(key, 0)
        return True

    def remove(self, ev: Removed) -> int:
        """Apply a removal; returns how many resident blocks went."""
        gone = 0
        for h in ev.block_hashes:
            key = self.by_hash.pop(h, None)
            if key is None:
                continue
            self._removed[h] = key
            if len(self._removed) > REMOVED_MEMORY:
                self._removed.popitem(last=False)
            if self._drop(key):
                gone += 1
        return gone

    def _drop(self, key: int) -> bool:
        parent = self.parent.pop(key, None)
        if parent is None:
            return False
        self.ghosts.discard(key)
        if parent != ROOT_KEY:
            n = self.kids.get(parent, 0) - 1
            if n > 0:
                self.kids[parent] = n
            else:
                self.kids.pop(parent, None)
            if parent not in self.parent:
                self.orphans -= 1
        self.orphans += self.kids.get(key, 0)  # its resident children lost their parent
        return True

    # --- lookups ----------------------------------------------------------------------------

    def match(self, prompt: TokenPrompt) -> int:
        """Prompt tokens this rank would serve from its cache: whole blocks of the cacheable part.

        Blocks smaller than 16 tokens that divide 16 (SGLang pages) are searched at 16-token keys
        first, which the engine holds too, then refined inside the next 16 tokens. This runs for
        every live backend on every decision, so the common cases are answered inline: nothing
        held (one probe), everything held (one probe), or the run the previous backend found for
        this prompt (`TokenPrompt.hints`: holders of a hot prefix share it; two probes)."""
        bs = self.block_size
        resident = self.parent
        if bs is None or not resident:
            return 0
        orphans = self.orphans
        small = bs < 16 and 16 % bs == 0 and not orphans  # with holes, small pages are walked one by one
        unit = 16 if small else bs
        keys = prompt.keys(unit)
        n = len(keys)
        if n == 0 or keys[0] not in resident:
            run = 0
        elif orphans:
            run = 1
            while run < n and keys[run] in resident:
                run += 1
        elif keys[n - 1] in resident:
            run = n
        else:
            hints = prompt.hints
            hint = hints.get(unit, 0)
            if 0 < hint < n and keys[hint - 1] in resident and keys[hint] not in resident:
                run = hint
            else:
                lo, hi = 1, n - 1  # keys[lo - 1] is resident, keys[hi] is not
                while lo < hi:
                    mid = (lo + hi) // 2
                    if keys[mid] in resident:
                        lo = mid + 1
                    else:
                        hi = mid
                run = hints[unit] = lo
        if small:
            return self._refine(prompt, run * 16, keys[run - 1] if run else ROOT_KEY)
        return run * unit

    def _refine(self, prompt: TokenPrompt, tokens: int, base: int) -> int:
        """Extend a hit of `tokens` (key `base`) by the resident pages among the next 15 tokens, by
        binary search (the set is prefix-closed here)."""
        bs = self.block_size or 1
        resident = self.parent
        pages = min(16 // bs - 1, (prompt.cacheable - tokens) // bs)
        if pages <= 0:
            return tokens
        lo, hi = 0, pages  # `lo` pages are resident; more than `hi` are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if prompt.key_at(base, tokens, mid * bs) in resident:
                lo = mid
            else:
                hi = mid - 1
        return tokens + lo * bs

    # --- reports (rebuilding) ---------------------------------------------------------------

    def confirm(self, prompt: TokenPrompt, cached_tokens: int) -> int:
        """The engine served `cached_tokens` of `prompt` from cache: those blocks are resident."""
        bs = self.block_size
        if bs is None or cached_tokens <= 0:
            return 0
        added = 0
        parent = ROOT_KEY
        for key in prompt.keys(bs)[: cached_tokens // bs]:
            if self._add(key, parent):
                self.ghosts.add(key)
                added += 1
            parent = key
        return added

    def unconfirm(self, prompt: TokenPrompt, cached_tokens: int) -> int:
        """The engine served only `cached_tokens`: resident blocks of `prompt` past them are gone
        (ghosts) or will be removed by events (real blocks: their removal may still be in flight)."""
        bs = self.block_size
        if bs is None or not self.ghosts:
            return 0
        gone = 0
        for key in prompt.keys(bs)[max(cached_tokens, 0) // bs :]:
            if key in self.ghosts and self._drop(key):
                gone += 1
        return gone

    def tokens_held(self) -> int:
        return len(self.parent) * (self.block_size or 0)

    def keys(self) -> Iterable[int]:
        return self.parent.keys()


__all__ = ["RankIndex", "key_tokens"]
