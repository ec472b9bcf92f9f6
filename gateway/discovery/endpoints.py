"""What a source finds (an address and a port), and the backend an entry makes of it. Pure values.

A source yields `frozenset[Endpoint]`: sets, so that duplicates (one pod in two EndpointSlices, one
address in two SRV records with the same port) collapse and comparing two answers is equality.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Any

from .config import DiscoveryEntry


@dataclass(frozen=True, slots=True, order=True)
class Endpoint:
    """One address and port. `address` is an IP address (or, from an FQDN EndpointSlice, a name)."""

    address: str
    port: int
    # what the object behind it says of itself (a pod's labels/annotations): "" and 0 when nothing
    role: str = ""  # prefill | decode | both
    bootstrap_port: int = 0  # an SGLang prefill's bootstrap server

    @property
    def authority(self) -> str:
        """`host:port` as in a URL: IPv6 addresses in brackets."""
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"{host}:{self.port}"

    @staticmethod
    def of(address: str, port: int, *, role: str = "", bootstrap_port: int = 0) -> Endpoint:
        """Normalise an IP address's spelling (`::0001` and `::1` are one endpoint); names stay as given."""
        try:
            address = str(ipaddress.ip_address(address))
        except ValueError:
            address = address.rstrip(".").lower()
        return Endpoint(address, port, role, bootstrap_port)


@dataclass(frozen=True, slots=True)
class DiscoveredBackend:
    """A backend found by discovery: its name and URL come from the endpoint, the rest from the entry."""

    source: str  # the entry's name, which routes use to mean all of its backends
    endpoint: Endpoint
    name: str  # <source>-<address>:<port>
    url: str  # http://<address>:<port>
    fields: dict[str, Any]  # every other `Backend` field, from the entry

    def settings(self) -> dict[str, Any]:
        """The mapping `gateway.settings.Backend.model_validate` takes for this backend."""
        return {"name": self.name, "url": self.url, **self.fields}


def discovered(entry: DiscoveryEntry, endpoint: Endpoint) -> DiscoveredBackend:
    fields: dict[str, Any] = {"runtime": entry.runtime, "model": entry.model, "chat_template": entry.chat_template}
    if entry.usd_per_hour is not None:
        fields["usd_per_hour"] = entry.usd_per_hour
    if entry.metrics_port is not None:
        fields["metrics_url"] = f"http://{Endpoint(endpoint.address, entry.metrics_port).authority}"
    if entry.api_key_env is not None:
        fields["api_key_env"] = entry.api_key_env
    if entry.api_key_file is not None:
        fields["api_key_file"] = entry.api_key_file
    if entry.data_parallel_size > 1:
        fields["data_parallel_size"] = entry.data_parallel_size
    if entry.dp_rank_field is not None:
        fields["dp_rank_field"] = entry.dp_rank_field
    role = endpoint.role or entry.role
    if role != "both":
        fields["role"] = role
    port = endpoint.bootstrap_port or entry.bootstrap_port
    if port and role != "decode":
        fields["bootstrap_port"] = port
    return DiscoveredBackend(
        source=entry.name,
        endpoint=endpoint,
        name=f"{entry.name}-{endpoint.authority}",
        url=f"http://{endpoint.authority}",
        fields=fields,
    )


def backends_of(entry: DiscoveryEntry, endpoints: frozenset[Endpoint]) -> list[DiscoveredBackend]:
    """The entry's backends for a set of endpoints, in a stable order (by address, then port)."""
    return [discovered(entry, e) for e in sorted(endpoints)]
