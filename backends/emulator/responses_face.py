"""`POST /v1/responses` (and `GET /v1/responses/{id}`) for the vLLM, SGLang and trtllm-serve faces.

One handler, parameterised by the face's `ResponsesHooks` (its error bodies, admission checks and
dialect, see `responses_render`). The request goes through the same engine as chat (queueing,
prefix cache, timing): it is rendered to chat messages (`responses_api`), tokenized with the same
template, and its tokens are streamed as `response.output_text.delta` events (or function-call
argument deltas for a forced tool call) as the engine produces them.

Stored responses: SGLang and trtllm-serve keep responses by default (`store: true`), so
`previous_response_id` continues a stored conversation and `GET /v1/responses/{id}` returns it;
vLLM only does with `VLLM_ENABLE_RESPONSES_API_STORE=1`, which the emulator does not set, so both
answer vLLM's 404 `Response with id '...' not found.`.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from backends.emulator import responses_render as RR
from backends.emulator import vllm_pd
from backends.emulator.context import CONTEXT_KEY, FaceContext, Generation
from backends.emulator.openai_common import SSE_CONTENT_TYPE, BodyError, Died, json_response, parse_body, stream_tokens
from backends.emulator.responses_api import InputError, ResponsesCall, read_call
from backends.emulator.structured import ShapeError, ToolCallLayout, ToolCallStream, hermes_layout, json_array_layout
from backends.emulator.textgen import OutputPlan

STORE_CAPACITY = 64  # responses kept for previous_response_id (trtllm-serve keeps 16; SGLang is unbounded)


@dataclass(slots=True)
class _Stored:
    response: dict[str, Any]
    messages: list[dict[str, Any]]  # the whole conversation including this response's output


class ResponseStore:
    """A bounded LRU of stored responses (per emulator; cleared by a restart, as in the runtimes)."""

    def __init__(self, capacity: int = STORE_CAPACITY) -> None:
        self._items: OrderedDict[str, _Stored] = OrderedDict()
        self._capacity = capacity

    def put(self, rid: str, response: dict[str, Any], messages: list[dict[str, Any]]) -> None:
        self._items[rid] = _Stored(response, messages)
        self._items.move_to_end(rid)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def get(self, rid: str) -> _Stored | None:
        item = self._items.get(rid)
        if item is not None:
            self._items.move_to_end(rid)
        return item

    def pop(self, rid: str) -> bool:
        return self._items.pop(rid, None) is not None


Reject = Callable[[int, str, str, str | None], web.Response]  # (status, message, type, param)


@dataclass(frozen=True, slots=True)
class ResponsesHooks:
    """What differs per runtime around the shared handler."""

    dialect: RR.Dialect
    reject: Reject
    invalid_body: Callable[[BodyError], web.Response]
    missing_input: Callable[[dict[str, Any]], web.Response]
    admit: Callable[[FaceContext], web.Response | None]
    model: Callable[[FaceContext, dict[str, Any]], str | web.Response]
    limits: Callable[[FaceContext, ResponsesCall], web.Response | None]
    on_submit: Callable[[Generation, ResponsesCall, int], None] = lambda gen, call, max_tokens: None
    unknown_field: Callable[[str, dict[str, Any]], web.Response] | None = None  # trtllm: extra="forbid"
    invalid_shape: Callable[[ShapeError], web.Response] | None = None  # default: reject(400, message)
    allowed_fields: frozenset[str] = frozenset()
    store: ResponseStore | None = None
    max_tokens_headroom: int = 0  # SGLang keeps 2 tokens of headroom off max_output_tokens
    extra: dict[str, Any] = field(default_factory=dict)


def _layout(hooks: ResponsesHooks, call: ResponsesCall) -> ToolCallLayout | None:
    tool = call.shape.tool
    if tool is None:
        return None
    args = call.shape.json_text()
    return json_array_layout(tool.name, args) if hooks.dialect is RR.Dialect.SGLANG else hermes_layout(tool.name, args)


def _previous(hooks: ResponsesHooks, prev: Any) -> list[dict[str, Any]] | web.Response:
    if prev is None:
        return []
    prev = str(prev)
    if hooks.dialect is RR.Dialect.TRTLLM and not prev.startswith("resp"):
        return hooks.reject(400, f"Invalid 'response_id': '{prev}'. Expected an ID that begins with 'resp'.",
                            "InvalidRequestError", None)
    stored = hooks.store.get(prev) if hooks.store is not None else None
    if stored is None:
        err_type = "InvalidRequestError" if hooks.dialect is RR.Dialect.TRTLLM else "invalid_request_error"
        param = None if hooks.dialect is RR.Dialect.TRTLLM else "response_id"
        return hooks.reject(404, f"Response with id '{prev}' not found.", err_type, param)
    return list(stored.messages)


async def create(request: web.Request, hooks: ResponsesHooks) -> web.StreamResponse:
    ctx = request.app[CONTEXT_KEY]
    ctx.stats.requests_received += 1
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return hooks.invalid_body(exc)
    if hooks.unknown_field is not None:
        for key in body:
            if key not in hooks.allowed_fields:
                return hooks.unknown_field(key, body)
    if "input" not in body:
        return hooks.missing_input(body)
    model = hooks.model(ctx, body)
    if isinstance(model, web.Response):
        return model
    history = _previous(hooks, body.get("previous_response_id"))
    if isinstance(history, web.Response):
        return history
    try:
        call = read_call(body, history=history)
    except ShapeError as exc:
        if hooks.invalid_shape is not None:
            return hooks.invalid_shape(exc)
        return hooks.reject(400, str(exc), "invalid_request_error", exc.param)
    except InputError as exc:
        return hooks.reject(400, str(exc), "invalid_request_error", exc.param)
    refused = hooks.limits(ctx, call) or hooks.admit(ctx)
    if refused is not None:
        return refused
    room = ctx.config.max_model_len - len(call.prompt)
    requested = call.max_output_tokens
    max_tokens = None if requested is None else max(1, min(requested, room) - hooks.max_tokens_headroom)
    layout = _layout(hooks, call)
    text = layout.text if layout is not None else call.shape.json_text() if call.shape.kind == "json" else None
    plan = ctx.plans(1, max_tokens=max_tokens, text=text)[0]
    chosen, external, produce = ctx.choose_rank(None), 0, False
    if hooks.dialect is RR.Dialect.VLLM:  # vLLM's Responses take kv_transfer_params too (P/D legs)
        kv_params = body.get("kv_transfer_params")
        try:
            external = await vllm_pd.load_external(ctx, chosen, call.prompt, kv_params)
        except vllm_pd.LoadFailed as exc:
            return hooks.reject(500, f"KV load failed: {exc}", "InternalServerError", None)
        produce = vllm_pd.wants_remote_decode(ctx, kv_params)
    gen = ctx.start(call.prompt, [plan], chosen=chosen, external_tokens=external)
    hooks.on_submit(gen, call, max_tokens if max_tokens is not None else room)
    run = _Run(ctx, hooks, call, model, layout, plan, echoed_max=max_tokens if max_tokens is not None else room)
    run.produce = produce
    try:
        if call.stream:
            return await run.stream(request, gen)
        return await run.complete(request, gen)
    finally:
        gen.abort()
        if hooks.dialect is RR.Dialect.VLLM and gen.finished[0] is not None:
            vllm_pd.store_shared(ctx, call.prompt)


class _Run:
    """One Responses request in flight: ids, output accumulation, and the final object."""

    def __init__(
        self, ctx: FaceContext, hooks: ResponsesHooks, call: ResponsesCall, model: str,
        layout: ToolCallLayout | None, plan: OutputPlan, *, echoed_max: int,
    ) -> None:
        self.ctx, self.hooks, self.call, self.model, self.layout, self.plan = ctx, hooks, call, model, layout, plan
        self.d = hooks.dialect
        self.rid = RR.response_id(self.d, ctx.hex_id)
        self.msg_id, self.fc_id, self.call_id = RR.item_ids(self.d, ctx.hex_id)
        self.created_at = int(time.time())
        self.echoed_max = echoed_max
        self.pieces: list[str] = []
        self.seq = 0
        self.produce = False  # a vLLM prefill-only leg: keep the KV, answer its kv_transfer_params

    def _created_cache(self, cached: int) -> int:
        bs = self.ctx.params.block_size
        return max(0, (len(self.call.prompt) // bs) * bs - cached)

    def _output(self, status_item: str) -> list[dict[str, Any]]:
        """A complete forced call is a function_call item; a call cut short is not parsed, and the
        raw text comes back as a message (as vLLM does when its tool parser finds no call)."""
        text = "".join(self.pieces)
        if self.layout is not None and self.layout.complete(len(text)):
            return [RR.function_item(self.fc_id, self.call_id, self.layout.name, self.layout.arguments, "completed")]
        return [RR.message_item(self.msg_id, [RR.output_text(text, logprobs=None)], status_item)]

    def _final(self, gen: Generation, *, item_status: str = "completed") -> dict[str, Any]:
        status = "incomplete" if self.plan.finish_reason == "length" else "completed"
        use = RR.usage(self.d, len(self.call.prompt), len(self.pieces), gen.cached_tokens,
                       self._created_cache(gen.cached_tokens))
        body = RR.response_object(
            self.d, rid=self.rid, created_at=self.created_at, model=self.model, body=self.call.body,
            output=self._output(item_status), status=status, use=use, max_output_tokens=self.echoed_max)
        fin = gen.finished[0]
        if self.produce and fin is not None and fin.reason == "length":
            self.produce = False  # once per request
            body["kv_transfer_params"] = vllm_pd.produced_params(
                self.ctx, gen.rank, f"{self.rid}-{self.ctx.hex_id(8)}", self.call.prompt)
        if self.hooks.store is not None and self.call.body.get("store", True) is not False:
            said = "".join(self.pieces)
            self.hooks.store.put(self.rid, body, [*self.call.messages, {"role": "assistant", "content": said}])
        return body

    async def complete(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        try:
            async for tok in stream_tokens(self.ctx, request, gen):
                self.pieces.append(tok.piece)
        except Died:
            return web.Response(status=500)
        return json_response(self._final(gen))

    def _event(self, payload: dict[str, Any]) -> bytes:
        """Numbered in order; each payload lists `sequence_number` where the SDK type declares it."""
        payload["sequence_number"] = self.seq
        self.seq += 1
        return RR.sse(payload)

    def _response_event(self, kind: str, response: dict[str, Any]) -> bytes:
        return self._event({"response": response, "sequence_number": None, "type": kind})

    async def stream(self, request: web.Request, gen: Generation) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await resp.prepare(request)
        initial = RR.response_object(self.d, rid=self.rid, created_at=self.created_at, model=self.model,
                                     body=self.call.body, output=[], status="in_progress", use=None,
                                     max_output_tokens=self.echoed_max)
        await resp.write(self._response_event("response.created", initial))
        await resp.write(self._response_event("response.in_progress", initial))
        tracker = ToolCallStream(self.layout) if self.layout is not None else None
        opened = False
        try:
            async for tok in stream_tokens(self.ctx, request, gen, on_error_event=self._error_event, resp=resp,
                                           trailer=b""):
                self.pieces.append(tok.piece)
                if tracker is not None:
                    for chunk in self._tool_events(tracker, tok.piece):
                        await resp.write(chunk)
                    continue
                if not opened:
                    opened = True
                    await resp.write(self._event({"item": RR.message_item(self.msg_id, [], "in_progress"),
                                                  "output_index": 0, "sequence_number": None,
                                                  "type": "response.output_item.added"}))
                    await resp.write(self._event({"content_index": 0, "item_id": self.msg_id, "output_index": 0,
                                                  "part": RR.output_text("", logprobs=[]), "sequence_number": None,
                                                  "type": "response.content_part.added"}))
                await resp.write(self._event({"content_index": 0, "delta": tok.piece, "item_id": self.msg_id,
                                              "logprobs": [], "output_index": 0, "sequence_number": None,
                                              "type": "response.output_text.delta"}))
            status = "incomplete" if self.plan.finish_reason == "length" else "completed"
            item_status = status if self.d is RR.Dialect.SGLANG else "completed"
            if tracker is not None:
                for chunk in self._tool_done(tracker):
                    await resp.write(chunk)
            elif opened:
                for chunk in self._text_done(item_status):
                    await resp.write(chunk)
            final = self._final(gen, item_status=item_status)
            await resp.write(self._response_event(RR.final_event_type(self.d, final["status"]), final))
            await resp.write_eof()
        except (Died, ConnectionResetError):
            pass
        return resp

    def _text_done(self, item_status: str) -> list[bytes]:
        text = "".join(self.pieces)
        part = RR.output_text(text, logprobs=None)
        return [
            self._event({"content_index": 0, "item_id": self.msg_id, "logprobs": [], "output_index": 0,
                         "sequence_number": None, "text": text, "type": "response.output_text.done"}),
            self._event({"content_index": 0, "item_id": self.msg_id, "output_index": 0, "part": part,
                         "sequence_number": None, "type": "response.content_part.done"}),
            self._event({"item": RR.message_item(self.msg_id, [part], item_status), "output_index": 0,
                         "sequence_number": None, "type": "response.output_item.done"}),
        ]

    def _tool_events(self, tracker: ToolCallStream, piece: str) -> list[bytes]:
        assert self.layout is not None
        name_now, fragment = tracker.feed(piece)
        out = []
        if name_now:
            item = RR.function_item(self.fc_id, self.call_id, self.layout.name, "", "in_progress")
            out.append(self._event({"item": item, "output_index": 0, "sequence_number": None,
                                    "type": "response.output_item.added"}))
        if fragment:
            out.append(self._event({"delta": fragment, "item_id": self.fc_id, "output_index": 0,
                                    "sequence_number": None, "type": "response.function_call_arguments.delta"}))
        return out

    def _tool_done(self, tracker: ToolCallStream) -> list[bytes]:
        assert self.layout is not None
        if not tracker.name_sent:
            return []
        args = tracker.arguments_so_far
        status = "completed" if tracker.complete else "incomplete"
        item = RR.function_item(self.fc_id, self.call_id, self.layout.name, args, status)
        return [
            self._event({"arguments": args, "item_id": self.fc_id, "output_index": 0, "sequence_number": None,
                         "type": "response.function_call_arguments.done", "name": self.layout.name}),
            self._event({"item": item, "output_index": 0, "sequence_number": None,
                         "type": "response.output_item.done"}),
        ]

    def _error_event(self) -> bytes:
        # Estimated (not captured): the SDK's ResponseErrorEvent, which makes the SDK raise.
        return self._event({"code": "internal_error", "message": "Internal server error", "param": None,
                            "sequence_number": None, "type": "error"})


async def retrieve(request: web.Request, hooks: ResponsesHooks) -> web.Response:
    rid = request.match_info["response_id"]
    stored = hooks.store.get(rid) if hooks.store is not None else None
    if stored is None:
        err = _previous(hooks, rid)
        assert isinstance(err, web.Response)
        return err
    return json_response(stored.response)


async def delete(request: web.Request, hooks: ResponsesHooks) -> web.Response:
    """trtllm-serve's `DELETE /v1/responses/{id}`."""
    rid = request.match_info["response_id"]
    if hooks.store is None or not hooks.store.pop(rid):
        err = _previous(hooks, rid)
        assert isinstance(err, web.Response)
        return err
    return json_response({"id": rid, "object": "response", "deleted": True})


class Endpoints:
    """The Responses handlers bound to one runtime's hooks, for `app.router` (each face registers
    the ones its runtime serves)."""

    __slots__ = ("hooks",)

    def __init__(self, hooks: ResponsesHooks) -> None:
        self.hooks = hooks

    async def create(self, request: web.Request) -> web.StreamResponse:
        return await create(request, self.hooks)

    async def retrieve(self, request: web.Request) -> web.Response:
        return await retrieve(request, self.hooks)

    async def delete(self, request: web.Request) -> web.Response:
        return await delete(request, self.hooks)
