"""Client mistakes and backend errors reach the client as OpenAI errors with the right status."""

from __future__ import annotations

from collections.abc import Callable

import openai
import pytest

from .harness import Emulators, GatewayProcess, backend_entry

StartGateway = Callable[..., GatewayProcess]


def assert_openai_error(body: object) -> dict[str, object]:
    assert isinstance(body, dict)
    err = body["error"]
    assert isinstance(err, dict)
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"]
    return err


@pytest.fixture
def gw(emulators: Emulators, gateway: StartGateway) -> GatewayProcess:
    return gateway([backend_entry("v", emulators.start("vllm"), "vllm")])


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b'{"model": "x", "messages": [', 400, None),
        (b'{"model": "moe"}', 400, "messages"),
        (b'{"model": "moe", "messages": [{"role": "user", "content": "x"}], "n": 0}', 400, "n"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "x"}]}', 404, "model"),
        (b"\xff\xfe\xfd", 400, None),
    ],
)
def test_client_mistakes_are_openai_4xx(gw: GatewayProcess, body: bytes, status: int, param: str | None) -> None:
    resp = gw.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    assert resp.status_code == status
    err = assert_openai_error(resp.json())
    assert err["param"] == param
    assert resp.headers["x-request-id"]


def test_unknown_model_is_model_not_found_through_the_sdk(gw: GatewayProcess) -> None:
    c = gw.client()
    with pytest.raises(openai.NotFoundError) as info:
        c.chat.completions.create(model="gpt-9", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"


def test_unknown_paths_and_methods_are_openai_errors(gw: GatewayProcess) -> None:
    resp = gw.get("/v1/nothing-here")
    assert resp.status_code == 404
    assert_openai_error(resp.json())
    resp = gw.get("/v1/chat/completions")
    assert resp.status_code == 405
    assert_openai_error(resp.json())


@pytest.mark.parametrize("runtime", ["vllm", "sglang", "trtllm"])
def test_backend_errors_pass_through_with_their_status_normalised(
    emulators: Emulators, gateway: StartGateway, runtime: str
) -> None:
    gw = gateway([backend_entry("b", emulators.start(runtime), runtime)])
    c = gw.client()
    long_prompt = "word " * 5000  # far beyond the emulators' 2048-token context
    with pytest.raises(openai.BadRequestError) as info:
        c.chat.completions.create(model="moe", messages=[{"role": "user", "content": long_prompt}], max_tokens=4)
    assert info.value.status_code == 400
    assert "2048" in info.value.message  # the backend's own explanation (its context limit) reaches the client
    assert_openai_error(info.value.response.json())
    assert info.value.response.headers["x-gateway-backend"] == "b"
    assert info.value.response.headers["x-gateway-runtime"] == runtime


def test_triton_errors_are_normalised(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway([backend_entry("t", emulators.start("triton"), "triton")])
    resp = gw.post("/v1/completions", json={"model": "moe", "prompt": "word " * 5000, "max_tokens": 4})
    assert 400 <= resp.status_code < 500
    assert_openai_error(resp.json())


def test_body_over_the_limit_is_413(emulators: Emulators, gateway: StartGateway) -> None:
    gw = gateway([backend_entry("v", emulators.start("vllm"), "vllm")], limits={"max_body_bytes": 4096})
    resp = gw.post("/v1/completions", json={"model": "moe", "prompt": "x" * 10_000})
    assert resp.status_code == 413
    assert_openai_error(resp.json())
