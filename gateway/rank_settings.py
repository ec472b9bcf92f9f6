"""The config rules of data-parallel ranks (`backends[].data_parallel_size`, `dp_rank_field`), shared
by static backends (`settings.Backend`) and discovery entries (`discovery.config.DiscoveryEntry`).

Which runtimes take a rank, and how (facts from the engines' sources):

* vLLM: the `X-data-parallel-rank` header (`OpenAIServing._get_data_parallel_rank`); the engine
  client checks `0 <= rank < data_parallel_size` (a 400 today; older engines indexed their engine
  list with it and crashed), so the gateway never sends a rank it was not told exists.
* SGLang: `routed_dp_rank` in the body since PR #19268 (2026-02), `data_parallel_rank` before (still
  read as a deprecated alias since); the tokenizer manager checks the range (a 400), older DP
  controllers indexed their workers with it (an IndexError in the controller: the server dies).
* trtllm-serve: attention-DP ranks are placed by its own scheduler; its OpenAI request schema
  (`extra="forbid"`) declares no rank (the LLM API's `SchedulingParams.attention_dp_rank` is not
  exposed), so a trtllm-serve backend is one routing unit whatever its attention-DP size.
* Triton: no data parallelism to pin.

Imports nothing of the gateway, so `settings` and `discovery.config` can both use it.
"""

from __future__ import annotations

from typing import Final, Protocol

from backends.base import Runtime

MAX_RANKS: Final = 64  # a bound on the `rank` label's values, and on the units one backend adds


def unit_name(backend: str, rank: int) -> str:
    """The routing unit of a data-parallel rank: `<backend>@<rank>` (no backend name has an `@`)."""
    return f"{backend}@{rank}"


def unit_backend(unit: str) -> str:
    """The backend of a routing unit (the unit itself when it is a whole backend)."""
    return unit.partition("@")[0]


class _Ranked(Protocol):
    @property
    def runtime(self) -> Runtime: ...

    @property
    def data_parallel_size(self) -> int: ...

    @property
    def dp_rank_field(self) -> str | None: ...


def kv_ranks_default(data: object) -> object:
    """A backend's raw config with `kv_events.data_parallel_size` defaulting to its own
    `data_parallel_size` (the ranks publish on the endpoint's port + rank)."""
    if not isinstance(data, dict):
        return data
    size, kv = data.get("data_parallel_size"), data.get("kv_events")
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1 and isinstance(kv, dict) \
            and "data_parallel_size" not in kv:
        return {**data, "kv_events": {**kv, "data_parallel_size": size}}
    return data


def check_ranks(backend: _Ranked) -> None:
    """Raise ValueError (naming the field) when the ranks cannot be pinned on this runtime."""
    if backend.dp_rank_field is not None and backend.runtime is not Runtime.SGLANG:
        raise ValueError("dp_rank_field: only SGLang takes its rank in a body field "
                         "(vLLM reads the X-data-parallel-rank header)")
    size = backend.data_parallel_size
    if size == 1:
        return
    if backend.runtime is Runtime.TRTLLM:
        raise ValueError("data_parallel_size: trtllm-serve places requests on its attention-DP ranks itself and "
                         "its OpenAI API takes no rank; give 1")
    if backend.runtime is Runtime.TRITON:
        raise ValueError("data_parallel_size: Triton takes no data-parallel rank; give 1")
    kv = getattr(backend, "kv_events", None)
    kv_size = getattr(kv, "data_parallel_size", size)
    if kv_size != size:
        raise ValueError(f"kv_events.data_parallel_size: {kv_size} differs from data_parallel_size {size} "
                         "(one server's ranks publish its events)")
