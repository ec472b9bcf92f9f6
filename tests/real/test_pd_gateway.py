"""The gateway in front of a real vLLM prefill/decode pair (ExampleConnector, shared files), via the SDK.

The route splits every request (`disaggregation: {when: always, handoff: storage}`): leg 1 to the
prefill server, leg 2 (the client's request) to the decode server, which loads the prompt's KV from
the shared folder. Judged against the session's aggregated vLLM (same model, no connector, greedy:
the same text), the servers' own `prompt_tokens_by_source` (the prefill computed the prompt, the
decode loaded it) and the gateway's /metrics (the request counted once, with the decode's usage; the
pair's figures).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import httpx
import openai
import pytest
import yaml
from openai.types.chat import ChatCompletionMessageParam
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.harness import wait_for

from .harness import GATEWAY_STARTUP_TIMEOUT_S, ROOT, SERVED_MODEL, ServerProcess, free_port
from .pd import PdPair, SourceCounts, loaded_tokens, nonce, source_counts

pytestmark = [pytest.mark.real, pytest.mark.timeout(900)]

PD_MODEL = "moe-pd"  # the route clients use
PREFILL = "vllm-prefill"
DECODE = "vllm-decode"
SETTLE_S = 10.0


def gateway_config(pair: PdPair, port: int) -> dict[str, object]:
    return {
        "listen": {"host": "127.0.0.1", "port": port},
        "backends": [
            {"name": PREFILL, "runtime": "vllm", "url": pair.prefill.url, "model": SERVED_MODEL, "role": "prefill"},
            {"name": DECODE, "runtime": "vllm", "url": pair.decode.url, "model": SERVED_MODEL, "role": "decode"},
        ],
        "routes": [{
            "model": PD_MODEL,
            "backends": [PREFILL, DECODE],
            "disaggregation": {"when": "always", "handoff": "storage"},
        }],
    }  # fmt: skip


@pytest.fixture(scope="module")
def pd_gateway(pd_pair: PdPair, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    workdir = tmp_path_factory.mktemp("pd-gateway")
    port = free_port()
    config_path = workdir / "gateway.yaml"
    config_path.write_text(yaml.safe_dump(gateway_config(pd_pair, port), sort_keys=False), encoding="utf-8")
    argv = [sys.executable, "-m", "gateway", "serve", "--config", str(config_path),
            "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = ServerProcess.start("pd-gateway", argv, port=port, log_path=workdir / "gateway.log",
                                 env=dict(os.environ), cwd=ROOT)  # fmt: skip
    try:
        server.wait_until_ok("/ready", GATEWAY_STARTUP_TIMEOUT_S)
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def client(pd_gateway: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{pd_gateway.url}/v1", api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


@pytest.fixture(scope="module")
def direct(vllm_server: ServerProcess) -> Iterator[openai.OpenAI]:
    """The session's aggregated vLLM, straight (no gateway, no connector)."""
    with openai.OpenAI(base_url=f"{vllm_server.url}/v1", api_key="x", max_retries=0, timeout=120.0) as c:
        yield c


def long_question(tag: str) -> list[ChatCompletionMessageParam]:
    """About 400 tokens (three whole KV blocks and a tail), a prompt no other request used."""
    words = " ".join(f"{tag}-{i} the sea and the ship" for i in range(40))
    return [{"role": "user", "content": f"{nonce()} Tell me a story. {words}"}]


def gateway_samples(gateway: ServerProcess) -> list[tuple[str, dict[str, str], float]]:
    resp = httpx.get(f"{gateway.url}/metrics", timeout=10.0)
    resp.raise_for_status()
    return [(s.name, s.labels, s.value) for f in text_string_to_metric_families(resp.text) for s in f.samples]


def total(samples: list[tuple[str, dict[str, str], float]], name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and all(lab.get(k) == want for k, want in labels.items()))


def settled(url: str, before: SourceCounts, tokens: int) -> SourceCounts:
    """A server's prompt-token counters since `before`, once `tokens` prompt tokens are in them."""
    return wait_for(lambda: source_counts(url).minus(before),
                    lambda d: d.local_compute + d.local_cache_hit + d.external_kv_transfer >= tokens,
                    timeout=SETTLE_S, what=f"{tokens} prompt tokens in {url}'s counters")


def after_request(gateway: ServerProcess, name: str, want: float, **labels: str,
                  ) -> list[tuple[str, dict[str, str], float]]:
    """The gateway's samples once `name{labels}` reached `want` (accounting records after the last byte)."""
    return wait_for(lambda: gateway_samples(gateway), lambda samples: total(samples, name, **labels) >= want,
                    timeout=SETTLE_S, what=f"{name}{labels} >= {want}")


def test_non_streaming_through_the_pair_equals_direct(
    pd_pair: PdPair, pd_gateway: ServerProcess, client: openai.OpenAI, direct: openai.OpenAI
) -> None:
    messages = long_question("gw")
    reference = direct.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=12, temperature=0)
    assert reference.usage is not None
    prompt_tokens = reference.usage.prompt_tokens
    prefill_before, decode_before = source_counts(pd_pair.prefill.url), source_counts(pd_pair.decode.url)
    metrics_before = gateway_samples(pd_gateway)

    raw = client.chat.completions.with_raw_response.create(model=PD_MODEL, messages=messages, max_tokens=12,
                                                          temperature=0)  # fmt: skip

    assert raw.status_code == 200
    assert raw.headers["x-gateway-backend"] == DECODE
    answer = raw.parse()
    assert answer.model == PD_MODEL
    assert answer.choices[0].message.content == reference.choices[0].message.content
    assert answer.usage is not None
    # The decode leg's usage: the prefill's one token is not the client's.
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (
        prompt_tokens, reference.usage.completion_tokens)  # fmt: skip
    # The prefill server computed the prompt; the decode loaded its whole blocks from the shared folder.
    assert settled(pd_pair.prefill.url, prefill_before, prompt_tokens).local_compute == prompt_tokens
    decode = settled(pd_pair.decode.url, decode_before, prompt_tokens)
    assert decode.external_kv_transfer == loaded_tokens(prompt_tokens) > 0
    assert decode.local_compute == prompt_tokens - loaded_tokens(prompt_tokens)

    want = total(metrics_before, "gateway_requests_total", model=PD_MODEL) + 1
    after = after_request(pd_gateway, "gateway_requests_total", want, model=PD_MODEL)
    _assert_counted_once(metrics_before, after, prompt_tokens, reference.usage.completion_tokens)
    assert _grew(metrics_before, after, "gateway_pd_requests_total", model=PD_MODEL, prefill=PREFILL,
                 decode=DECODE, outcome="ok") == 1  # fmt: skip
    assert _grew(metrics_before, after, "gateway_pd_legs_total", model=PD_MODEL, role="prefill",
                 backend=PREFILL, outcome="ok") == 1  # fmt: skip
    assert _grew(metrics_before, after, "gateway_pd_prefill_seconds_count", model=PD_MODEL, backend=PREFILL) == 1


def test_streaming_through_the_pair_equals_direct(
    pd_pair: PdPair, pd_gateway: ServerProcess, client: openai.OpenAI, direct: openai.OpenAI
) -> None:
    messages = long_question("gw-stream")
    reference = direct.chat.completions.create(model=SERVED_MODEL, messages=messages, max_tokens=12, temperature=0)
    assert reference.usage is not None
    prompt_tokens = reference.usage.prompt_tokens
    decode_before = source_counts(pd_pair.decode.url)
    metrics_before = gateway_samples(pd_gateway)

    stream = client.chat.completions.create(
        model=PD_MODEL, messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    text, usage, models = [], None, set()
    for chunk in stream:
        models.add(chunk.model)
        if chunk.choices and chunk.choices[0].delta.content:
            text.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage

    assert "".join(text) == reference.choices[0].message.content
    assert models == {PD_MODEL}
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (prompt_tokens, reference.usage.completion_tokens)
    assert settled(pd_pair.decode.url, decode_before, prompt_tokens).external_kv_transfer == loaded_tokens(
        prompt_tokens)  # fmt: skip

    want = total(metrics_before, "gateway_requests_total", model=PD_MODEL) + 1
    after = after_request(pd_gateway, "gateway_requests_total", want, model=PD_MODEL)
    _assert_counted_once(metrics_before, after, prompt_tokens, reference.usage.completion_tokens)
    pair = {"model": PD_MODEL, "prefill": PREFILL, "decode": DECODE}
    assert _grew(metrics_before, after, "gateway_pd_requests_total", **pair, outcome="ok") == 1
    # A stream has a first decode token: the true TTFT and the transfer time are observed.
    assert _grew(metrics_before, after, "gateway_pd_ttft_seconds_count", **pair) == 1
    assert _grew(metrics_before, after, "gateway_pd_transfer_seconds_count", **pair) == 1


def _grew(before: list[tuple[str, dict[str, str], float]], after: list[tuple[str, dict[str, str], float]],
          name: str, **labels: str) -> float:
    return total(after, name, **labels) - total(before, name, **labels)


def _assert_counted_once(before: list[tuple[str, dict[str, str], float]],
                         after: list[tuple[str, dict[str, str], float]], prompt: int, completion: int) -> None:
    """One client request: one request and the decode leg's tokens, all under the decode backend."""
    assert _grew(before, after, "gateway_requests_total", model=PD_MODEL) == 1
    assert _grew(before, after, "gateway_requests_total", model=PD_MODEL, backend=DECODE) == 1
    assert _grew(before, after, "gateway_requests_total", backend=PREFILL) == 0  # leg 1 is not a request
    assert _grew(before, after, "gateway_pd_decisions_total", model=PD_MODEL, decision="split", reason="always") == 1
    assert _grew(before, after, "gateway_tokens_total", model=PD_MODEL, kind="prompt") == prompt
    assert _grew(before, after, "gateway_tokens_total", model=PD_MODEL, kind="completion") == completion
