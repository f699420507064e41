"""What a cache-aware router asks of each server behind it: the model it serves, whether its
engine answers, and its load, in the shapes SGLang's router (``sglang-router``, which polls
``/health``, ``/server_info``, ``/model_info``, ``/get_load``) and vLLM-style load readers
(``/v1/loads``) expect. Thin by design: every figure is read from the engine's own state.

``/server_info`` and ``/model_info`` name the first served model (``model_path`` and
``served_model_name``): the router files the server under that name and routes a request whose
``model`` is that name to it, with one prefix tree per model. ``/health_generate`` answers once
the engine thread has run a call between two of its steps (a stuck or dead engine is a 503).
The load figures come from one call on the engine thread (waited for at most
``LOAD_TIMEOUT_S``; the last figures, with their age, while a long step runs).
"""

from __future__ import annotations

import asyncio
import time

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..errors import RequestError
from .openapi import VERSION

LOAD_TIMEOUT_S = 1.0  # a poll during a long step answers the last figures instead of waiting
HEALTH_TIMEOUT_S = 20.0  # an engine that runs no call for this long is not healthy


def load_snapshot(engine) -> dict:
    """Run on the engine thread (``engine.call``): per model, the requests running and waiting
    and the KV pages held by sequences, in use and in the pool; the memory budget's free
    bytes."""
    models = {}
    for name, manager in engine.managers.items():
        s, scheduler = manager.pool_stats(), engine.schedulers[name]
        waiting = sum(scheduler.waiting().values())
        models[name] = {"running": len(scheduler.requests) - waiting, "waiting": waiting,
                        "decoding": scheduler.batch_size, "page_size": s.page_size,
                        "pages_held": s.held_pages, "pages_used": s.used_pages,
                        "pages_capacity": s.capacity_pages, "kv_bytes_used": s.used_bytes,
                        "kv_bytes_budget": s.budget_bytes}
    memory = engine.memory.report()
    return {"models": models, "memory": {
        "limit_bytes": memory["limit_bytes"], "active_bytes": memory["mlx_active_bytes"],
        "free_bytes": max(0, memory["limit_bytes"] - memory["mlx_active_bytes"])}}


class WorkerRoutes:
    """The handlers, over the app's engine and served models (``App``)."""

    def __init__(self, served):
        self.served, self.engine = served, served.engine
        self._last: dict | None = None
        self._last_at = 0.0

    def _model(self):
        names = self.served.registry.names()
        if not names:
            raise RequestError(503, "no model is loaded yet", type="server_error")
        return self.served.registry.get(names[0])

    async def load(self) -> dict:
        """The server's load: the queue (requests submitted, prompt not started) read now, the
        rest from the engine thread (or the last figures, ``age_s`` old, while it is busy)."""
        try:
            self._last = await asyncio.wait_for(self.engine.call(
                lambda: load_snapshot(self.engine)), LOAD_TIMEOUT_S)
            self._last_at = time.monotonic()
        except asyncio.TimeoutError:
            if self._last is None:
                self._last = {"models": {}, "memory": {}}
        models = self._last["models"].values()
        return {"queued": self.engine.queued,
                "running": sum(m["running"] for m in models),
                "waiting": sum(m["waiting"] for m in models),
                "tokens_held": sum(m["pages_held"] * m["page_size"] for m in models),
                "tokens_capacity": sum(m["pages_capacity"] * m["page_size"] for m in models),
                "pages_held": sum(m["pages_held"] for m in models),
                "memory": self._last["memory"], "models": self._last["models"],
                "age_s": round(time.monotonic() - self._last_at, 3) if self._last_at else None}

    async def health_generate(self, request: Request) -> Response:
        try:
            await asyncio.wait_for(self.engine.call(lambda: True), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, RuntimeError) as e:
            raise RequestError(503, f"the engine does not answer: {type(e).__name__}",
                               type="server_error")
        return JSONResponse({"status": "ok"})

    async def server_info(self, request: Request) -> Response:
        lm, load = self._model(), await self.load()
        config = self.served.config
        return JSONResponse({
            "model_path": lm.name, "served_model_name": lm.name,
            "served_models": self.served.registry.names(), "version": VERSION,
            "tp_size": 1, "dp_size": 1, "max_running_requests": config.max_batch,
            "max_total_num_tokens": load["tokens_capacity"], "page_size": config.page_size,
            "kv_store": config.kv_store is not None, "internal_states": [load]})

    async def model_info(self, request: Request) -> Response:
        lm = self._model()
        return JSONResponse({"model_path": lm.name, "tokenizer_path": None,
                             "is_generation": True, "context_length": lm.context_length,
                             "takes_images": bool(lm.takes_images)})

    async def get_load(self, request: Request) -> Response:
        """SGLang's shape: one entry per data-parallel rank (here one), and ``load`` (the
        requests running and waiting) for readers of the older single figure."""
        load = await self.load()
        return JSONResponse({"load": load["running"] + load["queued"], "loads": [_rank(load)],
                             "server": load})

    async def loads(self, request: Request) -> Response:
        """``/v1/loads``: the same figures, as ``loads`` of one rank with the used tokens."""
        load = await self.load()
        return JSONResponse({"timestamp": time.time(), "dp_rank_count": 1,
                             "loads": [_rank(load)], "server": load})


def _rank(load: dict) -> dict:
    capacity = load["tokens_capacity"]
    return {"dp_rank": 0, "num_reqs": load["running"] + load["queued"],
            "num_running_reqs": load["running"], "num_waiting_reqs": load["queued"],
            "num_tokens": load["tokens_held"], "num_used_tokens": load["tokens_held"],
            "max_total_num_tokens": capacity,
            "token_usage": round(load["tokens_held"] / capacity, 4) if capacity else 0.0}


def worker_routes(served, guarded) -> list[Route]:
    """The routes, each wrapped by the app's ``guarded`` (``/health_generate`` public, like
    ``/health``; the others need the API key when the server has one)."""
    w = WorkerRoutes(served)
    return [Route("/health_generate", guarded(w.health_generate, public=True), methods=["GET"]),
            Route("/server_info", guarded(w.server_info), methods=["GET"]),
            Route("/model_info", guarded(w.model_info), methods=["GET"]),
            Route("/get_load", guarded(w.get_load), methods=["GET"]),
            Route("/v1/loads", guarded(w.loads), methods=["GET"])]
