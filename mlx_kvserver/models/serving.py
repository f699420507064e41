"""The served models, and those loaded on demand: a request's model name resolved to a served
model, loading it on first use when ``--allow-models`` (or ``--pin``) lets it (``on_demand.py``:
the policy). The API is given an :class:`OnDemand` and asks it for models by name; the engine it
loads them into is given to it as a :class:`Host`.

- One load at a time, in a thread of its own (neither the event loop nor the engine thread waits
  on the disk or the hub); the model joins the engine between two steps (``Host.add_model``).
  Requests for a model that is loading wait for that one load, however long it takes (the log
  and ``/v1/models`` show its phase every few seconds): a wait is not a failure.
- Room: before loading, the new model's weights and its load's peak are estimated from its files
  (``models/footprint.py``); while the served models' weights and that peak would pass
  ``WEIGHTS_SHARE`` of the memory limit, the least recently used idle model loaded on demand
  (not pinned) is unloaded (``Host.remove_model``: its cache is flushed to disk and stays
  there, and in the shared store). Too large even alone: 400; while the models that would make
  room are busy, the load waits for them to finish their answers (logged once).
- ``--model-ttl``: a loaded-on-demand model unused that long is unloaded.
- The models named at start (``--model``) are never unloaded.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Protocol

from ..config import GB, ServerConfig
from ..errors import RequestError
from .footprint import estimate_load, weights_bytes
from .loading import LoadedModel, auto_dequantize
from .on_demand import (WEIGHTS_SHARE, AllowList, NotCached, Resident, hub_bytes, idle_past,
                        in_thread, load_source, locate, lru, source_of)
from .registry import ModelRegistry, UnknownModelError
from .vision import listing_fields

log = logging.getLogger("mlx_kvserver.models")

PROGRESS_S = 5.0  # a loading model's progress line in the log, every this many seconds
ROOM_POLL_S = 0.25  # how often a load that waits for busy models looks again


def _mb(n: int) -> str:
    return f"{n / (1 << 20):.1f} MB" if n < GB else f"{n / GB:.2f} GB"


def _error(status: int, message: str, code: str,
           type: str = "invalid_request_error") -> RequestError:
    return RequestError(status, message, type=type, param="model", code=code)


class Host(Protocol):
    """What loading and unloading ask of the engine (``engine/engine.py``'s ``Engine``):
    ``call`` runs a function on its thread between two steps, where ``add_model`` and
    ``remove_model`` run; ``memory`` is its budget (``weights`` by model name,
    ``weights_total``, ``limit``); ``schedulers`` by model name, each ``busy`` while it has
    requests."""

    memory: Any
    schedulers: dict[str, Any]

    async def call(self, fn: Callable[[], Any]) -> Any: ...

    def add_model(self, lm: LoadedModel) -> None: ...

    def remove_model(self, name: str) -> bool: ...


class OnDemand:
    """The served models and those requests load on demand (see the module's docstring)."""

    def __init__(self, config: ServerConfig, registry: ModelRegistry, engine: Host) -> None:
        self.config, self.registry, self.engine = config, registry, engine
        self.allow = AllowList(config.allow_models, config.pin_models)
        self.residents: dict[str, Resident] = {}  # by source key, in order of first request
        self.fixed = {s.key: lm.name for lm in registry
                      if (s := source_of(lm.source)) is not None}  # started with the server
        self._lock: asyncio.Lock | None = None  # one load (or unload) at a time
        self._ttl: asyncio.Task | None = None

    # -- lifecycle ----------------------------------------------------------------------------

    def start(self) -> None:
        if self.config.model_ttl_s and self.allow.enabled:
            self._ttl = asyncio.get_running_loop().create_task(self._expire())

    async def close(self) -> None:
        tasks = [t for t in [self._ttl, *(r.busy for r in self.residents.values())]
                 if isinstance(t, asyncio.Task) and not t.done()]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def lock(self) -> asyncio.Lock:
        if self._lock is None:
            self._lock = asyncio.Lock()
        return self._lock

    # -- names to models ----------------------------------------------------------------------

    def served(self, name: str | None) -> LoadedModel:
        """The served model ``name`` names, loaded now (no loading): by name, a spelling of
        a loaded model's path, an alias, ``default`` or an index; 404 otherwise."""
        if name is not None and name in self.registry:
            return self._used(self.registry.get(name))
        src = self.allow.check(name)
        if src is not None:
            if src.key in self.fixed:
                return self.registry.get(self.fixed[src.key])
            r = self.residents.get(src.key)
            if r is not None and r.status == "loaded" and r.name in self.registry:
                r.touch()
                return r.lm
        try:
            return self.registry.get(name)
        except (UnknownModelError, ValueError):  # ValueError: an index of thousands of digits
            raise self.not_found(name) from None

    async def resolve(self, name: str | None) -> LoadedModel:
        """Like :meth:`served`, and a name ``--allow-models`` allows is loaded first (or its
        load waited for). NOTE: returns only a model that is served now, with no await between
        that check and the return: the caller submits its job before anything can unload it
        (a job queued before an unload keeps the model busy, and the unload gives up)."""
        while True:
            try:
                return self.served(name)
            except RequestError:
                src = self.allow.check(name)
                if src is None or src.key in self.fixed:
                    raise
            r = self.residents.get(src.key)
            if r is None:
                r = self.residents[src.key] = Resident(src, self.allow.pinned(src))
            if r.busy is None or r.busy.done():
                r.busy = asyncio.get_running_loop().create_task(self._load(r))
                r.busy.add_done_callback(lambda t: t.cancelled() or t.exception())
            await asyncio.shield(r.busy)  # a waiter that goes away leaves the load going on

    def _used(self, lm: LoadedModel) -> LoadedModel:
        for r in self.residents.values():
            if r.lm is lm:
                r.touch()
        return lm

    def not_found(self, name: str | None) -> RequestError:
        shown = str(name) if len(str(name)) <= 200 else str(name)[:200] + "..."
        hint = "other names load only when they match the server's --allow-models" \
            if self.allow.enabled else "serve it under another name with --model-alias " \
            "NAME=SERVED, or let requests load it with --allow-models PATTERN"
        return RequestError(404, f"model {shown!r} not found; served: "
                            f"{', '.join(self.registry.names())} ({hint})",
                            type="not_found_error", param="model", code="model_not_found")

    def listing(self) -> list[dict[str, Any]]:
        """``/v1/models``' entries: the served models, then every model loaded on demand that
        is loading or was loaded once (loaded, unloaded), with its status."""
        weights = dict(self.engine.memory.weights)
        on_demand = {r.name for r in self.residents.values() if r.status == "loaded"}
        out = [{"id": lm.name, "object": "model", "created": 0, "owned_by": "mlx-kvserver",
                "status": "loaded", "on_demand": False, "pinned": True,
                "weights_bytes": weights.get(lm.name), **listing_fields(lm.takes_images)}
               for lm in self.registry if lm.name not in on_demand]
        for r in self.residents.values():
            if r.loads or r.status == "loading":
                out.append({"id": r.name, "object": "model", "created": 0,
                            "owned_by": "mlx-kvserver", **r.describe()})
        return out

    # -- loading and unloading ---------------------------------------------------------------

    async def _load(self, r: Resident) -> None:
        deq = self.config.dequantize
        run_deq = auto_dequantize() if deq is None else deq
        r.status, r.started, r.downloaded, r.phase_s = "loading", time.monotonic(), None, {}
        r.enter("queued")
        ticker = asyncio.get_running_loop().create_task(self._progress(r))
        try:
            async with self.lock:
                log.info("loading model %s on demand (%s)", r.name, r.source.key)
                downloading = r.source.kind == "hub" and self.config.allow_download
                r.enter("downloading" if downloading else "locating")
                path = await in_thread(lambda: locate(r.source, self.config.allow_download))
                r.enter("estimating")
                estimate = await in_thread(lambda: estimate_load(path, run_deq))
                r.weights = estimate.weights
                r.enter("making room")
                await self._make_room(r, estimate.peak)
                r.enter("reading weights")
                lm = await in_thread(lambda: load_source(r.source, path, deq))
                real = weights_bytes(lm.model)
                if real > r.weights:
                    r.enter("making more room")
                    await self._make_room(r, real)
                r.enter("opening its cache")
                await self.engine.call(lambda: self.engine.add_model(lm))
                self.registry.add(lm)
                r.enter("")
                r.lm, r.status, r.loads = lm, "loaded", r.loads + 1
                r.takes_images = lm.takes_images
                r.weights = self.engine.memory.weights.get(lm.name, real)
                r.load_s = round(time.monotonic() - r.started, 3)
                r.touch()
                log.info("loaded model %s in %.2f s (%s of weights; all models' weights %s "
                         "of %s; %s)", r.name, r.load_s, _mb(r.weights),
                         _mb(self.engine.memory.weights_total), _mb(self._cap()),
                         ", ".join(f"{k} {v:.2f} s" for k, v in r.phase_s.items()))
        except BaseException as e:
            r.status, r.phase = ("unloaded" if r.loads else "failed"), ""
            if not r.loads:
                self.residents.pop(r.source.key, None)
            raise self._load_error(r, e) if isinstance(e, Exception) else e
        finally:
            ticker.cancel()

    def _load_error(self, r: Resident, e: Exception) -> Exception:
        if isinstance(e, RequestError):
            return e
        if isinstance(e, NotCached):
            log.info("model %s: %s", r.name, e)
            return _error(404, str(e), "model_not_cached", "not_found_error")
        if isinstance(e, FileNotFoundError):
            return _error(404, f"model {r.name!r} not found: {e}", "model_not_found",
                          "not_found_error")
        if isinstance(e, ValueError):
            log.warning("model %s did not load: %s", r.name, e)
            return _error(400, f"model {r.name!r} cannot be loaded: {e}", "model_load_failed")
        log.error("model %s did not load", r.name, exc_info=e)
        return _error(500, f"model {r.name!r} failed to load: {type(e).__name__}: {e}",
                      "model_load_failed", "server_error")

    async def _progress(self, r: Resident) -> None:
        while True:
            await asyncio.sleep(PROGRESS_S)
            if r.phase == "downloading":
                r.downloaded = hub_bytes(r.source)
            log.info("loading model %s: %s, %.0f s so far%s", r.name, r.phase,
                     time.monotonic() - r.started, f", {_mb(r.downloaded)} downloaded"
                     if r.downloaded is not None else f", {_mb(r.weights)} of weights"
                     if r.weights else "")

    def _cap(self) -> int:
        return int(self.engine.memory.limit * WEIGHTS_SHARE)

    async def _make_room(self, r: Resident, need: int) -> None:
        """Unload least recently used models until the weights and ``need`` fit (see the
        module's docstring): before the load, its peak; 400 when they never can; while the
        models that would make room are busy, wait for them (their answers make progress)."""
        told = False
        while not await self._room_made(r, need):
            if not told:
                told = True
                log.info("model %s waits for room: the models that would make it are answering",
                         r.name)
                r.enter("waiting for busy models")
            await asyncio.sleep(ROOM_POLL_S)

    async def _room_made(self, r: Resident, need: int) -> bool:
        """One round of :meth:`_make_room`: True once the weights and ``need`` fit."""
        total = await self.engine.call(lambda: self.engine.memory.weights_total)
        cap = self._cap()
        if total + need <= cap:
            return True
        candidates = lru(list(self.residents.values()), but=r)
        stays = total - sum(c.weights for c in candidates)
        what = f" while it loads ({_mb(r.weights)} of weights once loaded)" \
            if need > r.weights else " of weights"
        figures = (f"model {r.name!r} needs about {_mb(need)}{what}; the models that stay "
                   f"loaded hold {_mb(stays)} and all weights may take {_mb(cap)} "
                   f"({WEIGHTS_SHARE:.0%} of the memory limit, {_mb(self.engine.memory.limit)}: "
                   "--memory-limit)")
        if stays + need > cap:
            raise _error(400, figures + "; it does not fit", "model_too_large")
        for c in candidates:
            total -= await self._unload(c, f"least recently used, to make room for {r.name}")
            if total + need <= cap:
                return True
        return False

    async def _unload(self, r: Resident, why: str) -> int:
        """Unload ``r`` when the engine finds it idle: the bytes of weights freed (0: busy)."""
        name, lm, started = r.name, r.lm, time.monotonic()
        idle = started - r.last_used
        self.registry.remove(name)  # NOTE: from now no request finds it and submits a job
        r.status, r.busy = "unloading", asyncio.get_running_loop().create_future()
        try:
            ok = await self.engine.call(lambda: self._remove(name))
        except Exception:
            log.exception("unloading model %s failed", name)
            ok = False
        finally:
            if not r.busy.done():
                r.busy.set_result(None)
        if not ok:
            self.registry.add(lm)
            r.status = "loaded"
            return 0
        freed, r.weights, r.lm = r.weights, 0, None
        r.status, r.unloaded_why = "unloaded", why
        r.unload_s = round(time.monotonic() - started, 3)
        log.info("unloaded model %s (%s; idle %.0f s) in %.2f s: %s of weights freed, its "
                 "cache kept on disk", name, why, idle, r.unload_s, _mb(freed))
        return freed

    def _remove(self, name: str) -> bool:
        """On the engine thread: remove ``name`` from the engine and free its weights."""
        # Engine.remove_model collects the cycles that held the model's objects (finished
        # requests' Job <-> Request <-> Choice) before it clears MLX's buffer cache.
        return self.engine.remove_model(name)

    async def _expire(self) -> None:
        """Unload the models idle for ``--model-ttl``: idle counts from the last request's start
        or the last look (every quarter of the TTL) that found the model busy."""
        ttl = float(self.config.model_ttl_s)
        while True:
            await asyncio.sleep(max(0.05, min(ttl / 4, 30.0)))
            if not any(r.status == "loaded" for r in self.residents.values()):
                continue
            busy = await self.engine.call(lambda: {n for n, s in self.engine.schedulers.items()
                                                   if s.busy})
            for r in self.residents.values():
                if r.status == "loaded" and r.name in busy:
                    r.touch()
            for r in idle_past(list(self.residents.values()), ttl, time.monotonic()):
                async with self.lock:
                    if r.status == "loaded" and time.monotonic() - r.last_used >= ttl \
                            and not await self._unload(r, f"idle for {ttl:g} s, --model-ttl"):
                        r.touch()  # busy: its idle time starts again

