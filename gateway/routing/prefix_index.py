"""What each backend probably has in its prefix cache, from what the gateway sent it.

Per backend, an LRU of block hash -> tick of the last send that contained it, bounded to `capacity`
entries. Engines cache prompts in chained blocks and evict least-recently-used blocks, so mirroring
that with the same chained hashes predicts their hits without asking them.

Lookup is the run of leading blocks present, found in O(log blocks) probes instead of a walk over
every block for every backend (a hot prefix held by 16 backends would cost ~750 probes). That is
exact because of prefix closure: `record` inserts a chain deepest-first, so a block's ancestors are
always at least as recent as the block itself (every send containing a block passes through its
ancestors), and LRU eviction removes tails before heads, like the engines' own LRU. Corrections
(`observe`, `abandon`) can break closure: cutting chain C at block k leaves deeper blocks of longer
chains through C[k] orphaned. So each backend remembers the tick of its last cut; a binary-search
answer whose deepest block was recorded after it is exact, and an older one is re-checked by a
linear walk (in C) that stops at the first miss.

Engines are the ground truth: after a response, `observe` compares the engine-reported cached
tokens with what the index predicted at send time and forgets the blocks the engine no longer had.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import takewhile
from typing import Final

from .base import UNIT_CHARS, UNIT_TOKENS, BackendView, RequestFeatures, stride_for

DEFAULT_CAPACITY: Final = 50_000  # entries per backend: ~5 MB each, ~800k tokens at 16 tokens per block
# An explicit affinity key (x-prefix-key, x-session-id) is remembered in the same LRU as the blocks,
# as one entry apart from every chain (64-bit hashes: a collision is as likely as between blocks).
KEY_MARK: Final = 0x9E3779B97F4A7C15


def key_entry(key: int) -> int:
    """The LRU entry that says an explicit affinity key was sent to a backend."""
    return key ^ KEY_MARK


@dataclass(slots=True, unsafe_hash=True)
class Sent:
    """The index's memory of one dispatch, handed back to `observe` or `abandon` (per request: a
    value class with its `__init__` written out, `backends/values.py`)."""

    backend: Final[str]
    chain: Final[tuple[int, ...]]
    stride: Final[int]
    prompt_bytes: Final[int]
    predicted_blocks: Final[int]  # leading blocks the index believed the backend had before this send
    tick: Final[int]

    def __init__(self, backend: str, chain: tuple[int, ...], stride: int, prompt_bytes: int, predicted_blocks: int,
                 tick: int) -> None:
        self.backend = backend
        self.chain = chain
        self.stride = stride
        self.prompt_bytes = prompt_bytes
        self.predicted_blocks = predicted_blocks
        self.tick = tick

    @property
    def predicted_tokens(self) -> int:
        return self.predicted_blocks * self.stride * UNIT_TOKENS


class _Held:
    """One backend's slice of the index: its LRU, the tick of its last correction, its stride."""

    __slots__ = ("cut", "entries", "stride")

    def __init__(self, stride: int) -> None:
        self.entries: OrderedDict[int, int] = OrderedDict()  # block hash -> tick of the last send with it
        self.cut = 0  # the tick of the last correction (observe/abandon, or a change of stride)
        self.stride = stride


class PrefixIndex:
    """Per-backend LRU of chained block hashes. Pure state: no clock, no I/O."""

    def __init__(self, *, capacity: int = DEFAULT_CAPACITY, slack_blocks: int = 1) -> None:
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        # Engines never report the last prompt token as cached and round to their own blocks; a
        # shortfall of up to `slack_blocks` is noise, not eviction.
        self.slack_blocks = slack_blocks
        self._held: dict[str, _Held] = {}
        self._tick = 0
        # (chain, run in base units) of the last search: the holders of a hot prefix share its run
        self._last: tuple[tuple[int, ...], int] = ((), 0)

    def match(self, backend: str, chain: tuple[int, ...], stride: int) -> int:
        """Leading blocks of `chain` (at `stride` units per block) believed cached on `backend`:
        the run from the first block up to the first miss (see the module docstring for how)."""
        held = self._held.get(backend)
        if held is None:
            return 0
        return self._match(held, chain, stride)

    def hits(self, chain: tuple[int, ...], views: Sequence[BackendView]) -> list[int]:
        """Expected cached prompt tokens for each of `views` (`match` at each backend's engine
        granularity, in tokens), in one pass: this runs on every routing decision."""
        held = self._held
        match = self._match
        out: list[int] = []
        append = out.append
        for view in views:
            h = held.get(view.name)
            if h is None:
                append(0)
                continue
            bs = view.block_size
            stride = 1 if not bs or bs <= UNIT_TOKENS else -(-bs // UNIT_TOKENS)
            append(match(h, chain, stride) * stride * UNIT_TOKENS)
        return out

    def _match(self, held: _Held, chain: tuple[int, ...], stride: int) -> int:
        entries = held.entries
        if len(chain) < stride or chain[stride - 1] not in entries:
            return 0
        blocks = len(chain) // stride
        tick = entries.get(chain[blocks * stride - 1])
        if tick is not None:
            found = blocks
        else:
            # The run found for the previous backend on this same chain is the likely answer here too
            # (holders of a hot prefix share it, whatever their granularity): two probes confirm it.
            last_chain, last_units = self._last
            hint = last_units // stride
            if (
                last_chain is chain and 0 < hint < blocks
                and chain[hint * stride - 1] in entries and chain[(hint + 1) * stride - 1] not in entries
            ):
                found = hint
            else:
                lo, hi = 1, blocks - 1  # block lo-1 is present, block hi is absent
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if chain[mid * stride - 1] in entries:
                        lo = mid
                    else:
                        hi = mid - 1
                found = lo
                self._last = (chain, found * stride)
            tick = entries[chain[found * stride - 1]]
        if tick > held.cut and held.stride == stride:
            return found  # recorded after the last cut: its whole run is present
        walk = chain if stride == 1 else chain[stride - 1 :: stride]
        return len(list(takewhile(entries.__contains__, walk)))  # exact, in C

    def placed(self, key: int, views: Sequence[BackendView]) -> int:
        """The index in `views` of the backend an explicit affinity key was last sent to (and is
        still remembered by), or -1."""
        entry = key_entry(key)
        best, at = -1, -1
        for i, view in enumerate(views):
            held = self._held.get(view.name)
            tick = held.entries.get(entry) if held is not None else None
            if tick is not None and tick > best:
                best, at = tick, i
        return at

    def holds(self, backend: str, block_hash: int) -> bool:
        """Whether `block_hash` is in `backend`'s LRU (for tests and debugging)."""
        held = self._held.get(backend)
        return held is not None and block_hash in held.entries

    def record(self, backend: str, features: RequestFeatures, *, block_size: int | None) -> Sent:
        """Remember that `backend` was sent this prompt (call when the request is dispatched)."""
        chain = features.chain
        stride = stride_for(block_size)
        held = self._held.get(backend)
        if held is None:
            held = self._held[backend] = _Held(stride)
            predicted = 0
        else:
            predicted = self._match(held, chain, stride)
            if held.stride != stride:  # mixed granularities break the run shape
                held.cut = self._tick
                held.stride = stride
        self._tick += 1
        tick = self._tick
        entries = held.entries
        move = entries.move_to_end
        for end in range((len(chain) // stride) * stride, 0, -stride):  # deepest first
            key = chain[end - 1]
            entries[key] = tick
            move(key)
        explicit = features.affinity_key
        if explicit is not None and (features.prefix_key is not None or features.session_key is not None):
            entry = key_entry(explicit)
            entries[entry] = tick
            move(entry)
        while len(entries) > self.capacity:
            entries.popitem(last=False)
        return Sent(backend, chain, stride, features.prompt_bytes, predicted, tick)

    def observe(self, sent: Sent, *, cached_tokens: int | None, prompt_tokens: int | None) -> int:
        """Correct the index with the engine's report for `sent`; returns how many blocks it forgot.

        The engine's cached share of the prompt (cached / prompt tokens, both in its own tokens)
        is mapped onto our blocks, so the char-per-token approximation cancels out.
        """
        if cached_tokens is None or not prompt_tokens or prompt_tokens <= 0:
            return 0
        share = min(max(cached_tokens / prompt_tokens, 0.0), 1.0)
        kept = math.floor(share * sent.prompt_bytes / (UNIT_CHARS * sent.stride) + 1e-9)
        if kept + self.slack_blocks >= sent.predicted_blocks:
            return 0
        return self._forget_from(sent, kept)

    def abandon(self, sent: Sent) -> int:
        """The send never reached the engine (connect error, 429/503): undo what it added."""
        return self._forget_from(sent, sent.predicted_blocks)

    def _forget_from(self, sent: Sent, first_block: int) -> int:
        held = self._held.get(sent.backend)
        if held is None or not held.entries:
            return 0
        entries = held.entries
        forgotten = 0
        held.cut = self._tick
        stride, chain = sent.stride, sent.chain
        for end in range((first_block + 1) * stride, len(chain) + 1, stride):
            key = chain[end - 1]
            tick = entries.get(key)
            if tick is not None and tick <= sent.tick:  # a later send re-confirmed newer blocks
                del entries[key]
                forgotten += 1
        return forgotten

    def forget(self, backend: str) -> None:
        """The backend restarted or was ejected: its cache is gone."""
        self._held.pop(backend, None)

    def backends(self) -> list[str]:
        """Every name something is held for (backends, and data-parallel ranks' units)."""
        return list(self._held)

    def retain(self, backends: Iterable[str]) -> None:
        """Drop every backend not in `backends` (after a config reload)."""
        keep = set(backends)
        for name in [n for n in self._held if n not in keep]:
            self.forget(name)

    def size(self, backend: str) -> int:
        held = self._held.get(backend)
        return len(held.entries) if held else 0
