"""One real gateway process in front of emulators of every runtime, shared by the fuzz tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.harness import Emulators, GatewayProcess, LoopThread, backend_entry


@pytest.fixture(scope="session")
def fuzz_gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayProcess]:
    loop = LoopThread()
    emulators = Emulators(loop)
    backends = [
        backend_entry(runtime, emulators.start(runtime, speed=1000.0), runtime)
        for runtime in ("vllm", "sglang", "trtllm", "triton")
    ]
    embedder = backend_entry("embedder", emulators.start("vllm", speed=1000.0, embedding_dim=8), "vllm")
    config = {
        "backends": [*backends, embedder],
        "routes": [{"model": "moe", "backends": [b["name"] for b in backends], "policy": "round_robin"},
                   {"model": "emb", "kind": "embeddings", "backends": ["embedder"]}],
        "limits": {"max_body_bytes": 65536, "body_timeout_s": 5},
    }
    gw = GatewayProcess(config, tmp_path_factory.mktemp("fuzz"))
    yield gw
    gw.stop()
    emulators.stop_all()
    loop.close()


def check_response(status: int, body: bytes, content_type: str) -> None:
    """The contract under fuzzing: nothing >= 500 except the documented backend statuses, and every
    non-2xx answer in OpenAI's error shape."""
    import orjson

    assert status < 500 or status in (502, 503, 504), (status, body[:300])
    if status >= 300:
        assert content_type.startswith("application/json"), (status, content_type, body[:300])
        err = orjson.loads(body)["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str)
        assert err["message"]
