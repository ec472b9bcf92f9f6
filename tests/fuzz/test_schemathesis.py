"""Schema-driven fuzzing: schemathesis generates valid and invalid requests (positive and negative
modes) for every operation of the OpenAPI document the gateway serves at /openapi.json, and sends them
to a real gateway process with emulator backends.

schemathesis' own pytest plugin does not run under pytest 9, so its strategies are driven by
hypothesis directly (`APIOperation.as_strategy`), one operation and mode at a time."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from tests.integration.harness import GatewayProcess

from .conftest import check_response

EXAMPLES = 30


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_answer_is_documented_and_openai_shaped(fuzz_gateway: GatewayProcess, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(fuzz_gateway.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]  # type: ignore[union-attr]
    assert len(operations) >= 6
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() != "POST":
            continue  # nothing to violate in a GET without parameters

        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case: schemathesis.Case) -> None:  # type: ignore[type-arg]
            response = case.call(base_url=fuzz_gateway.url, timeout=30)
            content_type = response.headers.get("content-type") or [""]
            check_response(response.status_code, response.content, content_type[0])

        run()
