"""The YAML configuration, validated by pydantic: frozen, unknown keys rejected, errors name the field."""

from __future__ import annotations

import re
from functools import cached_property
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, HttpUrl, ValidationError, field_validator, model_validator

from backends.base import Runtime
from backends.capabilities import EMBEDDING_DEFAULTS, POSSIBLE, Feature

from .discovery.config import DiscoveryEntry, duplicate_entry_names
from .pd_settings import BackendRole, Disaggregation, check_pd_backend, check_pd_routes
from .rank_settings import MAX_RANKS, check_ranks, kv_ranks_default

PolicyName = Literal["round_robin", "least_load", "prefix_affinity", "sla", "cost"]
_NAME = r"^[A-Za-z0-9_.:-]+$"
_DIGEST = re.compile(r"^(sha256:)?([0-9a-f]{64})$")


def parse_digest(value: str, *, prefixed: bool = True) -> str:
    """Normalise a `sha256:<hex>` digest to lowercase `sha256:<hex>`; a plain secret is refused so
    that no config file ever holds a client key in clear (use `gateway hash-key`)."""
    match = _DIGEST.match(value.strip().lower())
    if match is None or (prefixed and match.group(1) is None):
        raise ValueError("must be a SHA-256 digest `sha256:<64 hex>`, not a plain key (see `gateway hash-key`)")
    return "sha256:" + match.group(2)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Listen(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 8080
    # When set, /metrics is served only there (not on `port`), e.g. on an internal interface.
    metrics_port: Annotated[int, Field(ge=0, le=65535)] | None = None
    # Accept queue length: a burst of new connections beyond it is dropped by the kernel (aiohttp's
    # default of 128 overflowed with 1,000 streams opening per second in bench/overhead.py).
    backlog: Annotated[int, Field(ge=1)] = 4096
    # Who parses the generation requests: the native httptools front (default, a fraction of the
    # CPU per request) or aiohttp's server, which serves every other path in both modes.
    front: Literal["native", "aiohttp"] = "native"
    # One line per finished request on the `gateway.access` logger (with its trace id when tracing is on).
    access_log: bool = False


class PickerListen(_Strict):
    host: str = "127.0.0.1"
    port: Annotated[int, Field(ge=0, le=65535)] = 9002  # GIE's conventional Endpoint Picker port


class EndpointPicker(_Strict):
    """The gateway as an Endpoint Picker for Envoy (Envoy's ext_proc over gRPC; `gateway.picker`),
    beside the HTTP front, which keeps serving generation requests, `/metrics` and the admin API."""

    listen: PickerListen = PickerListen()


class KvEvents(_Strict):
    """Where a backend's engine publishes its KV-cache events (see docs/kv-events.md).

    vLLM and SGLang: a ZMQ PUB socket. By default the engine binds it (`--kv-events-config`
    endpoint `tcp://*:5557`) and the gateway connects to `endpoint` (`tcp://engine-host:5557`);
    any number of gateway replicas can subscribe. With `bind: true` the gateway binds `endpoint`
    and the engine connects to it (an engine given a concrete address connects): one process
    binds it (under `--workers N`, the supervisor, which relays to its workers). trtllm-serve:
    events are polled from the backend's `POST /kv_cache_events` (no endpoint; that queue is
    drained: one poller per host, the supervisor under `--workers N`).
    """

    endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc|inproc)://.+")] | None = None
    topic: str = ""
    bind: bool = False
    # the engine's replay ROUTER socket (`replay_endpoint`), to fill sequence gaps without a rebuild
    replay_endpoint: Annotated[str, Field(pattern=r"^(tcp|ipc|inproc)://.+")] | None = None
    # data-parallel ranks publish on endpoint port + rank (vLLM's and SGLang's convention); default:
    # the backend's `data_parallel_size`
    data_parallel_size: Annotated[int, Field(ge=1, le=64)] = 1
    # no batch this long after a response showed the engine stored blocks: the source is silent (reported)
    silent_after_s: Annotated[float, Field(gt=0)] = 5.0
class Capabilities(_Strict):
    """Overrides of what the backend's runtime serves by default (`backends.capabilities`): `true`
    adds a feature (e.g. `stored_responses` for vLLM started with VLLM_ENABLE_RESPONSES_API_STORE=1),
    `false` removes one (e.g. `tools` for a vLLM started without a tool-call parser)."""

    chat: bool | None = None
    completions: bool | None = None
    responses: bool | None = None
    stored_responses: bool | None = None
    embeddings: bool | None = None
    tokenize: bool | None = None
    tools: bool | None = None
    response_format: bool | None = None
    logprobs: bool | None = None
    n: bool | None = None
    images: bool | None = None
    audio: bool | None = None

    def overrides(self) -> dict[Feature, bool]:
        return {Feature(k): v for k, v in self.model_dump().items() if v is not None}


class Backend(_Strict):
    # `[` `]` and the length are for discovered backends, named `<entry>-<address>:<port>` with IPv6
    # addresses in brackets (an entry name of 40 and `-[` 39 `]:65535`).
    name: Annotated[str, Field(min_length=1, max_length=96, pattern=r"^[A-Za-z0-9_.:\[\]-]+$")]
    runtime: Runtime
    url: HttpUrl
    model: Annotated[str, Field(min_length=1)]
    usd_per_hour: Annotated[float, Field(ge=0)] | None = None
    # Triton only: where Prometheus metrics are served (Triton uses a separate port, 8002 by default).
    metrics_url: HttpUrl | None = None
    # Triton only: how chat messages are rendered into `text_input`.
    chat_template: Literal["chatml", "llama3", "plain"] = "chatml"
    # Upstream credential, sent only to this backend as `Authorization: Bearer ...`: the name of an
    # environment variable, or a file holding the key. The key itself never appears in the config.
    api_key_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = None
    api_key_file: Path | None = None
    # The engine's KV-cache events: routing then knows exactly what it caches (see `KvEvents`).
    kv_events: KvEvents | None = None
    # How the engine tokenizes (a directory with tokenizer.json, a Hugging Face name in the local
    # cache, or `emulator`); overrides the route's `tokenizer`.
    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    # Overrides of the runtime's default capabilities (what requests this backend may be sent).
    capabilities: Capabilities = Capabilities()
    # The model's context length, when the backend's own /v1/models does not report it (Triton).
    max_model_len: Annotated[int, Field(ge=1)] | None = None
    # One server with this many data-parallel (attention-DP) ranks: each rank is a routing unit and
    # every request is pinned to one (`gateway/ranks.py`); 1 is never pinned.
    data_parallel_size: Annotated[int, Field(ge=1, le=MAX_RANKS)] = 1
    # SGLang only: the body field that pins a rank (`data_parallel_rank` before SGLang's rename, PR #19268)
    dp_rank_field: Literal["routed_dp_rank", "data_parallel_rank"] | None = None
    # Prefill/decode disaggregation (`pd_settings`): which legs this server may run (`both`: either,
    # or a whole request); SGLang prefill servers: their `--disaggregation-bootstrap-port`.
    role: BackendRole = "both"
    bootstrap_port: Annotated[int, Field(ge=1, le=65535)] | None = None

    @model_validator(mode="after")
    def _role_fits_the_runtime(self) -> Backend:
        check_pd_backend(self)
        return self

    @model_validator(mode="before")
    @classmethod
    def _kv_ranks_default(cls, data: object) -> object:
        return kv_ranks_default(data)

    @model_validator(mode="after")
    def _ranks_fit_the_runtime(self) -> Backend:
        check_ranks(self)
        return self

    @model_validator(mode="after")
    def _possible_capabilities(self) -> Backend:
        impossible = [f for f, on in self.capabilities.overrides().items() if on and f not in POSSIBLE[self.runtime]]
        if impossible:
            raise ValueError(f"capabilities.{impossible[0]}: the {self.runtime} adapter cannot serve it")
        return self

    @model_validator(mode="after")
    def _one_key_source(self) -> Backend:
        if self.api_key_env is not None and self.api_key_file is not None:
            raise ValueError("give at most one of `api_key_env` and `api_key_file`")
        if (self.api_key_env or self.api_key_file) and (self.url.username or self.url.password):
            raise ValueError("url: credentials in the URL cannot be combined with an api_key")
        return self

    @model_validator(mode="after")
    def _kv_events_fit_the_runtime(self) -> Backend:
        kv = self.kv_events
        if kv is None:
            return self
        if self.runtime is Runtime.TRITON:
            raise ValueError("kv_events: Triton publishes no KV-cache events")
        if self.runtime is Runtime.TRTLLM:
            if kv.endpoint is not None or kv.replay_endpoint is not None or kv.bind:
                raise ValueError("kv_events: trtllm-serve events are polled from the backend's /kv_cache_events; "
                                 "give no endpoint")
        elif kv.endpoint is None:
            raise ValueError("kv_events.endpoint: required for vLLM and SGLang (their ZMQ publisher)")
        return self

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")


class Arm(_Strict):
    """One arm of an A/B split: a weighted share of the route's sessions and the backends that serve it."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)]
    weight: Annotated[float, Field(ge=0)]
    backends: Annotated[list[str], Field(min_length=1)]
    # the arm's own P/D topology, in place of its route's (`{when: never}`: an aggregated arm against
    # a disaggregated one on the same model); None: the route's
    disaggregation: Disaggregation | None = None


class Shadow(_Strict):
    """Mirror a sampled fraction of the route's requests to `arm` and discard the answers."""

    arm: str
    fraction: Annotated[float, Field(ge=0, le=1)]


class Split(_Strict):
    arms: Annotated[list[Arm], Field(min_length=2)]
    salt: str | None = None  # hash salt for sticky assignment; default: the route's model name
    # What keeps a client on one arm: `session` (x-session-id, else the body's `user`; a request with
    # neither is assigned at random by weight), or `api_key` (those, else the client's API key).
    sticky: Literal["session", "api_key"] = "session"
    shadow: Shadow | None = None

    @model_validator(mode="after")
    def _arms_are_usable(self) -> Split:
        names = [a.name for a in self.arms]
        if len(set(names)) != len(names):
            raise ValueError("split.arms: arm names must be unique")
        if sum(a.weight for a in self.arms) <= 0:
            raise ValueError("split.arms: at least one arm needs a positive weight")
        if self.shadow is not None and self.shadow.arm not in names:
            raise ValueError(f"split.shadow.arm: unknown arm {self.shadow.arm!r}")
        return self


class Route(_Strict):
    model: Annotated[str, Field(min_length=1)]
    # What the route's model is: `generate` (chat, completions, Responses, tokenize) or `embeddings`
    # (an embedding model: /v1/embeddings and tokenize). A backend serves routes of one kind only.
    kind: Literal["generate", "embeddings"] = "generate"
    backends: Annotated[list[str], Field(min_length=1)] | None = None
    policy: PolicyName = "least_load"
    split: Split | None = None
    # How the route's engines tokenize (see `Backend.tokenizer`): with it, routing predicts cached
    # tokens exactly from the engines' KV events; without it the approximate index routes.
    tokenizer: Annotated[str, Field(min_length=1)] | None = None
    # Prefill/decode disaggregation of the route's requests (`pd_settings.Disaggregation`); None: off
    disaggregation: Disaggregation | None = None
    # prefix_affinity's balance knob: no backend is chosen above `load_factor` x the mean load + 2
    # (bounded-load consistent hashing); higher keeps more prefixes where they are cached (reuse),
    # lower spreads them sooner (balance, tail). None: the policy's default (README, *Routing*).
    load_factor: Annotated[float, Field(ge=1.0, le=10.0)] | None = None

    @model_validator(mode="after")
    def _backends_or_split(self) -> Route:
        if (self.backends is None) == (self.split is None):
            raise ValueError("a route needs exactly one of `backends` or `split`")
        if self.load_factor is not None and self.policy != "prefix_affinity":
            raise ValueError("`load_factor` applies to `policy: prefix_affinity` only")
        return self

    @cached_property
    def disaggregates(self) -> bool:
        """Whether some of its requests may be split into prefill and decode legs (its own
        `disaggregation`, or an A/B arm's)."""
        return self.disaggregation is not None or (
            self.split is not None and any(a.disaggregation is not None for a in self.split.arms))

    @cached_property
    def candidates(self) -> list[str]:
        """Every backend the route may use (all arms' backends for a split route), in config order.
        Computed once (the request path asks on every request); do not modify."""
        if self.backends is not None:
            return list(self.backends)
        assert self.split is not None
        seen: dict[str, None] = {}
        for arm in self.split.arms:
            seen.update(dict.fromkeys(arm.backends))
        return list(seen)


class Timeouts(_Strict):
    connect_s: Annotated[float, Field(gt=0)] = 3.0
    first_token_s: Annotated[float, Field(gt=0)] = 60.0
    total_s: Annotated[float, Field(gt=0)] = 600.0


class Retries(_Strict):
    max_attempts: Annotated[int, Field(ge=1, le=10)] = 3


class Health(_Strict):
    """Health probes and outlier ejection (see `state.outliers` for the rule)."""

    interval_s: Annotated[float, Field(gt=0)] = 1.0
    failure_threshold: Annotated[int, Field(ge=1)] = 5  # consecutive failed requests that eject a backend
    failure_rate: Annotated[float, Field(gt=0, le=1)] = 0.5  # ... or this share of failures in the window
    window_s: Annotated[float, Field(gt=0)] = 30.0
    min_requests: Annotated[int, Field(ge=1)] = 10  # judged requests in the window before the rate counts
    cooldown_s: Annotated[float, Field(gt=0)] = 5.0  # the first ejection's length; the n-th lasts n times it
    max_ejection_s: Annotated[float, Field(gt=0)] = 300.0
    max_ejected_share: Annotated[float, Field(gt=0, le=1)] = 0.5  # of each route's and arm's backends (never its last)


class Limits(_Strict):
    max_body_bytes: Annotated[int, Field(ge=1024)] = 8 * 1024 * 1024
    max_header_bytes: Annotated[int, Field(ge=1024, le=1024 * 1024)] = 8190  # one request/header line
    # the whole head: request line and every header line, CRLFs included (many small headers)
    max_header_section_bytes: Annotated[int, Field(ge=1024, le=4 * 1024 * 1024)] = 32768
    header_timeout_s: Annotated[float, Field(gt=0)] = 10.0  # until a request's headers are complete
    body_timeout_s: Annotated[float, Field(gt=0)] = 30.0  # until its body is complete
    drain_timeout_s: Annotated[float, Field(ge=0)] = 30.0  # SIGTERM: how long in-flight requests may finish


class ApiKey(_Strict):
    """One client key: its digest, what it may use and how fast."""

    id: Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)]  # metrics label, never the key
    key: str  # `sha256:<hex>` of the key the client sends as `Authorization: Bearer <key>`
    models: list[str] | None = None  # route models this key may use; None = all
    requests_per_minute: Annotated[int, Field(ge=1)] | None = None
    tokens_per_minute: Annotated[int, Field(ge=1)] | None = None

    @field_validator("key")
    @classmethod
    def _hashed(cls, value: str) -> str:
        return parse_digest(value)


class Auth(_Strict):
    api_keys: list[ApiKey] = []
    api_keys_file: Path | None = None  # YAML list of the same entries, re-read on reload
    admin_token_sha256: str | None = None  # digest of the token /admin/* and /dashboard require
    admin_token_file: Path | None = None  # a file holding that digest (or the plain token, for secret mounts)

    @field_validator("admin_token_sha256")
    @classmethod
    def _admin_hashed(cls, value: str | None) -> str | None:
        return None if value is None else parse_digest(value, prefixed=False)

    @model_validator(mode="after")
    def _one_admin_source(self) -> Auth:
        if self.admin_token_sha256 is not None and self.admin_token_file is not None:
            raise ValueError("give at most one of `admin_token_sha256` and `admin_token_file`")
        ids = [k.id for k in self.api_keys]
        dupes = sorted({i for i in ids if ids.count(i) > 1})
        if dupes:
            raise ValueError(f"api_keys: duplicate key ids {dupes}")
        return self


class State(_Strict):
    """The store that several gateway replicas share (see `gateway/state/store.py`). Without it, a
    replica shares nothing with other replicas; its workers still share everything through their
    supervisor."""

    redis_url: Annotated[str, Field(pattern=r"^(redis|rediss|unix)://")]
    key_prefix: Annotated[str, Field(min_length=1, max_length=64, pattern=_NAME)] = "igw"
    # This replica's name in the fleet view (`/admin/compare?scope=fleet`); default: host-pid.
    replica_id: Annotated[str, Field(min_length=1, max_length=128, pattern=_NAME)] | None = None
    timeout_s: Annotated[float, Field(gt=0, le=10)] = 0.25  # per Redis command; past it: local state
    connect_timeout_s: Annotated[float, Field(gt=0, le=30)] = 1.0  # opening a connection (TCP + handshake)
    publish_interval_s: Annotated[float, Field(gt=0, le=60)] = 2.0  # window data for the fleet view
    sync_interval_s: Annotated[float, Field(gt=0, le=10)] = 0.2  # how often shared weights are read


class Tracing(_Strict):
    """OpenTelemetry traces (`gateway/tracing`): off when the section is absent, unless the standard
    `OTEL_*` variables turn them on; where those are set they win over these keys."""

    # gRPC: `host:port` or `http://host:port`; http/protobuf: the URL (`/v1/traces` added when it has no path).
    # Default: the OTLP defaults, localhost:4317 (gRPC) or http://localhost:4318/v1/traces.
    otlp_endpoint: Annotated[str, Field(min_length=1)] | None = None
    protocol: Literal["grpc", "http/protobuf"] = "grpc"
    sample_ratio: Annotated[float, Field(ge=0, le=1)] = 1.0  # of requests without a sampled parent
    service_name: Annotated[str, Field(min_length=1)] = "inference-gateway"
    headers: dict[str, str] = {}  # sent with every export (e.g. a collector's API key)


class Settings(_Strict):
    listen: Listen = Listen()
    backends: list[Backend] = []  # static backends; may be empty when `discovery` finds them
    discovery: list[DiscoveryEntry] = []  # pools of backends found in DNS or Kubernetes (gateway.discovery)
    routes: Annotated[list[Route], Field(min_length=1)]
    timeouts: Timeouts = Timeouts()
    retries: Retries = Retries()
    health: Health = Health()
    limits: Limits = Limits()
    auth: Auth = Auth()
    state: State | None = None
    tracing: Tracing | None = None
    endpoint_picker: EndpointPicker | None = None

    @model_validator(mode="after")
    def _references_resolve(self) -> Settings:
        names = [b.name for b in self.backends]
        if not names and not self.discovery:
            raise ValueError("give `backends`, `discovery` or both: there is nothing to route to")
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"backends: duplicate backend names {dupes}")
        clashes = duplicate_entry_names(self.discovery, names)
        if clashes:
            raise ValueError(f"discovery: names used twice, or by a static backend: {clashes}")
        models = [r.model for r in self.routes]
        dupe_models = sorted({m for m in models if models.count(m) > 1})
        if dupe_models:
            raise ValueError(f"routes: duplicate route models {dupe_models}")
        known = set(names) | {e.name for e in self.discovery}  # a discovery name stands for all its backends
        for i, route in enumerate(self.routes):
            missing = [b for b in route.candidates if b not in known]
            if missing:
                where = "backends" if route.split is None else "split.arms"
                raise ValueError(f"routes.{i}.{where}: unknown backend(s) or discovery pool(s) {missing}")
        runtimes = {b.name: b.runtime for b in self.backends} | {e.name: e.runtime for e in self.discovery}
        kinds: dict[str, str] = {}
        for i, route in enumerate(self.routes):
            for name in route.candidates:  # backends and discovery pools alike
                if kinds.setdefault(name, route.kind) != route.kind:
                    raise ValueError(f"routes.{i}.kind: backend {name!r} is also in a {kinds[name]} route "
                                     "(a backend serves one model, of one kind)")
                runtime = runtimes[name]
                if route.kind == "embeddings" and not EMBEDDING_DEFAULTS[runtime]:
                    raise ValueError(f"routes.{i}.kind: backend {name!r} ({runtime}) cannot serve embeddings")
        by_name = {b.name: b for b in self.backends}
        for i, route in enumerate(self.routes):
            # discovery pools' members tokenize as the route says
            specs = {(by_name[b].tokenizer if b in by_name else None) or route.tokenizer for b in route.candidates}
            if len(specs) > 1:
                raise ValueError(f"routes.{i}: its backends tokenize differently ({sorted(map(str, specs))}); "
                                 "one tokenizer per route")
        check_pd_routes(self.routes, self.backends, self.discovery)
        for i, key in enumerate(self.auth.api_keys):
            unknown = sorted(set(key.models or ()) - set(models))
            if unknown:
                raise ValueError(f"auth.api_keys.{i}.models: unknown route model(s) {unknown}")
        return self

    def backend(self, name: str) -> Backend:
        return next(b for b in self.backends if b.name == name)

    def route_tokenizer(self, route: Route) -> str | None:
        """The tokenizer spec a route's requests are tokenized with (validated: one per route)."""
        by_name = {b.name: b for b in self.backends}
        for name in route.candidates:
            backend = by_name.get(name)  # None: a discovery pool
            if backend is not None and backend.tokenizer is not None:
                return backend.tokenizer
        return route.tokenizer

    @cached_property
    def embedding_backends(self) -> frozenset[str]:
        """The backends (and discovery pools) of `embeddings` routes: their figures are kept apart."""
        return frozenset(n for r in self.routes if r.kind == "embeddings" for n in r.candidates)


class ConfigError(Exception):
    """A config file that cannot be used; `errors` lists one line per problem, with its field path."""

    def __init__(self, source: str, errors: list[str]) -> None:
        super().__init__(f"{source}: " + "; ".join(errors))
        self.source = source
        self.errors = errors


def format_validation_error(exc: ValidationError) -> list[str]:
    lines = []
    for err in exc.errors():
        path = ".".join(str(p) for p in err["loc"]) or "<root>"
        lines.append(f"{path}: {err['msg']}")
    return lines


def parse_settings(data: object, *, source: str = "<config>") -> Settings:
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, format_validation_error(exc)) from exc


def load_settings(path: str | Path) -> Settings:
    return settings_from_yaml(Path(path).read_text(encoding="utf-8"), source=str(path))


def settings_from_yaml(text: str, *, source: str = "<config>") -> Settings:
    """A config file's text, parsed and validated (what a supervisor hands its workers is text)."""
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"<yaml>: {exc}"]) from exc
    return parse_settings(data, source=source)
