"""The SSE relay's walk over a read's complete events (gateway/proxy/sse_scan.py): the Python reference
against an oracle written from the definition; the C walk against the reference, event facts against
orjson and whole streams relayed by both walks; and which of the two the build runs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway import build_check
from gateway.proxy import sse_scan
from gateway.proxy.sse import MAX_TOKEN_TEXT, SseRelay
from tests.unit.backends.captures import response

PREFIX = b'data: {"id":"c","model":"m","choices":[{"delta":{"content":"'
SUFFIX = b'"}}]}\n\n'
CLIENT = b'data: {"id":"c","model":"client-name","choices":[{"delta":{"content":"'
MAX_TEXT = 8
# the C walk against its reference: the pure pass leaves these out (`make test-pure`: no C there)
native = pytest.mark.native


def oracle(buf: bytes, pos: int, stop: int, client: bytes | None) -> tuple[int, bytes | None, int]:
    """From the definition: an event ends at the first blank line; it is ordinary when it is the prefix,
    1..MAX_TEXT bytes of text not starting with a quote, and the suffix."""
    count, out = 0, b""
    while True:
        while pos < stop and buf[pos] == 10:
            out += b"\n"
            pos += 1
        end = buf.find(b"\n\n", pos, stop)
        if end < 0:
            break
        event = buf[pos:end + 2]
        text = len(event) - len(PREFIX) - len(SUFFIX)
        if not (event.startswith(PREFIX) and event.endswith(SUFFIX) and 1 <= text <= MAX_TEXT
                and event[len(PREFIX)] != 34):
            break
        out += (client or PREFIX) + event[len(PREFIX):]
        count += 1
        pos = end + 2
    return pos, (out if client is not None and count else None), count


QUOTE_LF_BACKSLASH = bytes.maketrans(b"\x00\x01\x02", b'"\n\\')
texts = st.binary(min_size=0, max_size=MAX_TEXT + 2).map(lambda b: b.translate(QUOTE_LF_BACKSLASH))
piece = st.one_of(
    texts.map(lambda t: PREFIX + t + SUFFIX),  # ordinary, or near it (empty, too long, a quote or LF in it)
    texts.map(lambda t: PREFIX + t + b'"}],"finish_reason":"stop"}\n\n'),  # another suffix
    texts.map(lambda t: b"data: " + t + b"\n\n"),  # another event
    st.just(b"\n"),  # a blank line between events
    st.just(b"data: [DONE]\n\n"),
    st.sampled_from([PREFIX, PREFIX[:10], SUFFIX[:3]]),  # a piece: an event cut short
)


@settings(max_examples=600, deadline=None)
@given(st.lists(piece, max_size=12), st.data(), st.booleans())
def test_the_reference_walk_agrees_with_the_definition(pieces: list[bytes], data: st.DataObject,
                                                         rename: bool) -> None:
    buf = b"".join(pieces)
    stop = buf.rfind(b"\n\n") + 2  # as the relay calls it: up to the end of the last complete event
    if stop < 2:
        return
    pos = data.draw(st.integers(0, stop - 1))
    client = CLIENT if rename else None
    end, renamed, count = oracle(buf, pos, stop, client)
    old, new = (b'"model":"m"', b'"model":"client-name"') if rename else (None, None)
    assert sse_scan.reference_relay_run(buf, pos, stop, PREFIX, SUFFIX, client, old, new, MAX_TEXT, True) == (
        end, renamed, count, False, None, None)


@settings(max_examples=400, deadline=None)
@given(st.lists(piece, max_size=8), st.data())
def test_both_event_ends_agree_with_find(pieces: list[bytes], data: st.DataObject) -> None:
    buf = b"".join(pieces)
    stop = data.draw(st.integers(0, len(buf)))
    pos = data.draw(st.integers(0, stop))
    want = buf[:stop].find(b"\n\n", pos)
    assert sse_scan.reference_end(buf, pos, stop) == want
    assert sse_scan.event_end(buf, pos, stop) == want


# -- event facts: the C reader against orjson ------------------------------------------------------

@dataclass(frozen=True)
class Obj:
    members: list[tuple[str, object]]  # in order, duplicates allowed (the last one wins, as in orjson)


def obj(members: list[tuple[str, Any]]) -> Obj:
    return Obj(members)


KEYS = st.sampled_from(["choices", "delta", "content", "text", "reasoning", "reasoning_content", "tool_calls",
                        "usage", "error", "object", "model", "index", "role"]) | st.text(max_size=3)
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
           | st.sampled_from(["", "error", "x", "é", "\u2028", "日本", "😀", "a\"b", "\\", "\x7f"])
           | st.text(max_size=4))
VALUES = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=3)
                      | st.lists(st.tuples(KEYS, kids), max_size=4).map(obj), max_leaves=16)
SIMPLE = st.sampled_from(["", "x", "é", 0, 1, -7, None, True, False, 0.0, -0.0, 0.5, [], [0], Obj([]), Obj([("a", 0)])])
DELTA = st.lists(st.tuples(st.sampled_from(["content", "reasoning_content", "reasoning", "tool_calls", "role"]),
                           SIMPLE), max_size=3).map(obj)
CHOICE = st.lists(st.one_of(st.tuples(st.just("delta"), DELTA | SIMPLE), st.tuples(st.just("text"), SIMPLE),
                            st.tuples(st.sampled_from(["index", "finish_reason"]), SIMPLE | VALUES)),
                  max_size=4).map(obj)
COUNT = st.integers(-3, 3) | st.sampled_from([2**62, 1.0, True, None, "3"])
DETAILS = st.lists(st.tuples(st.sampled_from(["cached_tokens", "x"]), COUNT), max_size=2).map(obj)
USAGE = st.lists(st.one_of(st.tuples(st.sampled_from(["prompt_tokens", "completion_tokens", "total_tokens",
                                                      "input_tokens", "output_tokens"]), COUNT),
                           st.tuples(st.sampled_from(["prompt_tokens_details", "input_tokens_details"]),
                                     DETAILS | SIMPLE)), max_size=6).map(obj)
CHUNKS = st.lists(st.one_of(st.tuples(st.just("choices"), st.lists(CHOICE | SIMPLE, max_size=3) | SIMPLE),
                            st.tuples(st.just("usage"), USAGE | SIMPLE),
                            st.tuples(st.sampled_from(["object", "error", "usage"]), st.sampled_from(["error", "x"])
                                      | SIMPLE),
                            st.tuples(KEYS, VALUES)), max_size=5).map(obj)
MEMBERS = st.lists(st.tuples(KEYS, SIMPLE), max_size=2)
CHOICE_CHUNKS = st.builds(lambda pre, choices, post: Obj([*pre, ("choices", choices), *post]),
                          MEMBERS, st.lists(CHOICE, min_size=1, max_size=3), MEMBERS)


def dump(value: object, space: str, ascii_only: bool) -> str:
    if isinstance(value, Obj):
        inner = f",{space}".join(f"{json.dumps(k, ensure_ascii=ascii_only)}{space}:{space}{dump(v, space, ascii_only)}"
                                 for k, v in value.members)
        return "{" + space + inner + space + "}"
    if isinstance(value, list):
        return "[" + f",{space}".join(dump(v, space, ascii_only) for v in value) + "]"
    return json.dumps(value, ensure_ascii=ascii_only)


def check_facts(body: bytes) -> None:
    want = sse_scan.reference_facts(body, 0, len(body))
    got = sse_scan.event_facts(body, 0, len(body))
    assert got is None or got == want, (body, got, want)  # never a wrong answer, only "not sure"
    if want is None:
        assert got is None, body


@native
@settings(max_examples=1500, deadline=None)
@given(CHOICE_CHUNKS | CHUNKS | VALUES, st.sampled_from(["", " ", "\n\t ", "\r\n"]), st.booleans())
def test_event_facts_are_orjsons_wherever_the_c_reader_answers(value: object, space: str, ascii_only: bool) -> None:
    check_facts(dump(value, space, ascii_only).encode("utf-8", "surrogatepass"))


MUTANTS = st.sampled_from([b"", b"\\", b'"', b"{", b"}", b"[", b"]", b",", b":", b"0", b"-", b"e", b".", b"\x00",
                           b"\xff", b"\xc3", b"\xed\xa0\x80", b"\\ud800", b"\\u00e9", b"tru", b"nul", b"\x0c"])


@native
@settings(max_examples=1500, deadline=None)
@given(CHOICE_CHUNKS | CHUNKS,
       st.lists(st.tuples(st.integers(0, 10_000), st.integers(0, 2), MUTANTS), min_size=1, max_size=3))
def test_event_facts_are_orjsons_on_broken_json(value: object, edits: list[tuple[int, int, bytes]]) -> None:
    body = dump(value, "", False).encode("utf-8", "surrogatepass")
    for at, cut, insert in edits:
        at %= len(body) + 1
        body = body[:at] + insert + body[at + cut:]
    check_facts(body)


@native
@pytest.mark.parametrize("body", [
    b'{"choices":[{"delta":{"content":"x"}}],"cho\\u0069ces":[]}',  # an escaped key that orjson reads as `choices`
    b'{"choices":[{"text":1e400}]}',  # infinity: orjson refuses it
    b'{"choices":[{"text":1e-400}]}',  # 0.0: false
    b'{"choices":[{"text":"\\ud83d\\ude00"}]}',  # a surrogate pair
    b'{"a":' + b"[" * 70 + b"]" * 70 + b"}",  # deep
    b'{"choices":[{"text":123456789012345678901234}]}',
])
def test_what_the_c_reader_is_not_sure_of_goes_to_orjson(body: bytes) -> None:
    assert sse_scan.event_facts(body, 0, len(body)) is None


def capture_events(name: str) -> list[bytes]:
    return [e for e in response(name).body.split(b"\n\n") if e.startswith(b"data: ")]


@native
@pytest.mark.parametrize("name", ["chat_stream.txt", "chat_stream_usage.txt", "chat_stream_n2.txt",
                                  "chat_stream_continuous_usage.txt", "completions_stream_usage.txt"])
def test_the_c_reader_answers_for_every_chunk_a_real_vllm_sends(name: str) -> None:
    for event in capture_events(name):
        if event != b"data: [DONE]":
            got = sse_scan.event_facts(event, 6, len(event))
            assert got is not None, event
            assert got == sse_scan.reference_facts(event, 6, len(event)), event


# -- whole streams, relayed by both walks ----------------------------------------------------------

HEAD = b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"tiny-moe",'
TEXTS = st.sampled_from(["hi", " the", "", "\\n\\n", "\\\"", "é", "日本語", "x" * 70, "a\\\\", "\\u00e9"])


def chunk(choices: str, rest: str = "") -> bytes:
    return HEAD + b'"choices":[' + choices.encode() + b"]" + rest.encode() + b"}\n\n"


EVENTS = st.one_of(
    TEXTS.map(lambda t: chunk(f'{{"index":0,"delta":{{"content":"{t}"}},"logprobs":null,"finish_reason":null}}')),
    TEXTS.map(lambda t: chunk(f'{{"index":0,"delta":{{"content":"{t}"}},"finish_reason":"stop"}}')),
    st.just(chunk('{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}')),
    TEXTS.map(lambda t: chunk(f'{{"index":0,"text":"{t}","finish_reason":null}}')),  # completions
    TEXTS.map(lambda t: chunk(f'{{"index":0,"delta":{{"content":"{t}"}}}},{{"index":1,"delta":{{"content":"y"}}}}')),
    st.just(chunk('{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{}"}}]}}')),
    st.just(chunk('{"index":0,"delta":{"reasoning_content":"hmm"}}')),
    TEXTS.map(lambda t: chunk(f'{{"index":0,"delta":{{"content":"{t}"}}}}',
                              ',"usage":{"prompt_tokens":3,"total_tokens":4,"completion_tokens":1}')),
    st.just(chunk("", ',"usage":{"prompt_tokens":7,"total_tokens":10,"completion_tokens":3,'
                      '"prompt_tokens_details":{"cached_tokens":4}}')),
    st.sampled_from([chunk("", ',"usage":null'), chunk("", ',"usage":{"prompt_tokens":5,"total_tokens":5}'),
                     chunk("", ',"usage":{"input_tokens":5,"output_tokens":2,'
                               '"input_tokens_details":{"cached_tokens":1}}'),
                     chunk("", ',"usage":{"prompt_tokens":5,"completion_tokens":1.0}'),
                     chunk('{"index":0,"delta":{}}', ',"usage":{"prompt_tokens":9,"completion_tokens":0}')]),
    st.just(b'data: {"id":"c1","choices":[{"index":0,"delta":{"content":"x"}}],"model":"tiny-moe"}\n\n'),
    st.just(b'data: {"error":{"message":"boom","type":"InternalServerError","code":500}}\n\n'),
    st.just(b'data: {"object":"error","message":"bad","type":"BadRequestError"}\n\n'),
    st.just(b'data: {"error":"plain"}\n\n'),
    st.sampled_from([b": keep-alive\n\n", b"event: ping\n\n", b"data: not json\n\n", b"data: [1,2]\n\n",
                     b"data:\n\n", b'data: {"model":"tiny-moe"}\ndata: {}\n\n', b"\n",
                     b'data: {"cho\\u0069ces":[{"delta":{"content":"x"}}],"model":"tiny-moe"}\n\n']),
    st.sampled_from([b"data: [DONE]\n\n", b"data:[DONE]\n\n", b"data:  [DONE] \n\n"]),
)


@native
@settings(max_examples=800, deadline=None)
@given(st.lists(EVENTS, min_size=1, max_size=14), st.lists(st.integers(1, 4000), max_size=4),
       st.booleans(), st.booleans(), st.booleans())
def test_both_walks_relay_every_stream_the_same(events: list[bytes], cuts: list[int], rename: bool,
                                                include_usage: bool, crlf: bool) -> None:
    stream = b"".join(events)
    if crlf:
        stream = stream.replace(b"\n", b"\r\n")
    marks = sorted({c % len(stream) for c in cuts} | {0, len(stream)})
    reads = [stream[a:b] for a, b in pairwise(marks) if b > a]
    relays = [SseRelay(backend_model="tiny-moe", client_model="moe" if rename else "tiny-moe",
                       include_usage=include_usage, run=run)
              for run in (sse_scan.reference_relay_run, sse_scan.relay_run)]
    outs = [b"".join(r.feed(data, float(i)) for i, data in enumerate(reads)) + r.close(99.0) for r in relays]
    assert outs[0] == outs[1]
    ref, c = (r.stats for r in relays)
    assert (c.tokens, c.usage, c.done, c.error, c.first_token_at, c.last_token_at) == (
        ref.tokens, ref.usage, ref.done, ref.error, ref.first_token_at, ref.last_token_at)
    assert (c.gaps.count, c.gaps.sum) == (ref.gaps.count, ref.gaps.sum)


@native
def test_the_c_walk_relays_a_real_stream_whole() -> None:
    """A real vLLM stream in one read: role, first token (learned), tokens, finish, usage and [DONE]
    are all relayed by the C walk, none left to the general path; the usage chunk is read, and
    dropped when the client did not ask for it."""
    events = capture_events("chat_stream_usage.txt")
    buf = b"\n\n".join(events) + b"\n\n"
    old, new = b'"model":"tiny-moe"', b'"model":"moe"'
    usage_event = next(e for e in events if b'"usage":{' in e) + b"\n\n"
    tokens = sum(1 for e in events if b'"content":"' in e and b'"content":""' not in e)
    for include_usage in (True, False):
        end, piece, n, done, learned, usage = sse_scan.relay_run(buf, 0, len(buf), None, None, None, old, new,
                                                                 MAX_TOKEN_TEXT, include_usage)
        assert (end, n, done) == (len(buf), tokens, True)
        assert learned is not None
        kept = buf if include_usage else buf.replace(usage_event, b"")
        assert piece == kept.replace(old, new)
        facts = sse_scan.reference_facts(usage_event, 6, len(usage_event) - 2)
        assert facts is not None
        assert usage == facts[1]
        assert usage is not None
        assert usage[1] == tokens
    assert learned is not None
    prefix, suffix, client = learned
    done_at = buf.index(b"data: [DONE]")  # with the prefix learned, and nothing to rename: nothing changes
    assert sse_scan.relay_run(buf, done_at, len(buf), prefix, suffix, client, None, None, MAX_TOKEN_TEXT, True) == (
        len(buf), None, 0, True, None, None)


def test_the_build_runs_the_c_walk_exactly_when_it_is_compiled() -> None:
    assert bool(build_check.compiled()) == sse_scan.NATIVE
    assert (sse_scan.relay_run is sse_scan.reference_relay_run) == (not sse_scan.NATIVE)
    assert (sse_scan.event_end is sse_scan.reference_end) == (not sse_scan.NATIVE)
    assert (sse_scan.event_facts is sse_scan.reference_facts) == (not sse_scan.NATIVE)
    if sse_scan.NATIVE:  # its arguments are checked, not trusted
        with pytest.raises(TypeError, match="must be bytes"):
            sse_scan.relay_run("text", 0, 4, PREFIX, SUFFIX, None, None, None, MAX_TEXT, True)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="pos <= stop"):
            sse_scan.relay_run(b"data", 3, 1, PREFIX, SUFFIX, None, None, None, MAX_TEXT, True)
        with pytest.raises(ValueError, match="old with new"):
            sse_scan.relay_run(b"data", 0, 4, None, None, None, b"a", None, MAX_TEXT, True)
        with pytest.raises(ValueError, match="pos <= stop"):
            sse_scan.event_end(b"data", 3, 1)
        with pytest.raises(ValueError, match="start <= end"):
            sse_scan.event_facts(b"data", 3, 1)
        assert "C: gateway.proxy._sse_scan" in build_check.describe()
