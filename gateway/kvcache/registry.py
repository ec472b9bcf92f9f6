"""Every backend's engine-reported cache, by backend name: what routing consults and feeds.

One per gateway process, created by the composition root and shared by every config generation
(like the routing memory): a reload that keeps a backend keeps its cache. The intake tasks
(`intake.py`) write into it; the routing memory reads it through `overlay` / `predict` and feeds it
through `observe`. The clock is injected; it is read only to timestamp what arrives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence

from ..routing.base import BackendView
from ..routing.tokens import TokenPrompt
from .cache import BackendCache, State


class KvCaches:
    """Implements the routing memory's `EngineFeedback` over the backends' `BackendCache`s."""

    def __init__(self, *, clock: Callable[[], float]) -> None:
        self.clock = clock
        self._caches: dict[str, BackendCache] = {}

    def __contains__(self, backend: object) -> bool:
        return backend in self._caches

    def __iter__(self) -> Iterator[BackendCache]:
        return iter(self._caches.values())

    def get(self, backend: str) -> BackendCache | None:
        return self._caches.get(backend)

    def add(self, backend: str) -> BackendCache:
        got = self._caches.get(backend)
        if got is None:
            got = self._caches[backend] = BackendCache(backend)
        return got

    def drop(self, backend: str) -> None:
        self._caches.pop(backend, None)

    def retain(self, backends: Iterable[str]) -> None:
        keep = set(backends)
        for name in [n for n in self._caches if n not in keep]:
            del self._caches[name]

    # --- routing --------------------------------------------------------------------------

    def overlay(self, prompt: TokenPrompt, views: Sequence[BackendView], hits: list[int]) -> None:
        """A view of a data-parallel rank (`view.rank`) is matched against that rank's index only;
        a whole backend against its best rank's."""
        get = self._caches.get
        live = State.LIVE
        for i, view in enumerate(views):
            cache = get(view.backend)
            if cache is not None and cache.state is live:
                rank = view.rank
                hits[i] = cache.match(prompt) if rank is None else cache.match_rank(prompt, rank)

    def predict(self, backend: str, prompt: TokenPrompt, rank: int | None = None) -> tuple[int | None, bool, int]:
        cache = self._caches.get(backend)
        if cache is None:
            return None, False, 0
        hit = cache.match(prompt) if rank is None else cache.match_rank(prompt, rank)
        return hit, cache.live, cache.counter

    def observe(self, backend: str, prompt: TokenPrompt | None, *, predicted: int | None,
                cached_tokens: int | None, prompt_tokens: int | None, counter: int, rank: int | None = None) -> None:
        cache = self._caches.get(backend)
        if cache is not None:
            cache.observe(prompt, predicted=predicted, cached_tokens=cached_tokens, prompt_tokens=prompt_tokens,
                          counter_at_dispatch=counter, now=self.clock(), rank=rank)

    def prepare(self, prompt: TokenPrompt, backends: Sequence[str]) -> None:
        sizes = set()
        for name in backends:
            cache = self._caches.get(name)
            if cache is not None and cache.live:
                bs = cache.block_size
                if bs is not None:
                    sizes.add(16 if bs < 16 and 16 % bs == 0 else bs)  # small pages search 16-token keys
        for bs in sizes:
            prompt.keys(bs)

    def tick(self) -> list[BackendCache]:
        """Periodic (`BackendCache.tick`): the caches whose publisher just became silent."""
        now = self.clock()
        return [cache for cache in self._caches.values() if cache.tick(now)]
