"""Property-based tests (hypothesis): arbitrary bodies, JSON values and headers never get a 500 and
always get OpenAI-shaped errors, from a real gateway process."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.integration.harness import GatewayProcess

from .conftest import check_response

FUZZ = settings(max_examples=80, deadline=None, suppress_health_check=list(HealthCheck), database=None)
PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELDS = ["model", "messages", "prompt", "stream", "stream_options", "n", "max_tokens", "temperature", "input",
          "instructions", "max_output_tokens", "tools", "tool_choice", "response_format", "text",
          "previous_response_id", "logprobs", "tokens"]
requestish = st.fixed_dictionaries(
    {"model": st.sampled_from(["moe", "emb", "nope", ""]) | json_values},
    optional={f: json_values for f in FIELDS[1:]}
    | {"messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]) | json_values,
                                                   "content": st.text(max_size=30) | json_values}), max_size=3),
       "max_tokens": st.integers(-5, 3000) | json_values, "n": st.integers(-2, 300) | json_values},
)


@pytest.fixture(scope="module")
def client(fuzz_gateway: GatewayProcess) -> Any:
    with httpx.Client(base_url=fuzz_gateway.url, timeout=30) as c:
        yield c


@FUZZ
@given(path=st.sampled_from(PATHS), body=st.binary(max_size=300))
def test_arbitrary_bytes(client: httpx.Client, path: str, body: bytes) -> None:
    resp = client.post(path, content=body, headers={"content-type": "application/json"})
    check_response(resp.status_code, resp.content, resp.headers.get("content-type", ""))


@FUZZ
@given(path=st.sampled_from(PATHS), body=requestish)
def test_request_shaped_json(client: httpx.Client, path: str, body: dict[str, Any]) -> None:
    resp = client.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
    check_response(resp.status_code, resp.content, resp.headers.get("content-type", ""))


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
@given(method=st.sampled_from(["GET", "POST", "PUT", "DELETE", "PATCH"]),
       path=st.sampled_from(["/v1/models", "/v1/models/moe", "/v1/chat/completions", "/v1/responses", "/tokenize",
                             "/admin/backends", "/x", "/v1/"])
       | st.text(alphabet="abc/%.-_", max_size=20).map(lambda p: "/" + p),
       auth=st.text(alphabet=st.characters(min_codepoint=33, max_codepoint=126), max_size=40))
def test_arbitrary_paths_methods_and_headers(client: httpx.Client, method: str, path: str, auth: str) -> None:
    resp = client.request(method, path, headers={"Authorization": auth, "x-request-id": auth[:20]})
    if path in ("/metrics", "/dashboard") or path.startswith("/dashboard/"):
        return  # not JSON endpoints
    check_response(resp.status_code, resp.content, resp.headers.get("content-type", ""))
