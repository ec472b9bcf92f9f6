"""The Triton Inference Server + TensorRT-LLM backend face (spec 4.2): the KServe v2 generate
extension (`/v2/models/{m}/generate` and `/generate_stream`), v2 health and metadata, and the
metrics page on its own port. Not OpenAI: no chat template, no usage, no `[DONE]`."""

from __future__ import annotations

import time
from typing import Any

import orjson
from aiohttp import web

from backends.emulator import tokenizer
from backends.emulator.context import CONTEXT_KEY, FaceContext
from backends.emulator.openai_common import SSE_CONTENT_TYPE, BodyError, Died, parse_body, stop_list, stream_tokens
from backends.emulator.triton_metrics import CONTENT_TYPE, TritonMetrics

VERSION = "2.59.0"
METRICS_KEY = web.AppKey("triton_metrics", TritonMetrics)
INPUTS = {
    "text_input", "max_tokens", "decoder_text_input", "num_return_sequences", "bad_words", "stop_words",
    "exclude_input_in_output", "end_id", "pad_id", "top_k", "top_p", "temperature", "length_penalty",
    "repetition_penalty", "min_tokens", "presence_penalty", "frequency_penalty", "seed", "return_log_probs",
    "return_context_logits", "return_generation_logits", "return_perf_metrics", "return_num_input_tokens",
    "return_num_output_tokens", "beam_width", "stream", "prompt_embedding_table", "prompt_vocab_size",
    "prompt_table_extra_id", "embedding_bias_words", "embedding_bias_weights", "lora_task_id", "lora_weights",
    "lora_config", "guided_decoding_guide_type", "guided_decoding_guide",
}


def _parameter_error(body: dict[str, Any], *, nested: bool = False) -> str | None:
    """Triton's generate conversion (`src/http_server.cc` `ConvertGenerateRequest`): a key naming a
    model input becomes a tensor; any other key becomes a request *parameter*, which the model simply
    ignores when it is a string, number or bool, and which is refused otherwise. So OpenAI-only
    fields like `logprobs: true` or `n: 2` are accepted and ignored, while `tools`, `messages` or
    `response_format` (arrays, objects) are a 400. `parameters` is converted the same way, in order."""
    for key, value in body.items():
        if key == "parameters" and not nested and isinstance(value, dict):
            inner = _parameter_error(value, nested=True)
            if inner is not None:
                return f"Converting keyword: 'parameters': {inner}"
        elif key not in INPUTS and not isinstance(value, str | int | float | bool):
            return f"parameter '{key}' has invalid type. It should be either 'int', 'bool', or 'string'."
    return None


def _error(message: str, status: int = 400) -> web.Response:
    return web.Response(body=orjson.dumps({"error": message}), status=status, content_type="application/json")


def _dump(payload: dict[str, Any]) -> bytes:
    return orjson.dumps(payload, option=orjson.OPT_SORT_KEYS)


async def generate(request: web.Request) -> web.StreamResponse:
    ctx, metrics = request.app[CONTEXT_KEY], request.app[METRICS_KEY]
    stream = request.path.endswith("/generate_stream")
    model = request.match_info["model"]
    ctx.stats.requests_received += 1
    if model != ctx.model:
        return _error(f"Request for unknown model: '{model}' is not found")
    try:
        body = parse_body(await request.read())
    except BodyError as exc:
        return _error(f"failed to parse the request JSON buffer: {exc}")
    params = body.get("parameters")
    inputs = {**(params if isinstance(params, dict) else {}), **{k: v for k, v in body.items() if k != "parameters"}}
    refused = _parameter_error(body)
    if refused is not None:
        return _error(refused)
    for key in ("text_input", "max_tokens"):
        if key not in inputs:
            return _error(f"[request id: <id_unknown>] expected 1 inputs but got 0 inputs for model '{model}'. "
                          f"Got input(s) [], but missing required input(s) ['{key}']. Please provide all required "
                          "input(s).")
    if not ctx.gate.ready():
        ctx.stats.rejected_not_ready += 1
        return _error(f"Request for unknown model: '{model}' has no available versions", 503)
    status = ctx.gate.injected_failure()
    if status is not None:
        ctx.stats.failed_injected += 1
        metrics.on_failure()
        return _error("Injected failure", status)
    if ctx.gate.queue_full(ctx.snapshot().waiting):
        ctx.stats.rejected_queue_full += 1
        metrics.on_failure()
        return _error("Exceeds maximum queue size", 503)
    text_input = str(inputs["text_input"])
    prompt = tokenizer.encode(text_input)
    if len(prompt) >= ctx.config.max_model_len:
        return _error(f"Prompt length ({len(prompt)}) exceeds maximum input length ({ctx.config.max_model_len}).")
    try:
        requested = int(inputs["max_tokens"])
    except (TypeError, ValueError):
        return _error(f"[request id: <id_unknown>] unable to parse input 'max_tokens' for model '{model}': "
                      f"expected INT32, got {inputs['max_tokens']!r}")
    max_tokens = max(1, min(requested, ctx.config.max_model_len - len(prompt)))
    stops = [s for s in stop_list(inputs.get("stop_words")) if s]
    plan = ctx.plans(1, max_tokens=max_tokens, stop=stops)[0]
    exclude = bool(inputs.get("exclude_input_in_output", False))
    want_in, want_out = bool(inputs.get("return_num_input_tokens")), bool(inputs.get("return_num_output_tokens"))

    def payload(text: str, n_out: int) -> dict[str, Any]:
        p: dict[str, Any] = {"context_logits": 0.0, "cum_log_probs": 0.0, "generation_logits": 0.0,
                             "model_name": model, "model_version": "1",
                             "output_log_probs": [0.0] * n_out if n_out != 1 else 0.0, "sequence_end": False,
                             "sequence_id": 0, "sequence_start": False, "text_output": text}
        if "id" in body:
            p["id"] = str(body["id"])  # Triton echoes the request id
        if want_in:
            p["num_input_tokens"] = len(prompt)
        if want_out:
            p["num_output_tokens"] = n_out
        return p

    gen = ctx.start(prompt, [plan])
    try:
        if not stream:
            pieces = [tok.piece async for tok in gen.tokens()]
            text = "".join(pieces) if exclude else text_input + "".join(pieces)
            return web.Response(body=_dump(payload(text, len(pieces))), content_type="application/json")
        resp = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
        await resp.prepare(request)
        try:
            async for tok in stream_tokens(ctx, request, gen, resp=resp, on_error_event=_injected_error, trailer=b""):
                await resp.write(b"data: " + _dump(payload(tok.piece, 1)) + b"\n\n")
            await resp.write_eof()
        except (Died, ConnectionResetError):
            pass  # Triton sends no sentinel: the stream just ends (or the connection was dropped)
        return resp
    finally:
        gen.abort()


def _injected_error() -> bytes:
    return b"data: " + orjson.dumps({"error": "Injected mid-stream failure"}) + b"\n\n"


async def live(request: web.Request) -> web.Response:
    return web.Response(status=200)


async def ready(request: web.Request) -> web.Response:
    # Triton answers 400 (not 503) when not ready, with an empty body.
    return web.Response(status=200 if request.app[CONTEXT_KEY].gate.ready() else 400)


async def model_ready(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    ok = request.match_info["model"] == ctx.model and ctx.gate.ready()
    return web.Response(status=200 if ok else 400)


async def server_meta(request: web.Request) -> web.Response:
    return web.Response(body=orjson.dumps({"name": "triton", "version": VERSION, "extensions": [
        "classification", "sequence", "model_repository", "model_repository(unload_dependents)", "schedule_policy",
        "model_configuration", "system_shared_memory", "cuda_shared_memory", "binary_tensor_data", "parameters",
        "statistics", "trace", "logging", "generate"]}), content_type="application/json")


async def model_meta(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    model = request.match_info["model"]
    if model != ctx.model:
        return _error(f"Request for unknown model: '{model}' is not found")
    return web.Response(body=orjson.dumps({
        "name": model, "versions": ["1"], "platform": "ensemble",
        "inputs": [{"name": "text_input", "datatype": "BYTES", "shape": [-1, 1]},
                   {"name": "max_tokens", "datatype": "INT32", "shape": [-1, 1]}],
        "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [-1, -1]}]}), content_type="application/json")


async def metrics_page(request: web.Request) -> web.Response:
    ctx = request.app[CONTEXT_KEY]
    body = request.app[METRICS_KEY].render(ctx.snapshot(), now_us=int(time.time() * 1e6))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE})


def build_apps(ctx: FaceContext, metrics: TritonMetrics) -> tuple[web.Application, web.Application]:
    app = web.Application()
    app[CONTEXT_KEY] = ctx
    app[METRICS_KEY] = metrics
    for base in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        app.router.add_post(base + "/generate", generate)
        app.router.add_post(base + "/generate_stream", generate)
        app.router.add_get(base + "/ready", model_ready)
        app.router.add_get(base, model_meta)
    app.router.add_get("/v2/health/live", live)
    app.router.add_get("/v2/health/ready", ready)
    app.router.add_get("/v2", server_meta)
    mapp = web.Application()
    mapp[CONTEXT_KEY] = ctx
    mapp[METRICS_KEY] = metrics
    mapp.router.add_get("/metrics", metrics_page)
    return app, mapp
