"""The HTTP API: parsing, validation, OpenAI-shaped responses and SSE streaming. Thin by design:
the generation worker owns the models and the caches."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import tempfile
from contextlib import asynccontextmanager
from typing import AsyncIterator

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from kv_cache.disk_format import FormatError, read_header
from kv_cache.transfer import TransferError

from .config import ServerConfig
from .errors import APIError, bad_request
from .metrics import CONTENT_TYPE_LATEST, ChatWatch, Metrics, RequestCounter
from .models import ModelRegistry, UnknownModelError
from .openapi import openapi_spec
from .schemas import check_message_id, parse_chat_request, unknown_model
from .web import page_routes
from .engine import Engine
from .request import Job

log = logging.getLogger("mlx_kvserver.api")


def error_response(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def body_chunks(request: Request, limit: int, what: str = "the request body"):
    """The body's chunks; 413 past ``limit`` bytes (declared or sent), 400 if the client leaves."""
    too_large = APIError(413, f"{what} is larger than {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            yield chunk
    except ClientDisconnect:
        raise APIError(400, f"the client went away while sending {what}")


async def read_json(request: Request, limit: int):
    body = bytearray()
    async for chunk in body_chunks(request, limit):
        body.extend(chunk)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}")
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply")


class App:
    """Holds the registry and the engine for the route handlers."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry, engine: Engine):
        self.config, self.registry, self.engine = config, registry, engine
        self.metrics = Metrics()

    def model_for(self, request: Request, name: str | None):
        header = request.headers.get("x-model-id")
        key = name if name is not None else header
        try:
            return self.registry.get(key)
        except (UnknownModelError, ValueError):  # ValueError: an index of thousands of digits
            shown = str(key) if len(str(key)) <= 200 else str(key)[:200] + "..."
            raise unknown_model(shown, self.registry.names())

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": self.registry.names(),
                             "queued": self.engine.queued, "busy": self.engine.busy})

    async def models(self, request: Request) -> Response:
        data = [{"id": n, "object": "model", "created": 0, "owned_by": "mlx-kvserver"}
                for n in self.registry.names()]
        return JSONResponse({"object": "list", "data": data})

    async def chat_completions(self, request: Request) -> Response:
        body = await read_json(request, self.config.max_body_bytes)
        req = parse_chat_request(body, default_max_tokens=self.config.max_tokens,
                                 default_temperature=self.config.temperature)
        lm = self.model_for(request, req.model)
        watch = self.metrics.watch(lm.name)
        job = Job(req, lm, asyncio.get_running_loop())
        self.engine.submit(job)
        try:
            kind, data = await job.events.get()  # "accepted" or an error, before any byte
            if kind == "error":
                raise data
            if kind != "accepted":
                raise APIError(500, "the generation worker stopped", type="server_error")
        except BaseException:
            job.cancel()
            raise
        if req.stream:
            return StreamingResponse(self._stream(job, data, watch),
                                     media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        return await self._complete(job, data, watch)

    # -- KV cache management --------------------------------------------------------------------

    async def kv_stats(self, request: Request) -> Response:
        stats = await self.engine.call(self.engine.cache_stats)
        return JSONResponse({"object": "kv_cache.stats", "models": stats})

    async def kv_entry(self, request: Request) -> Response:
        key = path_key(request)
        if request.method == "DELETE":
            if not await self.engine.call(lambda: self.engine.delete_entry(key)):
                raise no_entry(key)
            return JSONResponse({"object": "kv_cache.entry.deleted", "message_id": key,
                                 "deleted": True})
        info = await self.engine.call(lambda: self.engine.entry_info(key))
        if info is None:
            raise no_entry(key)
        return JSONResponse(info)

    async def kv_export(self, request: Request) -> Response:
        key = path_key(request)
        found = await self.engine.call(lambda: self.engine.export_entry(key))
        if found is None:
            raise no_entry(key)
        model, data = found
        return Response(data, media_type="application/octet-stream", headers={
            "Content-Disposition": 'attachment; filename="kv-cache.safetensors"',
            "X-Model-Id": model})

    async def kv_import(self, request: Request) -> Response:
        key = check_message_id(request.query_params.get("message_id"), "message_id")
        lm = self.model_for(request, request.query_params.get("model"))
        limit = self.config.max_import_bytes
        fd, path = tempfile.mkstemp(suffix=".safetensors")
        try:
            with os.fdopen(fd, "wb") as f:
                async for chunk in body_chunks(request, limit, "the file"):
                    f.write(chunk)
            named = export_key(path)  # checks the header before MLX reads the file
            if key is None:
                if named is None:
                    raise bad_request("the file names no message_id; pass ?message_id=",
                                      "message_id", code="invalid_kv_cache_file")
                key = check_message_id(named, "message_id")
            try:
                info = await self.engine.call(lambda: self.engine.import_entry(lm.name, path,
                                                                               key))
            except TransferError as e:
                raise bad_request(f"cannot import this file: {e}", code="invalid_kv_cache_file")
            return JSONResponse(info)
        finally:
            os.unlink(path)

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_spec(self.registry.names(), bool(self.config.api_key)))

    async def metrics_text(self, request: Request) -> Response:
        return Response(await self.metrics.scrape(self.engine), media_type=CONTENT_TYPE_LATEST)

    async def _events(self, job: Job, watch: ChatWatch) -> AsyncIterator[tuple[str, dict]]:
        try:
            while True:
                kind, data = await job.events.get()
                if kind == "done":
                    return
                watch.event(kind, data)
                yield kind, data
        finally:
            watch.close()
            job.cancel()  # a client that went away cancels its generation

    async def _complete(self, job: Job, accepted: dict, watch: ChatWatch) -> Response:
        choices, usage = {}, None
        async for kind, data in self._events(job, watch):
            if kind == "error":
                return error_response(data)
            if kind == "finish":
                choices[data["index"]] = {
                    "index": data["index"],
                    "message": {"role": "assistant", "content": data["text"],
                                "message_id": data["message_id"]},
                    "finish_reason": data["reason"], "logprobs": None}
            elif kind == "usage":
                usage = data
        ordered = [choices[i] for i in sorted(choices)]
        return JSONResponse({
            "id": job.id, "object": "chat.completion", "created": job.created,
            "model": job.lm.name, "choices": ordered,
            "message_id": ordered[0]["message"]["message_id"] if ordered else None,
            "usage": usage_body(usage or {**accepted, "completion_tokens": 0}),
        })

    async def _stream(self, job: Job, accepted: dict, watch: ChatWatch) -> AsyncIterator[str]:
        ids: dict[int, str] = {}

        def chunk(index: int | None, delta: dict | None, finish=None, usage=None) -> str:
            body = {"id": job.id, "object": "chat.completion.chunk", "created": job.created,
                    "model": job.lm.name, "choices": []}
            if index is not None:
                body["message_id"] = ids[index]
                body["choices"] = [{"index": index, "delta": delta or {},
                                    "finish_reason": finish, "logprobs": None}]
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        async for kind, data in self._events(job, watch):
            if kind == "start":
                ids[data["index"]] = data["message_id"]
                yield chunk(data["index"], {"role": "assistant", "content": "",
                                            "message_id": data["message_id"]})
            elif kind == "delta":
                yield chunk(data["index"], {"content": data["text"]})
            elif kind == "finish":
                yield chunk(data["index"], {}, finish=data["reason"])
            elif kind == "usage" and job.request.include_usage:
                yield chunk(None, None, usage=usage_body(data))
            elif kind == "error":
                yield f"data: {json.dumps(data.body())}\n\n"
        yield "data: [DONE]\n\n"


def export_key(path: str):
    """The ``key`` an export file's metadata names (unchecked), after a strict check that its
    header is well-formed safetensors that fits the file (before MLX parses it)."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            header = read_header(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    except FormatError as e:
        raise bad_request(f"cannot import this file: {e}", code="invalid_kv_cache_file")
    return header.metadata.get("key")


def path_key(request: Request) -> str:
    return check_message_id(request.path_params["message_id"], "message_id")


def no_entry(key: str) -> APIError:
    return APIError(404, f"no KV cache entry for message_id {key!r}", type="not_found_error",
                    param="message_id", code="kv_cache_entry_not_found")


def usage_body(u: dict) -> dict:
    return {"prompt_tokens": u["prompt_tokens"], "completion_tokens": u["completion_tokens"],
            "total_tokens": u["prompt_tokens"] + u["completion_tokens"],
            "prompt_tokens_details": {"cached_tokens": u["cached_tokens"]}}


def build_app(config: ServerConfig, registry: ModelRegistry, engine: Engine) -> Starlette:
    """The Starlette application; the engine starts and stops with it."""
    app_state = App(config, registry, engine)

    def guarded(handler, public: bool = False):
        async def endpoint(request: Request) -> Response:
            try:
                if not public:
                    check_api_key(request, config.api_key)
                return await handler(request)
            except APIError as e:
                return error_response(e)
        return endpoint

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            engine.stop()

    routes = [
        Route("/health", guarded(app_state.health, public=True), methods=["GET"]),
        Route("/openapi.json", guarded(app_state.openapi), methods=["GET"]),
        Route("/metrics", guarded(app_state.metrics_text), methods=["GET"]),
        Route("/v1/models", guarded(app_state.models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(app_state.chat_completions), methods=["POST"]),
        Route("/v1/kv_cache/stats", guarded(app_state.kv_stats), methods=["GET"]),
        Route("/v1/kv_cache/import", guarded(app_state.kv_import), methods=["POST"]),
        Route("/v1/kv_cache/export/{message_id:path}", guarded(app_state.kv_export),
              methods=["GET"]),
        Route("/v1/kv_cache/{message_id:path}", guarded(app_state.kv_entry),
              methods=["GET", "DELETE"]),
        *page_routes(),  # the chat page at / and its files: public, like /health
    ]
    middleware = [Middleware(RequestCounter, metrics=app_state.metrics),
                  Middleware(RequestGuard, hosts=allowed_hosts(config),
                             origins=frozenset(config.cors_origins))]
    if config.cors_origins:
        middleware.append(Middleware(CORSMiddleware, allow_origins=config.cors_origins,
                                     allow_methods=["GET", "POST", "DELETE", "OPTIONS"],
                                     allow_headers=["*"]))

    async def not_found(request, exc):
        response = error_response(APIError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
            type="not_found_error" if exc.status_code == 404 else "invalid_request_error"))
        response.headers.update(exc.headers or {})  # a 405 says which methods are allowed
        return response

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.router.redirect_slashes = False  # an API answers 404, not a redirect, to "/v1/models/"
    app.state.engine, app.state.registry = engine, registry
    app.state.metrics = app_state.metrics
    return app


def check_api_key(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(),
                                                             api_key.encode()):
        raise APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                       type="authentication_error", code="invalid_api_key")


# -- exposure: Host and Origin checks -----------------------------------------------------------

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str | None:
    """The name in a Host header value (``name``, ``name:port``, ``[v6]``, ``[v6]:port``),
    lower-cased; None when the value is malformed."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        name, rest = v[1:end], v[end + 1:]
        if end < 0 or rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
    else:
        name, sep, port = v.partition(":")
        if sep and not port.isdigit():
            return None
    name = name.removesuffix(".")
    return name or None


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """Names a Host header may carry: loopback names, ``--host`` and ``--allowed-host``;
    None when ``--allowed-host '*'`` turns the check off."""
    extra = list(config.allowed_hosts)
    if "*" in extra:
        return None
    names = {*LOCAL_NAMES, config.host, *extra}
    return frozenset(n.strip().lower().removeprefix("[").removesuffix("]").removesuffix(".")
                     for n in names if n)


class RequestGuard:
    """ASGI middleware run before anything else: refuses (403, JSON) a request whose Host header
    names another server (a DNS-rebinding page reaching a loopback server under its own name) or
    that a browser sent from an origin not given with ``--cors-origin`` (a cross-site page's
    "simple" POST needs no CORS preflight, so CORS alone would not stop it from acting).

    The server's own page is same-origin: a browser sends ``Origin: http://<Host>`` with its
    POSTs and DELETEs. That origin is accepted while the Host check is on (the Host was one of
    the server's own names, so the page was served by this server under that name)."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str]):
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> APIError | None:
        hosts = [v for k, v in scope.get("headers", ()) if k == b"host"]
        if self.hosts is not None:
            name = host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
            if name not in self.hosts:
                return APIError(403, "this server answers only to its own names in the Host "
                                "header (add more with --allowed-host)", type="permission_error",
                                code="host_not_allowed")
        origins = [v for k, v in scope.get("headers", ()) if k == b"origin"]
        own = {f"{s}://{hosts[0].decode('latin-1').strip().lower()}" for s in ("http", "https")} \
            if self.hosts is not None and len(hosts) == 1 else set()
        if origins and "*" not in self.origins and any(
                o.decode("latin-1") not in self.origins | own for o in origins):
            return APIError(403, "requests from this origin are not allowed (see --cors-origin)",
                            type="permission_error", code="origin_not_allowed")
        return None
