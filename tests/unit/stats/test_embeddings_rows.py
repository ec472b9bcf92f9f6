"""Embedding models get their own rows in the comparison; tokenize requests are not filed."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from gateway.settings import parse_settings
from gateway.stats import Comparer, StatsBook

from .fixtures import SETTINGS, outcome

WITH_EMBEDDINGS: dict[str, Any] = {
    **SETTINGS,
    "backends": [*SETTINGS["backends"],
                 {"name": "e1", "runtime": "vllm", "url": "http://127.0.0.1:9005", "model": "bge",
                  "usd_per_hour": 2.0}],
    "routes": [*SETTINGS["routes"], {"model": "emb", "kind": "embeddings", "backends": ["e1"]}],
}


def test_embeddings_and_tokenize_stay_out_of_generation_figures() -> None:
    book = StatsBook(parse_settings(WITH_EMBEDDINGS), started_at=0.0)
    for i in range(10):
        book.record(outcome("v1", i + 0.5, completion=100, prompt=50))
        embedding = outcome("e1", i + 0.5, completion=0, prompt=400, ttft=None, model="emb")
        book.record(replace(embedding, runtime="vllm", endpoint="embeddings"))
        book.record(replace(outcome("v1", i + 0.5, completion=0, prompt=0, ttft=None), endpoint="tokenize"))
    doc = Comparer(book).document(10.0, 60)
    runtimes = {r["name"]: r for r in doc["runtimes"]}
    assert runtimes["vllm"]["backends"] == ["v1", "v2"]
    assert runtimes["vllm"]["requests"] == 10  # the tokenize requests are not filed
    assert runtimes["vllm"]["prompt_tokens"] == 500
    emb = runtimes["vllm/embeddings"]
    assert (emb["task"], emb["backends"], emb["requests"], emb["prompt_tokens"]) == ("embeddings", ["e1"], 10, 4000)
    assert emb["cost"]["usd_per_million_prompt_tokens"] == 2.0 / (3600 * 400) * 1e6
    assert doc["total"]["requests"] == 10
    assert doc["total"]["backends"] == ["v1", "v2", "s1", "t1"]
    backends = {b["name"]: b for b in doc["backends"]}
    assert backends["e1"]["task"] == "embeddings"
    assert backends["v1"]["requests"] == 10
