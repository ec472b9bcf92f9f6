"""The `discovery:` section of the config: one entry per discovered pool, validated by pydantic.

Frozen, unknown keys rejected, errors name the field (as in gateway/settings.py). Mounted as
`discovery: list[DiscoveryEntry] = []` on `Settings`, which uses `duplicate_entry_names` for the
cross-checks it does for static backends (entry names are what routes refer to).

```yaml
discovery:
  - name: vllm-pool                 # backends are named <name>-<address>:<port>
    runtime: vllm
    model: deepseek-v3
    usd_per_hour: 96
    remember_s: 3600                # a backend that left and comes back within an hour gets its history back
    dns: {host: vllm-headless.llm.svc.cluster.local, port: 8000, interval_s: 5,
          leave_after_answers: 3, leave_after_s: 60}   # an address leaves once missing that long
  - name: sglang-pool
    runtime: sglang
    model: deepseek-v3
    kubernetes: {namespace: llm, label_selector: "app=sglang", port: 30000}
```

Two changes from the shape first sketched in issue 15, both for clarity: `interval_s` and
`resolver` live inside the `dns:` block (they mean nothing to a Kubernetes watch, which has no
interval), and Triton's separate metrics endpoint is `metrics_port` (a per-pool `metrics_url` cannot
name each discovered address).
"""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from backends.base import Runtime

from ..pd_settings import BackendRole, check_pd_backend
from ..rank_settings import MAX_RANKS, check_ranks
from .hysteresis import LITERAL, Hold

Port = Annotated[int, Field(ge=1, le=65535)]
# `-` and `:` join the entry name to each address, so an entry name may use neither `:` nor `[]`.
_ENTRY_NAME = r"^[A-Za-z0-9_.-]+$"
# An RFC 1123 label per Kubernetes object names and IANA service names (EndpointSlice port names).
_K8S_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def parse_nameserver(value: str) -> tuple[str, int]:
    """`10.0.0.10`, `127.0.0.1:5353`, `::1` or `[::1]:5353` -> (address, port); port 53 by default."""
    text = value.strip()
    host, port = text, 53
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ValueError("write an IPv6 nameserver as `[addr]:port` or a bare address")
        if rest:
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
        port = int(port_text)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{value!r}: the nameserver must be an IP address (optionally with :port)") from None
    if not 1 <= port <= 65535:
        raise ValueError(f"{value!r}: port out of range")
    return host, port


class DnsDiscovery(_Strict):
    """A/AAAA records of `host` (every address, on `port`), or SRV records of `srv` (host and port
    per record, then A/AAAA of each target); re-resolved every `interval_s`."""

    host: Annotated[str, Field(min_length=1, max_length=253)] | None = None
    port: Port | None = None  # with `host`; an SRV record carries its own port
    srv: Annotated[str, Field(min_length=1, max_length=253)] | None = None  # e.g. _http._tcp.vllm.llm.svc
    resolver: str | None = None  # nameserver `addr[:port]`; default: the system's (/etc/resolv.conf)
    interval_s: Annotated[float, Field(gt=0)] = 5.0
    timeout_s: Annotated[float, Field(gt=0)] = 2.0  # one resolution, all queries and retries included
    # An address leaves once missing from this many answers in a row and for this long since an answer
    # last named it (hysteresis.py): answers that name a subset of the records (Route 53 multivalue,
    # capped or rotating answers) drain nothing. 1 and 0: every answer is the whole set.
    leave_after_answers: Annotated[int, Field(ge=1)] = 3
    leave_after_s: Annotated[float, Field(ge=0)] = 60.0

    @field_validator("resolver")
    @classmethod
    def _resolver_is_an_address(cls, value: str | None) -> str | None:
        if value is not None:
            parse_nameserver(value)
        return value

    @model_validator(mode="after")
    def _host_or_srv(self) -> DnsDiscovery:
        if (self.host is None) == (self.srv is None):
            raise ValueError("give exactly one of `host` (A/AAAA records) and `srv` (SRV records)")
        if self.host is not None and self.port is None:
            raise ValueError("port: required with `host` (A/AAAA records carry no port)")
        if self.srv is not None and self.port is not None:
            raise ValueError("port: not allowed with `srv` (each SRV record carries its port)")
        return self

    @property
    def nameserver(self) -> tuple[str, int] | None:
        return None if self.resolver is None else parse_nameserver(self.resolver)

    @property
    def hold(self) -> Hold:
        return Hold(answers=self.leave_after_answers, seconds=self.leave_after_s)


class KubernetesDiscovery(_Strict):
    """Ready endpoints of a Service's EndpointSlices (`service`), or Ready pods matching
    `label_selector`; listed, then watched."""

    namespace: Annotated[str, Field(pattern=_K8S_NAME, max_length=63)] | None = None  # default: see below
    service: Annotated[str, Field(pattern=_K8S_NAME, max_length=63)] | None = None
    label_selector: Annotated[str, Field(min_length=1)] | None = None
    # With `service`: the EndpointSlice port's name or number (may be omitted when the slices have one
    # port). With `label_selector`: the port number on each pod (required).
    port: Port | Annotated[str, Field(pattern=_K8S_NAME, max_length=63)] | None = None
    kubeconfig: Path | None = None  # default: the in-cluster service account
    context: Annotated[str, Field(min_length=1)] | None = None  # a kubeconfig context; default: current

    @model_validator(mode="after")
    def _service_or_selector(self) -> KubernetesDiscovery:
        if (self.service is None) == (self.label_selector is None):
            raise ValueError("give exactly one of `service` (EndpointSlices) and `label_selector` (pods)")
        if self.label_selector is not None and not isinstance(self.port, int):
            raise ValueError("port: a port number is required with `label_selector`")
        if self.context is not None and self.kubeconfig is None:
            raise ValueError("context: only with `kubeconfig`")
        return self


class DiscoveryEntry(_Strict):
    """One discovered pool: where its addresses come from, and what every backend in it is.

    A discovered backend gets every per-backend field a static `backends:` entry has except `name`
    and `url`, which come from the address: `<name>-<address>:<port>` and `http://<address>:<port>`
    (IPv6 addresses in brackets in both).
    """

    # 40 leaves room for `-255.255.255.255:65535` within a backend name's 64 characters.
    name: Annotated[str, Field(min_length=1, max_length=40, pattern=_ENTRY_NAME)]
    runtime: Runtime
    model: Annotated[str, Field(min_length=1)]
    usd_per_hour: Annotated[float, Field(ge=0)] | None = None  # per discovered backend
    metrics_port: Port | None = None  # Triton only: metrics on another port of the same address
    chat_template: Literal["chatml", "llama3", "plain"] = "chatml"  # Triton only
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    api_key_file: Path | None = None
    # A backend that left (drained, then removed) keeps its live-comparison history and routing memory
    # this long: if its address comes back meanwhile, it gets them back (a pod that flapped Ready, an
    # address a DNS answer left out for longer than the hold). 0: forgotten when it leaves.
    remember_s: Annotated[float, Field(ge=0)] = 3600.0
    dns: DnsDiscovery | None = None
    kubernetes: KubernetesDiscovery | None = None
    # every discovered backend is one server with this many data-parallel ranks (`Backend.data_parallel_size`)
    data_parallel_size: Annotated[int, Field(ge=1, le=MAX_RANKS)] = 1
    dp_rank_field: Literal["routed_dp_rank", "data_parallel_rank"] | None = None  # SGLang only
    # every discovered backend's P/D role and SGLang bootstrap port (`Backend.role`); pods found by
    # `kubernetes.label_selector` may say their own (`kubernetes_objects.POD_ROLE_KEYS`)
    role: BackendRole = "both"
    bootstrap_port: Port | None = None

    @model_validator(mode="after")
    def _one_source(self) -> DiscoveryEntry:
        if (self.dns is None) == (self.kubernetes is None):
            raise ValueError("give exactly one of `dns` and `kubernetes`")
        check_ranks(self)
        check_pd_backend(self)
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give at most one of `api_key_env` and `api_key_file`")
        return self

    @property
    def kind(self) -> Literal["dns", "kubernetes"]:
        return "dns" if self.dns is not None else "kubernetes"

    @property
    def hold(self) -> Hold:
        """How long an endpoint its answers leave out stays: DNS answers may name a subset of the
        records; a Kubernetes list or watch always gives the whole set (a missing pod is a fact)."""
        return self.dns.hold if self.dns is not None else LITERAL


def duplicate_entry_names(entries: list[DiscoveryEntry], static_backends: list[str]) -> list[str]:
    """Names used twice among the entries, or by an entry and a static backend (sorted)."""
    names = [e.name for e in entries] + list(static_backends)
    return sorted({n for n in names if names.count(n) > 1})
