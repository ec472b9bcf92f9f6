from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge

from backends import prom
from backends.base import LoadParseError

from .captures import openmetrics_latest

TEXT = b"""# HELP x_total a counter
# TYPE x_total counter
x_total{engine="0",model_name="m"} 3.0
x_total{engine="1",model_name="m"} 4.0
# TYPE g gauge
g{b="2",a="1"} 0.5
g{a="1",b="3"} NaN
# TYPE info gauge
info{block_size="16",engine="0"} 1.0
"""


def test_sums_and_selects_by_label_subset_in_any_order() -> None:
    m = prom.parse(TEXT)
    assert m.sum("x_total") == 7.0
    assert m.sum("x_total", {"engine": "1"}) == 4.0
    assert m.counter("x") == 7.0  # family name finds the `_total` sample
    assert m.sum("g", {"a": "1"}) == 0.5  # NaN samples are dropped
    assert m.label("info", "block_size") == "16"
    assert m.sum("missing") is None
    assert m.mean("x_total") == 3.5


def test_openmetrics_body_with_eof_and_created_samples() -> None:
    registry = CollectorRegistry()
    Counter("hits", "h", ["engine"], registry=registry).labels("0").inc(5)
    Gauge("vllm:num_requests_running", "r", ["engine"], registry=registry).labels("0").set(2)
    body = openmetrics_latest(registry)
    assert body.rstrip().endswith(b"# EOF")
    m = prom.parse(body)
    assert m.counter("hits") == 5.0
    assert m.sum("vllm:num_requests_running") == 2.0


@pytest.mark.parametrize(
    "body",
    [b"\xff\xfe garbage", b"x{{{ 1\n", b"<html><body>502</body></html>\n", b"a 1\nb 2\n# EOF junk\nc d e\n# EOF"],
)
def test_malformed_bodies_raise_only_load_parse_error(body: bytes) -> None:
    with pytest.raises(LoadParseError):
        prom.parse(body)


@pytest.mark.parametrize(
    ("value", "expected"), [("16", 16), (64.0, 64), ("None", None), ("", None), (None, None), (1.5, None)]
)
def test_to_int(value: str | float | None, expected: int | None) -> None:
    assert prom.to_int(value) == expected
