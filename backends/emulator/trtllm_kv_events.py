"""trtllm-serve's KV-cache events: `POST /kv_cache_events` (JSON).

As TensorRT-LLM does it (`cpp/tensorrt_llm/batch_manager/kvCacheEventManager.cpp`,
`tensorrt_llm/_utils.py` `KVCacheEventSerializer`, `tensorrt_llm/serve/openai_server.py`
`get_kv_cache_events`):

* every event gets the next `event_id` (from 0); the first is `created`
  (`num_blocks_per_cache_level`: primary, secondary) when the cache manager starts;
* `stored` lists the blocks stored together with the parent of the first (`parent_hash`, null at
  the root), each block `{type: stored_block, block_hash, tokens: [{type: unique_token, token_id,
  token_extra_id}], cache_level: 0, priority: 35}`;
* `removed` events merge consecutive removals into one `block_hashes` list;
* each event is `{event_id, data, window_size}`; the queue keeps at most `event_buffer_max_size`
  events, discarding the oldest;
* the endpoint drains the queue (each event is returned once), waiting up to its timeout (2 s)
  for a first event when the queue is empty, and returns `[]` otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Sequence
from typing import Any

from backends.emulator.config import KvEventsConfig
from backends.emulator.kv_events import Cleared, KvEvent, Removed, Stored

PRIMARY_LEVEL = 0
DEFAULT_PRIORITY = 35  # KvCacheRetentionConfig's default retention priority


class TrtllmKvEventQueue:
    def __init__(self, cfg: KvEventsConfig, *, window_size: int, primary_blocks: int, poll_timeout_s: float = 2.0):
        self.cfg = cfg
        self._window = window_size
        self._events: deque[dict[str, Any]] = deque(maxlen=cfg.max_events)
        self._next_id = 0
        self._batches = 0
        self._drop: set[int] = set(cfg.drop_batches)
        self._silent = False
        self._arrived = asyncio.Event()
        self.poll_timeout_s = poll_timeout_s
        self._append([{"type": "created", "num_blocks_per_cache_level": [primary_blocks, 0]}])

    def drop_next(self, count: int = 1) -> None:
        self._drop.update(range(self._batches, self._batches + count))

    def silence(self, silent: bool = True) -> None:
        self._silent = silent

    def _append(self, datas: list[dict[str, Any]]) -> None:
        for data in datas:
            self._events.append({"event_id": self._next_id, "data": data, "window_size": self._window})
            self._next_id += 1
        self._arrived.set()

    def publish(self, events: Sequence[KvEvent]) -> None:
        """One iteration's events (the manager's `flush`): ids are consumed even when dropped."""
        if not events:
            return
        datas = _convert(events)
        batch, self._batches = self._batches, self._batches + 1
        limit = self.cfg.silent_after
        if self._silent or batch in self._drop or (limit is not None and batch >= limit):
            self._next_id += len(datas)
            return
        self._append(datas)

    async def drain(self) -> list[dict[str, Any]]:
        if not self._events:
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), self.poll_timeout_s)
        out = list(self._events)
        self._events.clear()
        return out


def _convert(events: Sequence[KvEvent]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for ev in events:
        if isinstance(ev, Stored):
            bs = ev.block_size
            blocks = [{
                "type": "stored_block", "block_hash": h,
                "tokens": [{"type": "unique_token", "token_id": t, "token_extra_id": 0}
                           for t in ev.token_ids[i * bs : (i + 1) * bs]],
                "cache_level": PRIMARY_LEVEL, "priority": DEFAULT_PRIORITY,
            } for i, h in enumerate(ev.block_hashes)]
            out.append({"type": "stored", "parent_hash": ev.parent, "blocks": blocks})
        elif isinstance(ev, Removed):
            if out and out[-1]["type"] == "removed":
                out[-1]["block_hashes"].extend(ev.block_hashes)
            else:
                out.append({"type": "removed", "block_hashes": list(ev.block_hashes)})
        elif isinstance(ev, Cleared):
            continue  # TensorRT-LLM has no clear-all event (and no reset endpoint)
    return out
