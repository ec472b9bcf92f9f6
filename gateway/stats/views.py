"""What the comparison reads of a book of windows: the live `StatsBook` of one process, or a
`MergedBook` of several (`stats.export`: the workers of a gateway, the replicas of a fleet)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from .book import Group, WeightsFn


class BookView(Protocol):
    @property
    def started_at(self) -> float: ...

    @property
    def prices(self) -> Mapping[str, float | None]: ...

    @property
    def weights(self) -> WeightsFn: ...

    @property
    def total(self) -> Group: ...

    @property
    def backends(self) -> Mapping[str, Group]: ...

    @property
    def ranks(self) -> Mapping[str, Group]: ...  # data-parallel ranks, by unit name (`<backend>@<rank>`)

    @property
    def runtimes(self) -> Mapping[str, Group]: ...

    @property
    def arms(self) -> Mapping[tuple[str, str], Group]: ...

    @property
    def pairs(self) -> Mapping[tuple[str, str], Group]: ...  # by (route, `<prefill>><decode>`)

    @property
    def pair_legs(self) -> Mapping[tuple[str, str], Group]: ...  # ... each pair's leg times (`book.leg_sample`)

    @property
    def topologies(self) -> Mapping[tuple[str, str], Group]: ...  # by (route, `split` | `whole`)
