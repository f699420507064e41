"""A hand-written OpenAPI 3.1 description of the HTTP API, served at ``GET /openapi.json``.

The request bodies' schemas are in ``openapi_bodies.py``, built from the parsers' own limits and
constants so the description and the validation cannot drift apart. Each
operation declares the 4xx answers it really gives (401 only when the server has an API key); the
fuzz tests (tests/test_fuzz_api.py) check that every route of the app is described here, send
requests to every described operation, and check that every status they get is declared.
"""

from __future__ import annotations

import importlib.metadata
from typing import Any

from ..config import ServerConfig
from . import openapi_bodies as bodies
from .validate import MAX_MESSAGE_ID_LEN

try:
    VERSION = importlib.metadata.version("mlx-kvserver")
except importlib.metadata.PackageNotFoundError:  # run from a checkout
    VERSION = "0.1.0"
_ERROR = {"$ref": "#/components/schemas/Error"}
# What an import takes: a file that GET /v1/kv_cache/export/{message_id} gave (safetensors with
# this server's header), not any bytes; the Content-Type itself is not checked.
KV_EXPORT = "application/vnd.mlx-kvserver.kv-export"


def _json(schema: dict, description: str) -> dict:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _text(kind: str, description: str) -> dict:
    return {"description": description, "content": {kind: {"schema": {"type": "string"}}}}


BAD_ID = "a message_id that is empty, too long or has control characters"
NO_ENTRY = "no KV cache entry under this message_id"
NO_MODEL = "no served model of this name or index (nor one --allow-models lets load)"
BUSY = ("the model is still loading, or memory for it is not free yet: try again after "
        "Retry-After")


def _op(summary: str, ok: dict, errors: dict[int, str], auth: bool, public: bool = False,
        **extra: Any) -> dict:
    """An operation answering ``ok``, ``errors``, 403 (Host or Origin refused) and, when the
    server has an API key and the route is not public, 401."""
    codes = {**errors, 403: "the Host header or the Origin is not allowed"}
    if auth and not public:
        codes[401] = "missing or wrong API key"
    op = {"summary": summary, "responses": {"200": ok, **{
        str(c): _json(_ERROR, codes[c]) for c in sorted(codes)}}, **extra}
    if public and auth:
        op["security"] = []
    return op


_MESSAGE_ID_PATH = {"name": "message_id", "in": "path", "required": True,
                    "schema": {"$ref": "#/components/schemas/MessageId"}}
_RESPONSE_ID_PATH = {"name": "response_id", "in": "path", "required": True,
                     "schema": {"type": "string"}}


def _body(name: str) -> dict:
    return {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{name}"}}}}


def _generate(summary: str, kind: str, auth: bool, body: str, extra_params: list | None = None,
              missing: str | None = None) -> dict:
    """A POST that generates: JSON, or server-sent events with ``stream: true``."""
    errors = {400: "a body that is not JSON or not a valid request, a bad field, or a prompt "
                   "longer than the model's context", 404: NO_MODEL if missing is None
              else f"{NO_MODEL}, or {missing}", 413: "a body larger than the server's limit",
              429: "the queue is full; try again shortly", 503: BUSY}
    ok = {"description": f"a {kind}, or its stream of server-sent events",
          "content": {"application/json": {"schema": {"type": "object"}},
                      "text/event-stream": {"description": "the API's stream events"}}}
    return {"post": _op(summary, ok, errors, auth, requestBody=_body(body),
                        **({"parameters": extra_params} if extra_params else {}))}


def _worker_paths(auth: bool) -> dict:
    """What a router polls (``worker_routes.py``)."""
    anything = {"type": "object"}
    no_model = {503: "no model is loaded yet"}
    return {
        "/health_generate": {"get": _op("the engine answers a call between its steps",
                                        _json(anything, "ok"),
                                        {503: "the engine does not answer"}, auth, public=True)},
        "/server_info": {"get": _op("the served model and the load, for a router",
                                    _json(anything, "server info"), no_model, auth)},
        "/model_info": {"get": _op("the first served model, for a router",
                                   _json(anything, "model info"), no_model, auth)},
        "/get_load": {"get": _op("requests running and queued, KV pages held, memory free",
                                 _json(anything, "the load"), {}, auth)},
        "/v1/loads": {"get": _op("the load as one rank's figures (num_used_tokens)",
                                 _json(anything, "the loads"), {}, auth)},
    }


def _tokenize_paths(auth: bool, models: list[str] | None) -> dict:
    """The prompt as token ids, for a router that matches them with KV events (``tokenize.py``):
    each render route takes the body of the route it names; nothing is generated."""
    ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
    errors = {400: "a body that is not JSON or not a valid request of its route", 404: NO_MODEL,
              413: "a body larger than the server's limit", 503: BUSY}

    def render(route: str, body: str, missing: str = "") -> dict:
        return {"post": _op(f"the prompt's token ids of a {route} body (vLLM's render)", _json(
            {"type": "object", "properties": {"token_ids": ids}}, "request_id, model, token_ids"),
            {**errors, 404: NO_MODEL + missing}, auth, requestBody=_body(body))}

    either = {"required": True, "content": {"application/json": {"schema": {"anyOf": [
        {"$ref": "#/components/schemas/ChatCompletionRequest"},
        {"$ref": "#/components/schemas/CompletionRequest"}]}}}}
    tokens = {"type": "object", "required": ["tokens"], "properties": {
        "tokens": ids, "model": bodies.model_field(models)},
        "description": "token ids below the model's vocabulary size"}
    return {
        "/v1/chat/completions/render": render("/v1/chat/completions", "ChatCompletionRequest"),
        "/v1/completions/render": render("/v1/completions", "CompletionRequest"),
        "/v1/responses/render": render("/v1/responses", "ResponsesRequest",
                                       ", or an unknown previous_response_id"),
        "/tokenize": {"post": _op(
            "a chat's (messages) or a prompt's token ids, in vLLM's shape",
            _json({"type": "object", "properties": {"tokens": ids, "count": {"type": "integer"}}},
                  "count, max_model_len, tokens"), errors, auth, requestBody=either)},
        "/detokenize": {"post": _op(
            "the text of token ids", _json({"type": "object", "properties": {
                "prompt": {"type": "string"}}}, "prompt"), errors, auth,
            requestBody={"required": True, "content": {"application/json": {"schema": tokens}}})},
    }


def openapi_spec(models: list[str] | None = None, api_key: bool = False,
                 image_urls: bool = ServerConfig.allow_image_urls,
                 max_images: int = ServerConfig.max_images) -> dict:
    """The OpenAPI document (``models``: names to list as examples of the ``model`` field;
    ``api_key``: whether the server requires one; ``image_urls``: whether it fetches http(s)
    image URLs; ``max_images``: the images it takes in one request)."""
    images = (image_urls, max_images)
    entry = {"type": "object", "properties": {
        "object": {"const": "kv_cache.entry"}, "message_id": {"type": "string"},
        "model": {"type": "string"}, "tokens": {"type": "integer"},
        "in_memory": {"type": "boolean"}, "on_disk": {"type": "boolean"}}}
    anything = {"type": "object"}
    return {
        "openapi": "3.1.0",
        "info": {"title": "mlx-kvserver", "version": VERSION,
                 "description": "OpenAI-compatible chat completions with a paged, persistent "
                                "KV cache keyed by message_id. Strings are Unicode text: a "
                                "lone surrogate (a \\ud800 escape) is refused, as I-JSON "
                                "(RFC 7493) requires."},
        "servers": [{"url": "/"}],
        **({"security": [{"bearer": []}]} if api_key else {}),
        "paths": {
            "/health": {"get": _op("liveness, loaded models, queue", _json(anything, "ok"), {},
                                   api_key, public=True)},
            "/openapi.json": {"get": _op("this document", _json(anything, "OpenAPI 3.1"), {},
                                         api_key)},
            "/metrics": {"get": _op("Prometheus metrics", _text("text/plain", "the metrics"), {},
                                    api_key)},
            "/": {"get": _op("the chat page (HTML)", _text("text/html", "the page"), {}, api_key,
                             public=True)},
            "/static/{path}": {"get": _op(
                "the chat page's files", _text("text/javascript", "a file"),
                {404: "no such file"}, api_key, public=True,
                parameters=[{"name": "path", "in": "path", "required": True,
                             "schema": {"type": "string"}}])},
            **_worker_paths(api_key),
            **_tokenize_paths(api_key, models),
            "/v1/models": {"get": _op(
                "the served models and those loaded on demand, with a status each (loaded, "
                "loading, unloaded) and whether it takes images (capabilities.vision, "
                "input_modalities)", _json(anything, "a model list"), {}, api_key)},
            "/v1/chat/completions": {"post": _op(
                "a chat completion (streamed as server-sent events with stream=true)",
                {"description": "a chat.completion, or an SSE stream of chat.completion.chunk",
                 "content": {"application/json": {"schema": anything},
                             "text/event-stream": {"description": "events whose data is a "
                                                   "chat.completion.chunk, then [DONE]"}}},
                {400: "a body that is not JSON or not a valid request, a bad field or "
                      "message, or a prompt longer than the model's context",
                 404: NO_MODEL, 413: "a body larger than the server's limit",
                 429: "the queue is full; try again shortly", 503: BUSY}, api_key,
                parameters=[{"name": "X-Model-Id", "in": "header", "required": False,
                             "description": "the model, over the body's model",
                             "schema": {"type": "string"}}],
                requestBody=_body("ChatCompletionRequest"))},
            "/v1/completions": _generate(
                "a text completion of a raw prompt (no chat template)", "text_completion",
                api_key, "CompletionRequest"),
            "/v1/messages": _generate(
                "Anthropic's Messages API (errors in Anthropic's shape)", "message", api_key,
                "MessagesRequest", extra_params=[
                    {"name": "anthropic-version", "in": "header", "required": False,
                     "schema": {"type": "string"}},
                    {"name": "beta", "in": "query", "required": False,
                     "schema": {"type": "string"}}]),
            "/v1/messages/count_tokens": {"post": _op(
                "the prompt tokens a Messages request would read",
                _json({"type": "object", "properties": {"input_tokens": {"type": "integer"}}},
                      "the count"),
                {400: "a bad request body", 404: NO_MODEL, 413: "a body larger than the limit"},
                api_key, requestBody=_body("CountTokensRequest"))},
            "/v1/responses": _generate(
                "OpenAI's Responses API (stored and continued by previous_response_id, across "
                "restarts)", "response", api_key, "ResponsesRequest",
                missing="an unknown previous_response_id"),
            "/v1/responses/{response_id}": {
                "get": _op("a stored response", _json(anything, "the response"),
                           {404: "no stored response of this id"}, api_key,
                           parameters=[_RESPONSE_ID_PATH]),
                "delete": _op("forget a stored response", _json(anything, "deleted"),
                              {404: "no stored response of this id"}, api_key,
                              parameters=[_RESPONSE_ID_PATH]),
            },
            "/v1/kv_cache/stats": {"get": _op("memory and disk tiers per model",
                                              _json(anything, "kv_cache.stats"), {}, api_key)},
            "/v1/kv_cache/import": {"post": _op(
                "add an exported entry", _json(entry, "the imported entry"),
                {400: "a file that is not a KV cache export (or is damaged, or was made by "
                      "another model), " + BAD_ID + ", or none in the file or the query",
                 404: NO_MODEL, 413: "a file larger than the server's limit"}, api_key,
                parameters=[
                    {"name": "message_id", "in": "query", "required": False,
                     "schema": {"$ref": "#/components/schemas/MessageId"}},
                    {"name": "model", "in": "query", "required": False,
                     "schema": {"type": "string"}}],
                requestBody={"required": True, "description": "a file that GET "
                             "/v1/kv_cache/export/{message_id} gave, unchanged (any other "
                             "bytes are a 400); its Content-Type is not checked", "content": {
                                 KV_EXPORT: {"schema": {
                                     "type": "string", "contentMediaType": KV_EXPORT,
                                     "description": "safetensors: the entry's pages and its "
                                                    "token ids, model fingerprint and "
                                                    "checksum in the header"}}}})},
            "/v1/kv_cache/export/{message_id}": {"get": _op(
                "one entry's cache as a safetensors file",
                {"description": "the file (the body of an import)",
                 "content": {"application/octet-stream": {
                     "schema": {"type": "string", "contentMediaType": KV_EXPORT}}},
                 "links": {"import": {
                     "operationRef": "#/paths/~1v1~1kv_cache~1import/post",
                     "requestBody": "$response.body",
                     "description": "this file is what POST /v1/kv_cache/import takes"}}},
                {400: BAD_ID, 404: NO_ENTRY}, api_key, parameters=[_MESSAGE_ID_PATH])},
            "/v1/kv_cache/{message_id}": {
                "get": _op("one entry", _json(entry, "kv_cache.entry"),
                           {400: BAD_ID, 404: NO_ENTRY}, api_key, parameters=[_MESSAGE_ID_PATH]),
                "delete": _op("forget one entry (memory and disk)",
                              _json(anything, "kv_cache.entry.deleted"),
                              {400: BAD_ID, 404: NO_ENTRY}, api_key, parameters=[_MESSAGE_ID_PATH]),
            },
        },
        "components": {
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                           "description": "only when --api-key is set"}},
            "schemas": {
                "MessageId": {"type": "string", "minLength": 1,
                              "maxLength": MAX_MESSAGE_ID_LEN,
                              "pattern": "^[^\\u0000-\\u001f\\u007f]+$"},
                "ChatCompletionRequest": bodies.chat(models, *images),
                "CompletionRequest": bodies.completions(models),
                "MessagesRequest": bodies.messages(models, *images),
                "CountTokensRequest": bodies.messages(models, *images, count_only=True),
                "ResponsesRequest": bodies.responses(models, *images),
                "Error": {"type": "object", "required": ["error"], "properties": {"error": {
                    "type": "object", "required": ["message", "type"],
                    "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                                   "param": {"type": ["string", "null"]},
                                   "code": {"type": ["string", "null"]}}}}},
            },
        },
    }
