from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from backends.base import Endpoint
from backends.chat_templates import render
from gateway.routing import BadRoutingHeader, SlaTarget, describe, stride_for
from gateway.routing.base import UNIT_CHARS
from gateway.routing.features import api_key_digest
from gateway.routing.hashing import chain_hashes

from .helpers import chat, doc, features


def test_chain_hashes_the_rendered_prompt_in_16_token_units() -> None:
    body = chat(doc(1), "question")
    text = render(body["messages"], "chatml").encode()
    feats = describe(body, Endpoint.CHAT, {})
    assert feats.chain == chain_hashes(text, UNIT_CHARS)
    assert len(feats.chain) == len(text) // UNIT_CHARS
    assert feats.prompt_tokens == -(-len(text) // 4)


def test_a_shared_prefix_is_a_shared_chain_prefix_and_then_diverges() -> None:
    a, b = features(doc(1), "first question"), features(doc(1), "another question entirely")
    shared = len(render(chat(doc(1))["messages"]).split("<|im_start|>user")[0]) // UNIT_CHARS
    assert a.chain[:shared] == b.chain[:shared]
    assert a.chain[-1] != b.chain[-1]
    assert a.affinity_key == b.affinity_key == a.chain[0]


def test_prefix_key_namespaces_blocks_and_is_the_rendezvous_key() -> None:
    plain = features(doc(1))
    keyed = features(doc(1), x_prefix_key="tenant-a")
    other = features(doc(1), x_prefix_key="tenant-b")
    assert keyed.chain[0] not in (plain.chain[0], other.chain[0])
    assert keyed.affinity_key != other.affinity_key
    assert features(doc(2), x_prefix_key="tenant-a").affinity_key == keyed.affinity_key


def test_session_overrides_inferred_key_but_not_the_prefix_key() -> None:
    s1 = features(doc(1), x_session_id="conv-1")
    assert s1.affinity_key == features(doc(2), x_session_id="conv-1").affinity_key
    assert s1.affinity_key != features(doc(1)).affinity_key
    both = features(doc(1), x_session_id="conv-1", x_prefix_key="t")
    assert both.affinity_key == features(doc(3), x_prefix_key="t").affinity_key


def test_sticky_key_precedence_and_the_api_key_is_not_a_session() -> None:
    """The OpenAI SDK always sends a key: stickiness by key is opt-in (`split.sticky: api_key`),
    so a request with neither session nor user has no sticky key (its arm is drawn by weight)."""
    body = chat("x") | {"user": "alice"}
    headers = {"authorization": "Bearer sk-secret"}
    assert describe(body, Endpoint.CHAT, {"x-session-id": "s", **headers}).sticky_key == "s:s"
    assert describe(body, Endpoint.CHAT, headers).sticky_key == "u:alice"
    assert describe(chat("x"), Endpoint.CHAT, headers).sticky_key is None
    digest = api_key_digest(headers)
    assert digest is not None
    assert "sk-secret" not in digest
    assert api_key_digest({}) is None


def test_completions_prompts_strings_batches_and_token_ids() -> None:
    text = doc(5)
    assert describe({"prompt": text}, Endpoint.COMPLETIONS, {}).chain == chain_hashes(text.encode(), UNIT_CHARS)
    assert describe({"prompt": [text, "b"]}, Endpoint.COMPLETIONS, {}).chain == chain_hashes(text.encode(), UNIT_CHARS)
    ids = describe({"prompt": list(range(100))}, Endpoint.COMPLETIONS, {})
    assert ids.prompt_tokens == 100
    assert len(ids.chain) == 100 // 16


def test_non_text_chat_content_still_gets_a_stable_chain() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x" * 200}}]}]}
    assert describe(body, Endpoint.CHAT, {}).chain == describe(body, Endpoint.CHAT, {}).chain != ()


def test_sla_headers() -> None:
    f = features("x", x_sla_ttft_ms="250", x_sla_tpot_ms="40", x_sla_strict="true")
    assert f.sla == SlaTarget(ttft_s=0.25, tpot_s=0.04, strict=True)
    assert features("x").sla is None
    assert features("x", x_sla_strict="true").sla is None


@pytest.mark.parametrize(
    ("header", "value"), [("x-sla-ttft-ms", "fast"), ("x-sla-ttft-ms", "-1"), ("x-sla-tpot-ms", "nan"),
                          ("x-sla-strict", "maybe")],
)
def test_bad_sla_headers_name_the_header(header: str, value: str) -> None:
    with pytest.raises(BadRoutingHeader, match=header):
        describe(chat("x"), Endpoint.CHAT, {"x-sla-ttft-ms": "100", header: value})


@pytest.mark.parametrize(("block", "stride"), [(None, 1), (1, 1), (16, 1), (32, 2), (64, 4), (128, 8), (100, 7)])
def test_stride_rounds_engine_blocks_up_to_whole_units(block: int | None, stride: int) -> None:
    assert stride_for(block) == stride


def test_hashes_agree_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from tests.unit.routing.helpers import features, doc;"
        "f = features(doc(3), 'q', x_session_id='s');"
        "print(f.chain[:5], f.chain[-1], f.affinity_key)"
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True,
            env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=Path(__file__).resolve().parents[3],
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1
    f = features(doc(3), "q", x_session_id="s")
    assert outputs == {f"{f.chain[:5]} {f.chain[-1]} {f.affinity_key}\n"}
