"""The clock every gateway process runs on: monotonic, and anchored to the Unix epoch once at start.

Durations need a monotonic clock (a wall-clock step must not make a request last -3 s); merging the
windows of several processes needs one time base (second 1,700,000,000 must be the same second in
every worker and, up to NTP, on every host). `perf_counter() + (time() - perf_counter())` measured
once gives both: it advances like `perf_counter` and reads like `time.time()` at start. Double
precision at 1.7e9 s still resolves 0.25 µs. Compiled (`setup.py`): the relay reads it once per
chunk it relays.
"""

from __future__ import annotations

import time
from typing import Final

_OFFSET: Final = time.time() - time.perf_counter()
_perf_counter: Final = time.perf_counter  # Final: a C static when compiled, not two lookups a read


def gateway_clock() -> float:
    """Seconds since the Unix epoch as of process start, advancing monotonically."""
    return _perf_counter() + _OFFSET
