"""Process-independent hashes: prompt block chains, stable string keys and rendezvous scores.

Python's `hash()` is salted per process, so two gateway replicas (or two workers) would disagree on
every placement. Everything here is a pure function of bytes:

* prompt chains use `zlib.crc32` with the previous value as the running state, so the value after
  block i is the CRC of the whole prefix (a chained hash by construction) at one C call per block
  (~0.2 µs; blake2b chaining measured 2x slower). 32 bits are enough: a false prefix match needs a
  query hash to collide with one of ~10^5 entries of one backend (p ~ 2e-5), and costs only a
  mispredicted cache hit;
* string keys (prefix keys, session ids, backend and arm names) use blake2b-64;
* rendezvous scores mix a key with a backend's hash through splitmix64's finaliser, which turns
  correlated inputs (consecutive CRCs, similar names) into independent-looking 64-bit scores.
"""

from __future__ import annotations

import hashlib
import math
import zlib
from functools import lru_cache
from typing import Final

MASK64: Final = (1 << 64) - 1
_TWO64: Final = float(1 << 64)


def mix64(x: int) -> int:
    """splitmix64's finaliser: a bijection on 64-bit ints with full avalanche."""
    z = (x + 0x9E3779B97F4A7C15) & MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return z ^ (z >> 31)


@lru_cache(maxsize=65536)
def stable_hash(text: str) -> int:
    """A 64-bit hash of `text` that every process computes alike (cached: names repeat)."""
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def hrw(key: int, name: str) -> int:
    """The rendezvous (highest-random-weight) score of `name` for `key`; higher wins."""
    return mix64(key ^ stable_hash(name))


def unit_interval(key: int, name: str) -> float:
    """A uniform draw in (0, 1) determined by `key` and `name` (for weighted rendezvous)."""
    return (hrw(key, name) + 0.5) / _TWO64


def weighted_score(key: int, name: str, weight: float) -> float:
    """Weighted rendezvous: the minimum of `-ln(u) / weight` over arms is the arm with probability
    weight / sum(weights), and changing one weight only moves keys into or out of that arm."""
    return -math.log(unit_interval(key, name)) / weight


def chain_hashes(data: bytes, unit: int, seed: int = 0) -> tuple[int, ...]:
    """Running CRC-32 after each full `unit`-byte block of `data` (a trailing partial block is not
    cacheable by any engine, so it is not hashed)."""
    crc = zlib.crc32
    view = memoryview(data)
    h = seed & 0xFFFFFFFF
    out: list[int] = []
    append = out.append
    for start in range(0, len(data) - unit + 1, unit):
        h = crc(view[start : start + unit], h)
        append(h)
    return tuple(out)
