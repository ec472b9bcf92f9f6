"""What tracing runs with: the config's `tracing` section and the standard `OTEL_*` variables, which
win where they are set (pure: the environment comes in as a mapping).

Tracing is on when the section is present or a variable asks for it (an OTLP endpoint, or
`OTEL_TRACES_EXPORTER=otlp`), and off when neither does, or when `OTEL_SDK_DISABLED=true` or
`OTEL_TRACES_EXPORTER=none` say so whatever the config says. The variables read here:
`OTEL_SDK_DISABLED`, `OTEL_TRACES_EXPORTER`, `OTEL_SERVICE_NAME`, `OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT`,
`OTEL_EXPORTER_OTLP_[TRACES_]PROTOCOL`, `OTEL_EXPORTER_OTLP_[TRACES_]HEADERS`, `OTEL_TRACES_SAMPLER`
(and `_ARG`), `OTEL_BSP_SCHEDULE_DELAY`, `OTEL_BSP_MAX_QUEUE_SIZE`, `OTEL_BSP_MAX_EXPORT_BATCH_SIZE` and
`OTEL_SEMCONV_STABILITY_OPT_IN`; the SDK reads the others itself (`OTEL_RESOURCE_ATTRIBUTES`,
`OTEL_EXPORTER_OTLP_TIMEOUT`, compression, certificates).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final
from urllib.parse import unquote, urlsplit

from ..settings import Tracing
from .context import SAMPLERS, Sampler
from .semconv import Names

log = logging.getLogger(__name__)

GRPC: Final = "grpc"
HTTP: Final = "http/protobuf"
DEFAULT_GRPC: Final = "http://localhost:4317"
DEFAULT_HTTP: Final = "http://localhost:4318/v1/traces"
TRACES_PATH: Final = "/v1/traces"


@dataclass(frozen=True, slots=True)
class TraceConfig:
    endpoint: str  # gRPC: a URL whose scheme says whether TLS is used; HTTP: the full traces URL
    protocol: str  # grpc | http/protobuf
    sampler: Sampler
    service_name: str
    headers: Mapping[str, str] = field(default_factory=dict)
    names: Names = field(default_factory=lambda: Names(latest=False))
    # the export queue (spans waiting for the exporter; more are dropped and counted) and batching
    max_queue_spans: int = 2048
    max_batch_spans: int = 512
    schedule_delay_s: float = 5.0


def _true(value: str | None) -> bool:
    return value is not None and value.strip().lower() == "true"


def parse_headers(value: str) -> dict[str, str]:
    """`OTEL_EXPORTER_OTLP_HEADERS`: `key=value` pairs separated by commas, URL-encoded."""
    out: dict[str, str] = {}
    for item in value.split(","):
        key, sep, val = item.partition("=")
        if sep and key.strip():
            out[unquote(key.strip()).lower()] = unquote(val.strip())
    return out


def _endpoint(protocol: str, env: Mapping[str, str], configured: str | None) -> str:
    specific = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
    base = env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip()
    if protocol == HTTP:
        if specific:
            return specific
        if base:  # the base URL of every signal: the traces path is appended (OTLP exporter spec)
            return base.rstrip("/") + TRACES_PATH
        if configured:
            url = configured if "://" in configured else "http://" + configured
            return url if urlsplit(url).path not in ("", "/") else url.rstrip("/") + TRACES_PATH
        return DEFAULT_HTTP
    url = specific or base or configured or DEFAULT_GRPC
    return url if "://" in url else "http://" + url  # gRPC `host:port`: plain text, as the collectors' default


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if value <= 0:
        log.warning("%s=%s is not a positive number: using %g", name, raw, default)
        return default
    return value


def _sampler(env: Mapping[str, str], ratio: float) -> Sampler:
    name = env.get("OTEL_TRACES_SAMPLER", "").strip().lower()
    if not name:
        return Sampler(ratio, parent_based=True)
    known = SAMPLERS.get(name)
    if known is None:
        log.warning("OTEL_TRACES_SAMPLER=%s is not one this gateway supports (%s): using parentbased_traceidratio",
                    name, ", ".join(SAMPLERS))
        return Sampler(ratio, parent_based=True)
    fixed, parent_based = known
    if fixed is None:
        arg = env.get("OTEL_TRACES_SAMPLER_ARG")
        if arg is not None and arg.strip():
            try:
                ratio = float(arg)
            except ValueError:
                log.warning("OTEL_TRACES_SAMPLER_ARG=%s is not a number: using %g", arg, ratio)
            else:
                if not 0.0 <= ratio <= 1.0:
                    log.warning("OTEL_TRACES_SAMPLER_ARG=%s is outside [0, 1]: clamped", arg)
                    ratio = min(max(ratio, 0.0), 1.0)
        return Sampler(ratio, parent_based)
    return Sampler(fixed, parent_based)


def resolve(configured: Tracing | None, env: Mapping[str, str]) -> TraceConfig | None:
    """The tracing this process runs, or None when it is off."""
    if _true(env.get("OTEL_SDK_DISABLED")):
        return None
    exporters = {e.strip().lower() for e in env.get("OTEL_TRACES_EXPORTER", "").split(",") if e.strip()}
    if "none" in exporters:
        return None
    asked = bool(env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "").strip()
                 or env.get("OTEL_EXPORTER_OTLP_ENDPOINT", "").strip() or "otlp" in exporters)
    if configured is None and not asked:
        return None
    cfg = configured if configured is not None else Tracing()
    protocol = (env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or cfg.protocol).strip().lower()
    if protocol not in (GRPC, HTTP):
        log.warning("OTLP protocol %s is not supported (grpc, http/protobuf): using %s", protocol, cfg.protocol)
        protocol = cfg.protocol
    headers = dict(cfg.headers)
    for var in ("OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"):  # the specific one last
        if env.get(var):
            headers.update(parse_headers(env[var]))
    return TraceConfig(
        endpoint=_endpoint(protocol, env, cfg.otlp_endpoint), protocol=protocol,
        sampler=_sampler(env, cfg.sample_ratio),
        service_name=(env.get("OTEL_SERVICE_NAME") or "").strip() or cfg.service_name,
        headers=headers, names=Names.from_env(env),
        max_queue_spans=int(_positive(env, "OTEL_BSP_MAX_QUEUE_SIZE", 2048)),
        max_batch_spans=int(_positive(env, "OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)),
        schedule_delay_s=_positive(env, "OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000,
    )
