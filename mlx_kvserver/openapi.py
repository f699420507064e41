"""A hand-written OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

Limits come from ``schemas`` so the description and the validation cannot drift apart; the fuzz
tests (tests/test_fuzz_api.py) check that every route of the app is described here and generate
requests for every described operation.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from .schemas import MAX_MESSAGE_ID_LEN, MAX_STOP, RANGES, ROLES

try:
    VERSION = importlib.metadata.version("mlx-kvserver")
except importlib.metadata.PackageNotFoundError:  # run from a checkout
    VERSION = "0.1.0"
_ERROR = {"$ref": "#/components/schemas/Error"}


def _number(name: str) -> dict:
    lo, hi, integer = RANGES[name]
    return {"type": "integer" if integer else "number", "minimum": lo, "maximum": hi}


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _errors(*codes: int) -> dict:
    what = {400: "bad input", 401: "missing or wrong API key", 403: "Host or Origin refused",
            404: "no such model, entry or route", 405: "method not allowed",
            413: "body too large", 429: "the queue is full"}
    return {str(c): _json(_ERROR, what[c]) for c in (401, 403, *codes)}


def _op(summary: str, ok: dict, *errors: int, public: bool = False, **extra: Any) -> dict:
    op = {"summary": summary, "responses": {"200": ok, **_errors(*errors)}, **extra}
    if public:
        op["security"] = []
        del op["responses"]["401"]
    return op


_MESSAGE_ID_PATH = {"name": "message_id", "in": "path", "required": True,
                    "schema": {"$ref": "#/components/schemas/MessageId"}}


def openapi_spec(models: list[str] | None = None) -> dict:
    """The OpenAPI document (``models``: names to list as examples of the ``model`` field)."""
    message = {
        "type": "object", "required": ["role"],
        "properties": {
            "role": {"enum": list(ROLES)},
            "content": {"oneOf": [
                {"type": "string"}, {"type": "null"},
                {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"],
                    "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}}]},
            "message_id": {"$ref": "#/components/schemas/MessageId"},
        },
    }
    chat = {
        "type": "object", "required": ["messages"],
        "properties": {
            "messages": {"type": "array", "minItems": 1, "items": message,
                         "description": "the last message must not be an assistant's"},
            "model": {"type": "string", "description": "a served model's name, its index, or "
                                                     "\"default\" (the first one, as when omitted)",
                      **({"examples": models} if models else {})},
            **{name: _number(name) for name in RANGES},
            "seed": {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
            "stop": {"oneOf": [{"type": "string", "minLength": 1},
                               {"type": "array", "maxItems": MAX_STOP,
                                "items": {"type": "string", "minLength": 1}}]},
            "stream": {"type": "boolean"},
            "stream_options": {"type": "object",
                               "properties": {"include_usage": {"type": "boolean"}}},
            "use_kv_cache": {"type": "boolean", "default": True},
        },
    }
    entry = {"type": "object", "properties": {
        "object": {"const": "kv_cache.entry"}, "message_id": {"type": "string"},
        "model": {"type": "string"}, "tokens": {"type": "integer"},
        "in_memory": {"type": "boolean"}, "on_disk": {"type": "boolean"}}}
    anything = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlx-kvserver", "version": VERSION,
                 "description": "OpenAI-compatible chat completions with a paged, persistent "
                                "KV cache keyed by message_id."},
        "servers": [{"url": "/"}],
        "security": [{"bearer": []}],
        "paths": {
            "/health": {"get": _op("liveness, loaded models, queue", _json(anything, "ok"),
                                   public=True)},
            "/openapi.json": {"get": _op("this document", _json(anything, "OpenAPI 3.1"))},
            "/v1/models": {"get": _op("the served models", _json(anything, "a model list"))},
            "/v1/chat/completions": {"post": _op(
                "a chat completion (streamed as server-sent events with stream=true)",
                {"description": "a chat.completion, or an SSE stream of chat.completion.chunk",
                 "content": {"application/json": {"schema": anything},
                             "text/event-stream": {"schema": {"type": "string"}}}},
                400, 404, 413, 429,
                parameters=[{"name": "X-Model-Id", "in": "header", "required": False,
                             "schema": {"type": "string"}}],
                requestBody={"required": True, "content": {"application/json": {
                    "schema": {"$ref": "#/components/schemas/ChatCompletionRequest"}}}})},
            "/v1/kv_cache/stats": {"get": _op("memory and disk tiers per model",
                                              _json(anything, "kv_cache.stats"))},
            "/v1/kv_cache/import": {"post": _op(
                "add an exported entry", _json(entry, "the imported entry"), 400, 404, 413,
                parameters=[
                    {"name": "message_id", "in": "query", "required": False,
                     "schema": {"$ref": "#/components/schemas/MessageId"}},
                    {"name": "model", "in": "query", "required": False,
                     "schema": {"type": "string"}}],
                requestBody={"required": True, "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}})},
            "/v1/kv_cache/export/{message_id}": {"get": _op(
                "one entry's cache as a safetensors file",
                {"description": "the file", "content": {"application/octet-stream": {
                    "schema": {"type": "string", "format": "binary"}}}},
                400, 404, parameters=[_MESSAGE_ID_PATH])},
            "/v1/kv_cache/{message_id}": {
                "get": _op("one entry", _json(entry, "kv_cache.entry"), 400, 404,
                           parameters=[_MESSAGE_ID_PATH]),
                "delete": _op("forget one entry (memory and disk)",
                              _json(anything, "kv_cache.entry.deleted"), 400, 404,
                              parameters=[_MESSAGE_ID_PATH]),
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "only when --api-key is set"}},
            "schemas": {
                "MessageId": {"type": "string", "minLength": 1,
                              "maxLength": MAX_MESSAGE_ID_LEN,
                              "pattern": "^[^\\u0000-\\u001f\\u007f]+$"},
                "ChatCompletionRequest": chat,
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "null"]}}}}},
            },
        },
    }
