from __future__ import annotations

import random

import orjson
import pytest

from gateway.proxy.sse import SseFramingError, SseRelay

HEAD = b'data: {"id":"c1","object":"chat.completion.chunk","model":"tiny-moe",'
ROLE = HEAD + b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}\n\n'
TOK = HEAD + b'"choices":[{"index":0,"delta":{"content":"hi \\"usage\\""}}]}\n\n'
USAGE = (
    HEAD + b'"choices":[],"usage":{"prompt_tokens":7,"total_tokens":10,"completion_tokens":3,'
    b'"prompt_tokens_details":{"cached_tokens":4}}}\n\n'
)
DONE = b"data: [DONE]\n\n"
STREAM = ROLE + TOK + TOK + USAGE + DONE


def run(relay: SseRelay, parts: list[bytes]) -> bytes:
    out = b"".join(relay.feed(p, float(i)) for i, p in enumerate(parts))
    return out + relay.close(float(len(parts)))


def events(data: bytes) -> list[bytes]:
    return [e for e in data.split(b"\n\n") if e]


def test_usage_chunk_is_kept_when_the_client_asked_and_model_is_rewritten() -> None:
    relay = SseRelay(backend_model="tiny-moe", client_model="moe", include_usage=True)
    out = run(relay, [STREAM])
    assert out == STREAM.replace(b'"model":"tiny-moe"', b'"model":"moe"')
    assert relay.stats.usage is not None
    assert (relay.stats.usage.prompt_tokens, relay.stats.usage.completion_tokens) == (7, 3)
    assert relay.stats.usage.cached_tokens == 4
    assert relay.stats.tokens == 2  # two token events; the role and usage chunks are not output
    assert relay.stats.done


def test_usage_chunk_is_dropped_when_the_client_did_not_ask_but_still_counted() -> None:
    relay = SseRelay(backend_model="tiny-moe", client_model="tiny-moe", include_usage=False)
    out = run(relay, [STREAM])
    assert out == ROLE + TOK + TOK + DONE
    assert relay.stats.usage is not None
    assert relay.stats.usage.completion_tokens == 3


@pytest.mark.parametrize("include_usage", [True, False])
def test_output_does_not_depend_on_how_bytes_are_split(include_usage: bool) -> None:
    whole = run(SseRelay(backend_model="tiny-moe", client_model="m", include_usage=include_usage), [STREAM])
    for cut in range(1, len(STREAM)):
        relay = SseRelay(backend_model="tiny-moe", client_model="m", include_usage=include_usage)
        assert run(relay, [STREAM[:cut], STREAM[cut:]]) == whole, cut
        assert relay.stats.tokens == 2


def test_gaps_are_measured_between_output_events() -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    for t, chunk in [(1.0, ROLE), (1.5, TOK), (1.75, TOK), (2.0, USAGE), (2.0, DONE)]:
        relay.feed(chunk, t)
    assert relay.stats.first_token_at == 1.5  # the first token, not the role chunk
    assert (relay.stats.gaps.count, relay.stats.gaps.sum) == (1, 0.25)


@pytest.mark.parametrize(
    "event",
    [
        b'data: {"error": {"message": "Internal server error", "type": "InternalServerError", '
        b'"param": null, "code": 500}}',
        b'data: {"error": {"object":"error","message":"Internal server error","type":"InternalServerError",'
        b'"param":null,"code":500}}',
        b'data: {"error":"Internal server error"}',
    ],
)
def test_error_events_are_normalised_to_the_nested_openai_shape(event: bytes) -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    out = relay.feed(event + b"\n\n" + DONE, 0.0)
    first = events(out)[0]
    payload = orjson.loads(first[5:])
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    assert payload["error"]["message"] == "Internal server error"
    assert relay.stats.error is not None
    assert events(out)[1] == DONE.strip()


def test_comments_pass_through_and_do_not_count() -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    assert relay.feed(b": keep-alive\n\n", 0.0) == b": keep-alive\n\n"
    assert relay.stats.tokens == 0


def test_tokens_that_arrive_together_share_the_interval_before_them() -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    relay.feed(ROLE + TOK, 1.0)
    relay.feed(TOK + TOK + TOK + TOK, 2.0)  # four tokens flushed at once, one second after the first
    gaps = relay.stats.gaps
    assert (gaps.count, gaps.sum, gaps.mean_s) == (4, 1.0, 0.25)  # not three gaps of 0 and one of 1


@pytest.mark.parametrize("sep", [b"\n\n", b"\r\n\r\n", b"\r\r"])
def test_every_sse_line_ending_frames_events(sep: bytes) -> None:
    stream = STREAM.replace(b"\n\n", sep)
    for cut in range(1, len(stream), 7):
        relay = SseRelay(backend_model="tiny-moe", client_model="tiny-moe", include_usage=True)
        assert run(relay, [stream[:cut], stream[cut:]]) == STREAM, cut
        assert relay.stats.done
        assert relay.stats.tokens == 2


def test_done_without_the_space_ends_the_stream() -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    assert relay.feed(TOK + b"data:[DONE]\n\n", 0.0) == TOK + DONE
    assert relay.stats.done


def test_an_event_that_never_ends_is_refused_not_buffered_without_bound() -> None:
    relay = SseRelay(backend_model="x", client_model="x", include_usage=False)
    for _ in range(31):  # just under the limit: still buffered
        relay.feed(b"x" * 32_768, 0.0)
    with pytest.raises(SseFramingError):
        relay.feed(b"x" * 65_536, 0.0)


def test_the_fast_path_and_the_general_path_agree_event_by_event() -> None:
    """Once the prefix is learned, single-event reads skip JSON; the result must be identical."""
    long = HEAD + b'"choices":[{"index":0,"delta":{"content":"' + b"x" * 100 + b'"}}]}\n\n'
    finish = HEAD + b'"choices":[{"index":0,"delta":{"content":"."},"finish_reason":"stop"}]}\n\n'
    chunks = [ROLE, TOK, TOK, long, TOK, finish, TOK + TOK, USAGE, DONE]
    one = SseRelay(backend_model="tiny-moe", client_model="m", include_usage=True)
    split = b"".join(one.feed(c, float(i)) for i, c in enumerate(chunks))
    other = SseRelay(backend_model="tiny-moe", client_model="m", include_usage=True)
    whole = other.feed(b"".join(chunks), 0.0)
    assert split == whole
    assert one.stats.tokens == other.stats.tokens == 7


def test_a_model_field_after_the_text_is_still_renamed_on_every_event() -> None:
    """The fast path renames the model inside the learned prefix; a runtime that puts `model` after
    the choices gets the general path, which renames it wherever it is."""
    late = b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"model":"tiny-moe"}\n\n'
    relay = SseRelay(backend_model="tiny-moe", client_model="moe", include_usage=False)
    out = b"".join(relay.feed(late, float(i)) for i in range(3))
    assert out.count(b'"model":"moe"') == 3
    assert b"tiny-moe" not in out
    assert relay.stats.tokens == 3


def test_runs_of_token_events_in_one_read_count_as_the_event_by_event_walk() -> None:
    """A read of many events walks them with the learned prefix (and renames the model by swapping
    the prefix); whatever lies between ordinary token events (empty text, extra blank lines, role,
    finish, usage, comments, a second data line) must give the same output and the same token count
    as feeding one event a read, and, when nothing is dropped, the input with the model renamed."""
    kinds = [TOK, TOK, TOK, HEAD + b'"choices":[{"index":0,"delta":{"content":""}}]}\n\n', ROLE, USAGE,
             HEAD + b'"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}\n\n', b": keep-alive\n\n",
             b"\n", TOK[:-1] + TOK, HEAD + b'"choices":[{"index":0,"delta":{"content":"\\n\\n"}}]}\n\n']
    rng = random.Random(7)
    for trial in range(300):
        body = [TOK] + [rng.choice(kinds) for _ in range(rng.randrange(1, 30))] + [DONE]
        one = SseRelay(backend_model="tiny-moe", client_model="m", include_usage=trial % 2 == 0)
        split = b"".join(one.feed(e, float(i)) for i, e in enumerate(body)) + one.close(99.0)
        other = SseRelay(backend_model="tiny-moe", client_model="m", include_usage=trial % 2 == 0)
        other.feed(TOK, 0.0)  # the prefix is learned: the rest comes in one read
        whole = TOK.replace(b"tiny-moe", b"m") + other.feed(b"".join(body[1:]), 1.0) + other.close(99.0)
        assert whole == split, body
        assert other.stats.tokens == one.stats.tokens, body
        if trial % 2 == 0:  # the usage chunk kept: nothing differs from the input but the model
            assert split == b"".join(body).replace(b'"model":"tiny-moe"', b'"model":"m"'), body
