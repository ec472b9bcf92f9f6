"""Which backend holds a stored response: `previous_response_id` must go back to it.

Stored Responses live in the backend that produced them (SGLang, trtllm-serve, vLLM with
`VLLM_ENABLE_RESPONSES_API_STORE=1`); another backend answers 404. The gateway remembers the backend
of every response it relayed from a backend that stores them, up to `capacity` ids (oldest
forgotten first), and routes a request naming one of them there. Per process: with several workers
or replicas an id relayed by another process is unknown here, and the request goes to any backend of
the route that stores responses (say so in the README; one storing backend per route, or sticky
sessions, avoid the 404).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Final

CAPACITY: Final = 100_000


class ResponseOwners:
    def __init__(self, capacity: int = CAPACITY) -> None:
        self._capacity = capacity
        self._owners: OrderedDict[str, str] = OrderedDict()

    def remember(self, response_id: str, backend: str) -> None:
        owners = self._owners
        owners[response_id] = backend
        owners.move_to_end(response_id)
        if len(owners) > self._capacity:
            owners.popitem(last=False)

    def owner(self, response_id: object) -> str | None:
        return self._owners.get(response_id) if isinstance(response_id, str) else None

    def __len__(self) -> int:
        return len(self._owners)
