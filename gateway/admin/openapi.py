"""The gateway's OpenAPI 3.1 description, served at `GET /openapi.json` (and fuzzed by schemathesis).

It documents what the gateway itself checks (the parts of OpenAI's schema it routes and accounts on)
and every status it may answer with; everything else in a request is forwarded to the backend.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from .. import json_codec
from ..proxy.request import MAX_N, MAX_TOKENS

_ERROR = {"$ref": "#/components/schemas/Error"}


def _errors(*statuses: int) -> dict[str, Any]:
    text = {400: "invalid request", 401: "missing or invalid API key", 404: "unknown model",
            403: "refused (admin without a token: a Host other than localhost or an IP address)",
            408: "request not received in time", 413: "body too large", 429: "rate limited (Retry-After)",
            431: "request line, a header field or the header section too large",
            502: "backend answered garbage", 503: "no healthy backend (Retry-After)", 504: "backend timed out"}
    return {str(s): {"description": text.get(s, "error"),
                     "content": {"application/json": {"schema": _ERROR}}} for s in statuses}


_GEN_ERRORS = (400, 401, 404, 408, 413, 429, 431, 502, 503, 504)


def _post(operation: str, schema: str, description: str, *, streams: bool = False) -> dict[str, Any]:
    content: dict[str, Any] = {"application/json": {"schema": {"$ref": "#/components/schemas/Object"}}}
    if streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"post": {
        "operationId": operation,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{schema}"}}}},
        "responses": {"200": {"description": description, "content": content}, **_errors(*_GEN_ERRORS)},
    }}
_COMMON = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": ["boolean", "null"]},
    "stream_options": {"type": ["object", "null"], "properties": {"include_usage": {"type": "boolean"}}},
    "n": {"type": "integer", "minimum": 1, "maximum": MAX_N},
    "max_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
}

DOCUMENT: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "MoE inference gateway", "version": "0.1.0",
             "description": "OpenAI-compatible gateway; every error has OpenAI's error shape."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        "schemas": {
            "Error": {
                "type": "object", "required": ["error"],
                "properties": {"error": {
                    "type": "object", "required": ["message", "type", "param", "code"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "integer", "null"]}},
                }},
            },
            "ChatRequest": {
                "type": "object", "required": ["model", "messages"],
                "properties": {**_COMMON, "messages": {
                    "type": "array", "minItems": 1, "maxItems": 4,
                    "items": {"type": "object", "required": ["role", "content"],
                              "properties": {"role": {"enum": ["system", "user", "assistant"]},
                                             "content": {"type": "string", "maxLength": 200}}},
                }},
            },
            "CompletionRequest": {
                "type": "object", "required": ["model", "prompt"],
                "properties": {**_COMMON, "prompt": {"type": "string", "minLength": 1, "maxLength": 200}},
            },
            "ResponsesRequest": {
                "type": "object", "required": ["model", "input"],
                "properties": {
                    "model": _COMMON["model"], "stream": _COMMON["stream"],
                    "input": {"type": "string", "minLength": 1, "maxLength": 200},
                    "instructions": {"type": ["string", "null"], "maxLength": 200},
                    "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": MAX_TOKENS},
                    "temperature": _COMMON["temperature"],
                },
            },
            "EmbeddingsRequest": {
                "type": "object", "required": ["model", "input"],
                "properties": {"model": _COMMON["model"], "input": {"type": "string", "minLength": 1, "maxLength": 200},
                               "encoding_format": {"enum": ["float", "base64"]}},
            },
            "TokenizeRequest": {
                "type": "object", "required": ["model", "prompt"],
                "properties": {"model": _COMMON["model"], "add_special_tokens": {"type": "boolean"},
                               "prompt": {"type": "string", "minLength": 1, "maxLength": 200}},
            },
            "DetokenizeRequest": {
                "type": "object", "required": ["model", "tokens"],
                "properties": {"model": _COMMON["model"], "tokens": {
                    "type": "array", "maxItems": 16, "items": {"type": "integer", "minimum": 0, "maximum": 1000}}},
            },
            "Object": {"type": "object"},
        },
    },
    "security": [{"bearer": []}, {}],
    "paths": {
        "/v1/chat/completions": _post("createChatCompletion", "ChatRequest", "completion (JSON or text/event-stream)",
                                      streams=True),
        "/v1/completions": _post("createCompletion", "CompletionRequest", "completion (JSON or text/event-stream)",
                                 streams=True),
        "/v1/responses": _post("createResponse", "ResponsesRequest", "response (JSON or text/event-stream)",
                               streams=True),
        "/v1/embeddings": _post("createEmbedding", "EmbeddingsRequest", "embeddings"),
        "/tokenize": _post("tokenize", "TokenizeRequest", "token ids (vLLM and SGLang shape)"),
        "/detokenize": _post("detokenize", "DetokenizeRequest", "text (vLLM and SGLang shape)"),
        "/v1/models": {"get": {"operationId": "listModels", "responses": {
            "200": {"description": "route models: id, created, owned_by, max_model_len", "content": {
                "application/json": {"schema": {"$ref": "#/components/schemas/Object"}}}}, **_errors(401)}}},
        "/v1/models/{model}": {"get": {
            "operationId": "retrieveModel",
            "parameters": [{"name": "model", "in": "path", "required": True,
                            "schema": {"type": "string", "minLength": 1, "maxLength": 64}}],
            "responses": {"200": {"description": "one route model", "content": {"application/json": {
                "schema": {"$ref": "#/components/schemas/Object"}}}}, **_errors(401, 404)}}},
        "/health": {"get": {"operationId": "health", "security": [{}], "responses": {
            "200": {"description": "the process is up"}}}},
        "/ready": {"get": {"operationId": "ready", "security": [{}], "responses": {
            "200": {"description": "a backend is healthy"}, "503": {"description": "none is"}}}},
        "/admin/backends": {"get": {"operationId": "adminBackends", "responses": {
            "200": {"description": "backend states"}, **_errors(401, 403)}}},
    },
}


async def _serve(request: web.Request) -> web.Response:
    return web.Response(body=_BODY, content_type="application/json")


_BODY = json_codec.dumps(DOCUMENT)


def install_openapi(app: web.Application) -> None:
    app.router.add_get("/openapi.json", _serve)
