"""One backend's engine-reported cache: its ranks' indexes, and whether they can be trusted (pure).

States:

* `waiting`: configured, nothing received yet;
* `silent`: nothing ever received, although a response showed the engine stored new blocks more
  than `silent_after_s` ago: the source hears nothing (a misconfiguration, `silence.explain`);
* `live`: events arrive in sequence from the engine's start (or since the gateway saw the whole
  buffer replayed from sequence 0): the index is exact, and routing uses it;
* `rebuilding`: events were lost (a sequence gap no replay could fill, a first batch after the
  engine had already started, a restart whose first batches were missed, a silent publisher): the
  index may miss blocks and hold evicted ones. Its blocks become suspects (`RankIndex.ghosts`),
  new events keep it current, and each response's reported `cached_tokens` confirms blocks or
  removes suspects. Routing uses the approximate index for this backend meanwhile; the exact one
  is trusted again once events flow and `verify` consecutive predictions equalled the engine's
  report.

`AllBlocksCleared`, a publisher that restarts at sequence 0 and trtllm-serve's `created` event mean
the engine's cache is empty: the index is cleared and live. A publisher whose sequence goes back to
a number other than 0 restarted and its first batches were missed: the rank starts a new sequence
space, empty and untrusted (`rebuilding`, reason `restart`), and is live again only once a replay
returned every batch of the new sequence from 0 or predictions verified it. A replay that fills a
gap must also return the last batch applied, unchanged (the overlap): a different one means the
engine restarted meanwhile (its new sequence passed the old number), which is a restart too. A
publisher is silent when a response shows the engine stored new blocks and no batch arrived within
`silent_after_s` of it.

Data-parallel ranks have their own sequences and indexes. A request pinned to a rank (the backend's
`data_parallel_size` makes its ranks routing units) is predicted from that rank's index, and the
engine's report confirms that rank's blocks only; an unpinned request's hit is the best rank's (the
engine's DP balancer decides which rank serves it). Time arrives as arguments.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Final

from ..routing.tokens import TokenPrompt
from .events import Batch, Cleared, Created, KvEvent, Removed, Stored
from .index import RankIndex

VERIFY: Final = 3  # consecutive exact predictions that end a rebuild
SILENT_AFTER_S: Final = 5.0
# Uncached prompt tokens that show an engine whose block size is not known yet (no event ever
# arrived) stored at least one block: no runtime's block or page is larger by default.
UNKNOWN_BLOCK_TOKENS: Final = 128


class State(StrEnum):
    WAITING = "waiting"
    SILENT = "silent"
    LIVE = "live"
    REBUILDING = "rebuilding"


class Filled(StrEnum):
    """What a replay did to the batches a held batch waits for (`BackendCache.fill`)."""

    CLOSED = "closed"  # all there: applied, then the held batch
    LOST = "lost"  # not all there (or continuity unproven): the rank rebuilds
    RESTARTED = "restarted"  # the engine restarted meanwhile: replay its new sequence from 0


@dataclass(slots=True)
class Rank:
    index: RankIndex = field(default_factory=RankIndex)
    next_seq: int | None = None  # the sequence number expected next; None before the first batch
    held: Batch | None = None  # a batch received after a gap, applied once the gap is resolved
    why: str = ""  # why `held` is held: "gap", "joined late" or "restart" (the reset a loss counts)
    last: Batch | None = None  # the last batch applied: a replay that fills a gap must return it unchanged
    trusted: bool = False  # its index is complete: in sequence from the cache's start, or verified
    batches: int = 0
    last_at: float | None = None


@dataclass(slots=True)
class Stats:
    batches: int = 0
    events: int = 0
    decode_errors: int = 0
    resets: dict[str, int] = field(default_factory=dict)
    checked: int = 0  # live predictions compared with the engine's report
    exact: int = 0  # ... that were equal


class BackendCache:
    """The event-built cache of one backend (all its DP ranks)."""

    def __init__(self, name: str, *, verify: int = VERIFY, silent_after_s: float = SILENT_AFTER_S) -> None:
        self.name = name
        self.verify = verify
        self.silent_after_s = silent_after_s
        self.ranks: dict[int, Rank] = {}
        self._indexes: list[RankIndex] = []  # the ranks' indexes, for `match`
        self.state = State.WAITING
        self.reason = "no events yet"
        self.changed_at: float | None = None
        self.stats = Stats()
        self.counter = 0  # batches applied, ever (silence evidence compares it)
        self.last_batch_at: float | None = None
        self._streak = 0
        self._batches_since_loss = 0
        self._awaiting: float | None = None  # when a response showed stores and no batch followed
        self.silent = False  # no batch since a response showed stores, for `silent_after_s`
        self.hint = ""  # why a silent source hears nothing, and the fix (set by the intake)
        self.connected: bool | None = None  # whether a publisher is connected (None: not known)

    @property
    def live(self) -> bool:
        return self.state is State.LIVE

    def _rank(self, rank: int) -> Rank:
        got = self.ranks.get(rank)
        if got is None:
            got = self.ranks[rank] = Rank()
            self._indexes.append(got.index)
        return got

    def _set(self, state: State, reason: str, now: float) -> None:
        if state is not self.state or reason != self.reason:
            self.state, self.reason, self.changed_at = state, reason, now

    # --- events (vLLM, SGLang) ----------------------------------------------------------------

    def receive(self, batch: Batch, now: float) -> int | None:
        """A live batch. When batches were lost before it, it is held and the sequence number a
        replay should start from is returned (then call `fill` with what the replay returned, or
        `unfilled`); else None. A gap's replay starts at the last batch applied (the overlap
        `fill` checks)."""
        r = self._rank(batch.rank)
        self._heard(now)
        if r.next_seq is None or (batch.seq < r.next_seq and batch.seq != 0):
            if batch.seq == 0:
                self._apply(r, batch, now)
                self._started(r, now)
                return None
            if r.next_seq is not None:  # the sequence went back, not to 0: a restart, its first batches missed
                self._restart(r, now)
            else:
                r.why = "joined late"
            r.held = batch
            return 0
        if batch.seq == r.next_seq:
            self._apply(r, batch, now)
            return None
        if batch.seq > r.next_seq:
            r.held = batch
            r.why = "gap"
            return r.next_seq - 1 if r.last is not None else r.next_seq
        # sequence 0 again: the publisher (the engine) restarted with an empty cache
        r.index.clear()
        self._count_reset("restart")
        self._apply(r, batch, now)
        self._started(r, now)
        return None

    def fill(self, rank: int, replayed: Sequence[Batch], now: float) -> Filled:
        """Batches a replay returned for what the held batch waits for. RESTARTED when the replay
        shows that the engine restarted meanwhile (its batch at the last sequence number applied is
        another one): the rank then waits for its new sequence, to be replayed from 0."""
        r = self._rank(rank)
        held = r.held
        if held is None:
            return Filled.CLOSED
        got = {b.seq: b for b in replayed if b.seq < held.seq}
        last = r.last
        if r.next_seq is not None and last is not None:
            overlap = got.get(r.next_seq - 1)
            if overlap is None:  # the buffer no longer reaches back to it: continuity is unproven
                self.unfilled(rank, now)
                return Filled.LOST
            if overlap != last:
                self._restart(r, now)
                return Filled.RESTARTED
        start = 0 if r.next_seq is None else r.next_seq
        if any(seq not in got for seq in range(start, held.seq)):
            self.unfilled(rank, now)
            return Filled.LOST
        fresh = r.next_seq is None
        if fresh:
            r.index.clear()
            if r.why == "restart":
                self._count_reset("restart")
        for seq in range(start, held.seq):
            self._apply(r, got[seq], now)
        r.held = None
        self._apply(r, held, now)
        if fresh:
            self._started(r, now, "replayed from the engine's start")
        return Filled.CLOSED

    def unfilled(self, rank: int, now: float) -> None:
        """No replay filled what the held batch waits for (none is configured, it failed, or its
        buffer no longer has those batches): rebuild, counted as the reason the batch was held."""
        r = self._rank(rank)
        self.lose(rank, r.why or "gap", now)

    def lose(self, rank: int, reason: str, now: float) -> None:
        """The batches before the held one are gone: apply it, distrust the index, rebuild."""
        r = self._rank(rank)
        held, r.held = r.held, None
        self._lost([r], reason, now)
        if held is not None:
            self._apply(r, held, now)

    def _restart(self, r: Rank, now: float) -> None:
        """`r`'s publisher restarted and its first batches were missed: a new sequence space, from
        an empty index that nothing vouches for yet (a replay from 0, or verified predictions)."""
        r.index.clear()
        r.next_seq = None
        r.last = None
        r.trusted = False
        r.why = "restart"
        self._streak = 0
        self._batches_since_loss = 0
        self._set(State.REBUILDING, "restart", now)

    def _apply(self, r: Rank, batch: Batch, now: float) -> None:
        r.last = batch
        r.next_seq = batch.seq + 1
        r.batches += 1
        r.last_at = now
        self.counter += 1
        self.stats.batches += 1
        self._batches_since_loss += 1
        self.apply(r, batch.events, now)

    def apply(self, r: Rank, events: Iterable[KvEvent | None], now: float) -> None:
        stats = self.stats
        index = r.index
        for ev in events:
            if isinstance(ev, Stored):
                index.store(ev)
            elif isinstance(ev, Removed):
                index.remove(ev)
            elif isinstance(ev, Cleared | Created):
                index.clear()
                self._count_reset("cleared")
                self._started(r, now)
            else:
                continue
            stats.events += 1

    def _heard(self, now: float) -> None:
        self.last_batch_at = now
        self._awaiting = None
        self.silent = False
        self.hint = ""
        if self.state is State.SILENT:  # heard at last: what the batch says decides from here
            self._set(State.WAITING, "first batch arrived", now)

    def _started(self, r: Rank, now: float, reason: str = "events in sequence from the start") -> None:
        """`r`'s index is complete from its cache's start."""
        r.trusted = True
        if all(x.trusted for x in self.ranks.values()):
            self._streak = 0
            self._set(State.LIVE, reason, now)

    def _lost(self, ranks: Iterable[Rank], reason: str, now: float) -> None:
        self._count_reset(reason)
        for r in ranks:
            r.trusted = False
            idx = r.index
            idx.ghosts.update(idx.keys())  # suspects until an event or a report confirms them
        self._streak = 0
        self._batches_since_loss = 0
        self._set(State.REBUILDING, reason, now)

    def _count_reset(self, reason: str) -> None:
        self.stats.resets[reason] = self.stats.resets.get(reason, 0) + 1

    # --- events (trtllm-serve) ----------------------------------------------------------------

    def receive_trtllm(self, items: Sequence[tuple[int, KvEvent | None]], now: float) -> None:
        """One poll's events, with their event ids (consecutive from 0 per cache manager)."""
        if not items:
            return
        r = self._rank(0)
        self._heard(now)
        for event_id, ev in items:
            if isinstance(ev, Created):
                r.next_seq = event_id + 1
                self.apply(r, (ev,), now)
                continue
            if r.next_seq is None or event_id != r.next_seq:
                if r.next_seq is not None and event_id < r.next_seq:
                    r.index.clear()  # ids went back: a restart whose `created` was not seen
                self._lost([r], "gap" if r.next_seq is not None else "joined late", now)
            r.next_seq = event_id + 1
            self.apply(r, (ev,), now)
        r.batches += 1
        r.last_at = now
        self.counter += 1
        self.stats.batches += 1
        self._batches_since_loss += 1

    # --- the request path -----------------------------------------------------------------

    def match(self, prompt: TokenPrompt) -> int:
        """Expected cached tokens: the best rank's hit."""
        indexes = self._indexes
        if len(indexes) == 1:
            return indexes[0].match(prompt)
        best = 0
        for index in indexes:
            hit = index.match(prompt)
            if hit > best:
                best = hit
        return best

    def match_rank(self, prompt: TokenPrompt, rank: int) -> int:
        """Expected cached tokens on data-parallel `rank` (0 for a rank that never published: its
        cache has held nothing since the engine started, or the gateway has not heard it yet)."""
        r = self.ranks.get(rank)
        return 0 if r is None else r.index.match(prompt)

    @property
    def block_size(self) -> int | None:
        for r in self.ranks.values():
            if r.index.block_size is not None:
                return r.index.block_size
        return None

    def observe(self, prompt: TokenPrompt | None, *, predicted: int | None, cached_tokens: int | None,
                prompt_tokens: int | None, counter_at_dispatch: int, now: float, rank: int | None = None) -> None:
        """A response's usage, for the prediction `predicted` made at dispatch (None when this
        backend had no index then): verification, rebuilding and silence evidence. With `rank` (the
        request was pinned to it) only that rank's index is confirmed or corrected."""
        if cached_tokens is None:
            return
        if predicted is not None and self.live:
            self.stats.checked += 1
            if predicted == cached_tokens:
                self.stats.exact += 1
        bs = self.block_size or UNKNOWN_BLOCK_TOKENS
        stored = bool(prompt_tokens) and (prompt_tokens or 0) - 1 - cached_tokens >= bs
        if stored and self.counter == counter_at_dispatch and self._awaiting is None:
            self._awaiting = now  # the engine stored blocks for this request; its batch should follow
        if prompt is None or predicted is None:
            return
        served = self.ranks.values() if rank is None else [r for k, r in self.ranks.items() if k == rank]
        if cached_tokens > predicted:
            for r in served:
                r.index.confirm(prompt, cached_tokens)
        elif cached_tokens < predicted:
            for r in served:
                r.index.unconfirm(prompt, cached_tokens)
        if self.state is State.REBUILDING:
            self._streak = self._streak + 1 if predicted == cached_tokens else 0
            if self._streak >= self.verify and self._batches_since_loss > 0:
                for r in self.ranks.values():
                    r.index.ghosts.clear()
                    r.trusted = True
                self._set(State.LIVE, "rebuilt: predictions verified", now)

    def tick(self, now: float) -> bool:
        """Periodic: a publisher that stayed silent after a response showed stores. True when it
        just became silent (nothing was ever heard: state `silent`; else it rebuilds)."""
        since = self._awaiting
        if since is None or now - since <= self.silent_after_s:
            return False
        self._awaiting = None
        if self.silent:
            return False
        self.silent = True
        if self.state is State.WAITING:
            self._set(State.SILENT, "no KV event ever arrived", now)
        else:
            self._lost(self.ranks.values(), "silent", now)
        return True

    # --- admin ------------------------------------------------------------------------------

    def describe(self, now: float) -> dict[str, object]:
        """What `/admin/backends` shows under `kv_events`."""
        s = self.stats
        return {
            "state": self.state.value,
            "reason": self.reason,
            "state_age_s": None if self.changed_at is None else round(now - self.changed_at, 3),
            "last_event_age_s": None if self.last_batch_at is None else round(now - self.last_batch_at, 3),
            "silent": self.silent,
            "hint": self.hint or None,
            "connected": self.connected,
            "batches": s.batches,
            "events": s.events,
            "decode_errors": s.decode_errors,
            "resets": dict(s.resets),
            "predictions_checked": s.checked,
            "predictions_exact": s.exact,
            "ranks": {
                str(k): {
                    "next_seq": r.next_seq,
                    "blocks": len(r.index),
                    "tokens": r.index.tokens_held(),
                    "block_size": r.index.block_size,
                    "trusted": r.trusted,
                    "orphans": r.index.orphans,
                    "suspect_blocks": len(r.index.ghosts),
                    "unresolved_stores": r.index.unresolved,
                    "last_event_age_s": None if r.last_at is None else round(now - r.last_at, 3),
                }
                for k, r in sorted(self.ranks.items())
            },
        }
