"""What tracing runs with: the config's `tracing` section, and the standard `OTEL_*` variables that win
where they are set (pure: the environment is a mapping)."""

from __future__ import annotations

import pytest

from gateway.settings import Tracing
from gateway.tracing.config import DEFAULT_GRPC, DEFAULT_HTTP, parse_headers, resolve
from gateway.tracing.context import Sampler
from gateway.tracing.sampled import request_cost_usd
from gateway.tracing.semconv import Names

ON = Tracing(otlp_endpoint="collector:4317", sample_ratio=0.25, service_name="gw", headers={"x-key": "a"})


def test_off_unless_the_config_or_a_variable_asks() -> None:
    assert resolve(None, {}) is None
    assert resolve(None, {"OTEL_SERVICE_NAME": "x", "OTEL_TRACES_SAMPLER": "always_on"}) is None  # no endpoint
    assert resolve(None, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317"}) is not None
    assert resolve(None, {"OTEL_TRACES_EXPORTER": "otlp"}) is not None
    assert resolve(ON, {}) is not None
    for off in ({"OTEL_SDK_DISABLED": "true"}, {"OTEL_SDK_DISABLED": "TRUE "}, {"OTEL_TRACES_EXPORTER": "none"}):
        assert resolve(ON, off) is None


def test_the_config_alone() -> None:
    config = resolve(ON, {})
    assert config is not None
    assert config.endpoint == "http://collector:4317"  # gRPC host:port is plain text
    assert config.protocol == "grpc"
    assert config.sampler == Sampler(0.25, parent_based=True)
    assert config.service_name == "gw"
    assert dict(config.headers) == {"x-key": "a"}
    assert config.names == Names(latest=False)
    assert (config.max_queue_spans, config.max_batch_spans, config.schedule_delay_s) == (2048, 512, 5.0)


@pytest.mark.parametrize(("section", "env", "endpoint"), [
    (Tracing(), {}, DEFAULT_GRPC),
    (Tracing(protocol="http/protobuf"), {}, DEFAULT_HTTP),
    (Tracing(protocol="http/protobuf", otlp_endpoint="http://c:4318"), {}, "http://c:4318/v1/traces"),
    (Tracing(protocol="http/protobuf", otlp_endpoint="http://c:4318/custom"), {}, "http://c:4318/custom"),
    (Tracing(otlp_endpoint="https://c:4317"), {}, "https://c:4317"),
    # the variables win: the signal's own endpoint as it is, the base one with the traces path
    (ON, {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://env:4317"}, "http://env:4317"),
    (ON, {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t:1", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:2"},
     "http://t:1"),
    (ON, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://b:4318/"},
     "http://b:4318/v1/traces"),
    (ON, {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"},
     "http://t/x"),
])
def test_where_spans_go(section: Tracing, env: dict[str, str], endpoint: str) -> None:
    config = resolve(section, env)
    assert config is not None
    assert config.endpoint == endpoint


def test_the_variables_win_over_every_key() -> None:
    config = resolve(ON, {
        "OTEL_SERVICE_NAME": "from-env", "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5",
        "OTEL_EXPORTER_OTLP_HEADERS": "x-key=b,Authorization=Bearer%20t",
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS": "x-key=c",
        "OTEL_SEMCONV_STABILITY_OPT_IN": "http, gen_ai_latest_experimental", "OTEL_BSP_SCHEDULE_DELAY": "250",
        "OTEL_BSP_MAX_QUEUE_SIZE": "100", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "10",
    })
    assert config is not None
    assert config.service_name == "from-env"
    assert config.sampler == Sampler(0.5, parent_based=False)
    assert dict(config.headers) == {"x-key": "c", "authorization": "Bearer t"}  # the signal's own last
    assert config.names.latest
    assert (config.max_queue_spans, config.max_batch_spans, config.schedule_delay_s) == (100, 10, 0.25)


@pytest.mark.parametrize(("name", "arg", "sampler"), [
    ("always_on", None, Sampler(1.0, False)), ("always_off", None, Sampler(0.0, False)),
    ("parentbased_always_on", None, Sampler(1.0, True)), ("parentbased_always_off", None, Sampler(0.0, True)),
    ("parentbased_traceidratio", "0.1", Sampler(0.1, True)), ("traceidratio", None, Sampler(0.25, False)),
    ("traceidratio", "2", Sampler(1.0, False)),  # clamped
    ("traceidratio", "x", Sampler(0.25, False)),  # not a number: the config's ratio
    ("jaeger_remote", None, Sampler(0.25, True)),  # unsupported: the default, with a warning
])
def test_the_sdks_sampler_names(name: str, arg: str | None, sampler: Sampler) -> None:
    env = {"OTEL_TRACES_SAMPLER": name} | ({"OTEL_TRACES_SAMPLER_ARG": arg} if arg is not None else {})
    config = resolve(ON, env)
    assert config is not None
    assert config.sampler == sampler


def test_bad_variables_fall_back_rather_than_stop_the_gateway() -> None:
    config = resolve(ON, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json", "OTEL_BSP_SCHEDULE_DELAY": "-1"})
    assert config is not None
    assert config.protocol == "grpc"
    assert config.schedule_delay_s == 5.0
    assert parse_headers("a=1,,=2,b") == {"a": "1"}


def test_a_requests_cost_is_its_share_of_the_backends_paid_hour() -> None:
    # $3.60/h at 100 output tokens/s: 360,000 tokens for $3.60, so 1,000 tokens cost a cent
    cost = request_cost_usd(3.6, 1000, 100.0)
    assert cost == pytest.approx(0.01)
    assert request_cost_usd(None, 1000, 100.0) is None  # no price
    assert request_cost_usd(3.6, 1000, None) is None  # no measured throughput yet
    assert request_cost_usd(3.6, 1000, 0.0) is None
