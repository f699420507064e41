"""The Starlette application: the route list, the key and Host/Origin guard, errors in each
API's shape, and the one way every API submits a conversation to the engine. Thin by design: the
API modules translate; the served models (loaded at start or on demand) are what it is given
(``models/serving.py``), the engine owns the caches (``engine/cache_entries.py``: their routes)."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat.conversation import Conversation
from ..chat.normalize import Normalizer
from ..chat.output import Accepted, Error
from ..config import ServerConfig
from ..engine.engine import Engine
from ..errors import RequestError
from ..storage.shared_responses import open_store
from ..engine.request import Job
from .metrics import CONTENT_TYPE_LATEST, Metrics, RequestCounter
from .openapi import openapi_spec
from .page import page_routes
from . import anthropic, completions, openai_chat, responses
from .guard import RequestGuard, allowed_hosts, check_api_key
from .images import check_sources, read_images, refuse_unless_taken, sources
from .http import error_responder, first_event
from .kv_routes import KVRoutes
from .tokenize import tokenize_routes
from .worker_routes import worker_routes

if TYPE_CHECKING:
    from ..models.serving import OnDemand

log = logging.getLogger("mlx_kvserver.api")


class App:
    """What the route handlers share: config, the served models, engine, metrics, ``start``."""

    def __init__(self, config: ServerConfig, models: OnDemand, engine: Engine):
        self.config, self.on_demand, self.engine = config, models, engine
        self.registry = models.registry
        self.metrics = Metrics()
        self.responses = open_store(config)
        self.normalizer = Normalizer.from_config(config.volatile_rules, config.volatile_rule,
                                                 config.volatile_rule_files)

    @staticmethod
    def model_name(request: Request, name: str | None) -> str | None:
        """The model a request asks for: its ``X-Model-Id`` header when set (it wins: agents
        put their own model name in the body), else the body's (or query's) ``model``."""
        return request.headers.get("x-model-id") or name

    def model_for(self, request: Request, name: str | None):
        """A served model, loaded now (no loading on demand); 404 listing the served."""
        return self.on_demand.served(self.model_name(request, name))

    async def resolve_model(self, request: Request, name: str | None):
        """The model, loaded first when ``--allow-models`` lets its name load on demand."""
        return await self.on_demand.resolve(self.model_name(request, name))

    async def start(self, request: Request, conv: Conversation, job_id: str | None = None,
                    answer_ids: list[str] | None = None):
        """Submit ``conv`` to the engine; ``(job, Accepted, watch)`` once its prompt is checked
        and its cache looked up (a ``RequestError`` before any byte is sent otherwise).
        ``job_id`` names the job (the API's response id); ``answer_ids`` are the message ids
        the answers are cached under (by choice; new ones otherwise)."""
        await self.read_images(request, conv)
        lm = await self.resolve_model(request, conv.model)  # NOTE: no await until submit
        refuse_unless_taken(conv, lm, self.registry)
        conv, applied = self.normalizer.apply(conv)
        if applied:
            log.info("volatile-line rules applied: %s", ", ".join(applied))
        watch = self.metrics.watch(lm.name)
        job = Job(conv, lm, asyncio.get_running_loop(), answer_ids=list(answer_ids or ()))
        if job_id is not None:
            job.id = job_id
        self.engine.submit(job)
        try:
            event = await first_event(request, job)  # Accepted or an Error, before any byte
            if isinstance(event, Error):
                raise event.error
            if not isinstance(event, Accepted):
                raise RequestError(500, "the generation worker stopped", type="server_error")
        except BaseException:
            watch.close()
            job.cancel()
            raise
        return job, event, watch

    async def read_images(self, request: Request, conv: Conversation) -> None:
        """``conv``'s images counted, checked and read (``api/images.py``): refused before any
        fetch or decoding when the model it names is served now and takes no images."""
        if not sources(conv):
            return
        check_sources(conv, self.config.max_images, self.config.allow_image_urls)
        try:
            lm = self.model_for(request, conv.model)
        except RequestError:
            lm = None  # loaded on demand: the model is asked once it has loaded
        if lm is not None:
            refuse_unless_taken(conv, lm, self.registry)
        await read_images(conv)

    async def health(self, request: Request) -> Response:
        return JSONResponse({"status": "ok", "models": self.registry.names(),
                             "queued": self.engine.queued, "busy": self.engine.busy})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": self.on_demand.listing()})

    async def openapi(self, request: Request) -> Response:
        return JSONResponse(openapi_spec(self.registry.names(), bool(self.config.api_key),
                                         self.config.allow_image_urls, self.config.max_images))

    async def metrics_text(self, request: Request) -> Response:
        return Response(await self.metrics.scrape(self.engine), media_type=CONTENT_TYPE_LATEST)


def build_app(config: ServerConfig, models: OnDemand, engine: Engine) -> Starlette:
    """The Starlette application over ``models`` (the served models, and those requests may load
    into ``engine``); the engine starts and stops with it."""
    app_state = App(config, models, engine)
    kv = KVRoutes(app_state)

    def guarded(handler, public: bool = False):
        async def endpoint(request: Request) -> Response:
            try:
                if not public:
                    check_api_key(request, config.api_key)
                return await handler(request)
            except RequestError as e:
                return error_responder(request.url.path)(e)
            except Exception as e:  # a bug: logged, and still an error in the API's own shape
                log.exception("%s %s failed", request.method, request.url.path)
                return error_responder(request.url.path)(RequestError(
                    500, f"internal error: {type(e).__name__}", type="server_error"))
        return endpoint

    def api(module):
        return guarded(lambda request: module.handle(app_state, request))

    @asynccontextmanager
    async def lifespan(app):
        engine.start()
        app_state.on_demand.start()
        try:
            yield
        finally:
            await app_state.on_demand.close()
            engine.stop()

    routes = [
        Route("/health", guarded(app_state.health, public=True), methods=["GET"]),
        Route("/openapi.json", guarded(app_state.openapi), methods=["GET"]),
        Route("/metrics", guarded(app_state.metrics_text), methods=["GET"]),
        Route("/v1/models", guarded(app_state.models), methods=["GET"]),
        Route("/v1/chat/completions", api(openai_chat), methods=["POST"]),
        Route("/v1/completions", api(completions), methods=["POST"]),
        Route("/v1/messages", api(anthropic), methods=["POST"]),
        Route("/v1/messages/count_tokens", guarded(lambda r: anthropic.count_tokens(app_state, r)),
              methods=["POST"]),
        Route("/v1/responses", api(responses), methods=["POST"]),
        *tokenize_routes(app_state, guarded),  # prompts as token ids, for a KV-aware router
        Route("/v1/responses/{response_id:path}",
              guarded(lambda r: responses.handle_id(app_state, r)), methods=["GET", "DELETE"]),
        Route("/v1/kv_cache/stats", guarded(kv.kv_stats), methods=["GET"]),
        Route("/v1/kv_cache/import", guarded(kv.kv_import), methods=["POST"]),
        Route("/v1/kv_cache/export/{message_id:path}", guarded(kv.kv_export),
              methods=["GET"]),
        Route("/v1/kv_cache/{message_id:path}", guarded(kv.kv_entry),
              methods=["GET", "DELETE"]),
        *worker_routes(app_state, guarded),  # what a router behind it polls
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
        response = error_responder(request.url.path)(RequestError(
            exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
            type="not_found_error" if exc.status_code == 404 else "invalid_request_error"))
        response.headers.update(exc.headers or {})  # a 405 says which methods are allowed
        return response

    app = Starlette(routes=routes, middleware=middleware, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found})
    app.router.redirect_slashes = False  # an API answers 404, not a redirect, to "/v1/models/"
    app.state.engine, app.state.registry = engine, models.registry
    app.state.metrics = app_state.metrics
    return app
