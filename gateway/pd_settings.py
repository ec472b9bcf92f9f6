"""The config rules of prefill/decode disaggregation: `backends[].role`, `bootstrap_port` and a
route's `disaggregation:` section, shared by static backends (`settings.Backend`), discovery
entries (`discovery.config.DiscoveryEntry`) and `settings.Settings`' cross-checks.

```yaml
backends:
  - {name: vllm-p0, runtime: vllm, url: ..., model: deepseek-v3, role: prefill}   # prefill | decode | both
  - {name: vllm-d0, runtime: vllm, url: ..., model: deepseek-v3, role: decode}
  - {name: sgl-p0, runtime: sglang, url: ..., role: prefill, bootstrap_port: 8998}
routes:
  - model: deepseek-v3
    backends: [vllm-p0, vllm-d0]
    disaggregation: {when: auto, min_uncached_tokens: 2048}    # always | never | auto
```

A `prefill` backend runs only first legs, a `decode` backend second legs and whole (aggregated)
requests, a `both` backend any of them; except on SGLang, whose modes are exclusive: a decode-mode
server refuses a request without a bootstrap room and a null-mode one (`both`) ignores the room, so
SGLang `prefill` and `decode` backends only pair and a `both` one only serves requests whole (a
route that keeps some whole, `when: auto|never`, needs one). A disaggregated route's requests are
served by one runtime's protocol (vLLM's kv_transfer_params, SGLang's bootstrap rendezvous,
trtllm-serve's context and generation legs), so its backends share a runtime; Triton has none.

Imports nothing of the gateway, so `settings` and `discovery.config` can both use it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Final, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

from backends.base import Runtime

BackendRole = Literal["prefill", "decode", "both"]
PREFILL_ROLES: Final = frozenset({"prefill", "both"})
DECODE_ROLES: Final = frozenset({"decode", "both"})
SGLANG_BOOTSTRAP_PORT: Final = 8998  # SGLang's default `--disaggregation-bootstrap-port`


class Disaggregation(BaseModel):
    """When a route's requests are split into a prefill leg and a decode leg.

    - `when`: `always` (every generation request, when a prefill and a decode backend are healthy),
      `never` (the section is kept, nothing is split: prefill-only backends idle), or `auto`: split
      only when the prompt's predicted uncached tokens on the chosen decode backend reach
      `min_uncached_tokens` and the decode pool is not saturated (`routing.disaggregation`).
    - `handoff` (vLLM): how the KV cache reaches the decode. `params` (NixlConnector, P2pNccl,
      Mooncake, ...): the prefill's answer carries `kv_transfer_params`, relayed to the decode leg; an
      answer without usable params is a failed handoff (the decode then recomputes the prefill: the
      pair's figures count it as failed). `storage` (ExampleConnector, LMCache's shared storage, ...):
      the decode finds the KV by prompt and vLLM's answer says `kv_transfer_params: null`, as expected.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    when: Literal["always", "never", "auto"] = "always"
    min_uncached_tokens: Annotated[int, Field(ge=0)] = 2048
    handoff: Literal["params", "storage"] = "params"

    @model_validator(mode="after")
    def _threshold_with_auto(self) -> Disaggregation:
        if "min_uncached_tokens" in self.model_fields_set and self.when != "auto":
            raise ValueError("min_uncached_tokens: only with `when: auto`")
        return self


class _Roled(Protocol):
    @property
    def runtime(self) -> Runtime: ...

    @property
    def role(self) -> str: ...

    @property
    def bootstrap_port(self) -> int | None: ...


class _Named(_Roled, Protocol):
    @property
    def name(self) -> str: ...


class _Pool(_Named, Protocol):
    @property
    def kind(self) -> str: ...


class _Route(Protocol):
    @property
    def model(self) -> str: ...

    @property
    def kind(self) -> str: ...

    @property
    def disaggregation(self) -> Disaggregation | None: ...

    @property
    def candidates(self) -> list[str]: ...


def check_pd_backend(backend: _Roled) -> None:
    """Raise ValueError (naming the field) when a backend's role cannot be served by its runtime."""
    if backend.role != "both" and backend.runtime is Runtime.TRITON:
        raise ValueError("role: Triton has no disaggregated serving; give `both`")
    if backend.bootstrap_port is not None:
        if backend.runtime is not Runtime.SGLANG:
            raise ValueError("bootstrap_port: only SGLang prefill servers have a bootstrap server")
        if backend.role == "decode":
            raise ValueError("bootstrap_port: a decode backend has no bootstrap server (the prefill's is used)")


def bootstrap_port(backend: _Roled) -> int:
    """Where an SGLang prefill server's bootstrap server listens."""
    return backend.bootstrap_port if backend.bootstrap_port is not None else SGLANG_BOOTSTRAP_PORT


def check_pd_routes(routes: Sequence[_Route], backends: Sequence[_Named], pools: Sequence[_Pool]) -> None:
    """The cross-checks of roles and routes: a disaggregated route (or A/B arm: an arm's own
    `disaggregation` replaces its route's) can pair a prefill with a decode of one runtime; one
    that does not disaggregate has no prefill-only backend. A Kubernetes pool whose pods may say
    their role (labels) counts as any role here."""
    static = {b.name: b for b in backends}
    discovered = {p.name: p for p in pools}
    for i, route in enumerate(routes):
        split = getattr(route, "split", None)
        if split is None:
            scopes = [(f"routes.{i}", route.candidates, route.disaggregation)]
        else:
            scopes = [(f"routes.{i}.split.arms.{j}", list(arm.backends), arm.disaggregation or route.disaggregation)
                      for j, arm in enumerate(split.arms)]
        for where, names, spec in scopes:
            members = [static.get(n) or discovered[n] for n in names if n in static or n in discovered]
            _check_scope(where, route.kind, names, members, spec)


def _check_scope(where: str, kind: str, names: list[str], members: list[_Named], spec: Disaggregation | None) -> None:
    if spec is None:
        prefill_only = [m.name for m in members if m.role == "prefill"]
        if prefill_only:
            raise ValueError(f"{where}.backends: {prefill_only} have `role: prefill` and can serve only "
                             "a prefill leg; give the route a `disaggregation:` section")
        return
    if kind != "generate":
        raise ValueError(f"{where}.disaggregation: only generate routes have a prefill to split off")
    runtimes = sorted({m.runtime.value for m in members})
    if len(runtimes) > 1:
        raise ValueError(f"{where}.disaggregation: its backends run {runtimes}; a prefill and a decode "
                         "speak one runtime's protocol (one runtime per disaggregated route)")
    if runtimes == [Runtime.TRITON.value]:
        raise ValueError(f"{where}.disaggregation: Triton has no disaggregated serving")
    if spec.handoff == "storage" and runtimes != [Runtime.VLLM.value]:
        raise ValueError(f"{where}.disaggregation.handoff: `storage` is vLLM's (a shared-storage KV connector)")
    any_role = {m.name for m in members if getattr(m, "kind", None) == "kubernetes"}
    if spec.when != "always" and runtimes == [Runtime.SGLANG.value] and not any_role \
            and not any(m.role == "both" for m in members):
        raise ValueError(f"{where}.disaggregation.when: `{spec.when}` keeps requests whole, and a decode-mode "
                         "SGLang server refuses a request without a bootstrap room: add a `role: both` server "
                         "(SGLang's `--disaggregation-mode null`) or give `when: always`")
    if spec.when == "never":
        return
    prefill = {m.name for m in members if m.role in PREFILL_ROLES} | any_role
    decode = {m.name for m in members if m.role in DECODE_ROLES} | any_role
    if not prefill:
        raise ValueError(f"{where}.disaggregation: no prefill backend among {names} "
                         "(give one `role: prefill` or `both`)")
    if not decode:
        raise ValueError(f"{where}.disaggregation: no decode backend among {names} "
                         "(give one `role: decode` or `both`)")
    if len(prefill | decode) < 2 and not any_role:
        raise ValueError(f"{where}.disaggregation: a prefill and a decode must be two servers; {names} has one")
