"""The engine: one thread owns the models, their caches and their schedulers.

The HTTP layer submits a ``Job`` (``request.py``) and reads its events from an asyncio queue.
The engine thread admits queued jobs between steps, runs cache-management calls (``call``)
between steps, and steps every model's scheduler (``scheduler.py``) while any has work: many
requests are answered at once, each step decoding one token for all of them. A step returns its
typed events (``chat/output.py``), which the engine hands to their jobs.

Each model's cache is one ``kv_cache.CacheManager`` (``kv_cache.open_cache``); the engine reads
it only through the manager's plain values (``report``, ``describe``) and ``kv_cache``'s export
and import.
"""

from __future__ import annotations

import asyncio
import gc
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import mlx.core as mx

from kv_cache import CacheManager, export_entry, import_entry, open_cache

from ..chat.output import Accepted, Done, Error
from ..config import GB, ServerConfig
from ..errors import RequestError
from ..models.image_preprocessing import drop_image_outputs, kept_image_bytes
from ..models.loading import LoadedModel
from .request import Job
from .speculation.draft_model import DraftModel, DraftModelError, check_draft_model
from .memory import MemoryBudget, give_back
from .backlog import Backlog
from .kv_events import open_publisher
from .runner import Runner
from .scheduler import Events, Scheduler

log = logging.getLogger("mlx_kvserver.engine")

__all__ = ["Engine", "Job"]

# the image features a vision model keeps in memory: up to this part of its KV pages' budget
# (--max-kv-ram-gb), beside the pages; on disk they share --max-kv-size-gb with the entries
FEATURES_SHARE = 8


@dataclass
class Control:
    """A function to run on the worker thread (cache management), with its result."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class Engine:
    """Owns the models' caches and schedulers and steps them on one thread."""

    def __init__(self, models: list[LoadedModel], config: ServerConfig | None = None,
                 draft: LoadedModel | None = None):
        """One cache and scheduler per model, with ``config``'s cache and batching settings;
        ``draft``: a draft model (``config.speculate == "draft"``) for the served models whose
        tokenizer it shares (``DraftModelError`` when it fits none of them)."""
        config = config or ServerConfig()
        self.config = config
        self.memory = MemoryBudget.of(config)
        self.draft = DraftModel(draft, config) if draft is not None \
            and config.speculate == "draft" else None
        self._draft_lm = draft
        if self.draft is not None and not any(_fits(draft, lm) for lm in models):
            check_draft_model(draft, models[0])  # raises, saying why
        if self.draft is not None:
            self.memory.add_model(draft)
        self.models: dict[str, LoadedModel] = {}
        self.managers: dict[str, CacheManager] = {}
        # --kv-events: what every model's cache holds, published for a router (kv_events.py)
        self.kv_events = open_publisher(config, config.page_size)
        self.schedulers: dict[str, Scheduler] = {}
        for lm in models:
            self._open(lm)
        self.memory.apply()
        # jobs and control calls handed to the engine thread (admitted at once: what waits to
        # start waits in its scheduler, counted by ``backlog``)
        self._queue: queue.Queue[Job | Control | None] = queue.Queue()
        self.backlog = Backlog(config.max_queue)  # submitted, not started yet
        self._thread: threading.Thread | None = None

    def _open(self, lm: LoadedModel) -> None:
        """A cache and a scheduler for ``lm`` (its weights counted in the budget)."""
        config = self.config
        # --kv-bits picks the rest (``open_cache``): groups of 64 (32 where 64 does not divide
        # head_dim), rotated, keys per channel over a page wherever the model has no recurrent state
        manager = open_cache(
            lm.cache_spec, lm.fingerprint, page_size=config.page_size,
            max_ram_bytes=int(config.max_kv_ram_gb * GB), policy=config.eviction_policy,
            disk_dir=config.kv_cache_dir, max_disk_bytes=int(config.max_kv_size_gb * GB),
            max_resident=config.max_resident_sequences,
            about={"name": lm.name, "source": lm.source}, store_url=config.kv_store,
            store_namespace=config.kv_store_namespace, kv_bits=config.kv_bits,
            max_arrays_bytes=int(config.max_kv_ram_gb * GB) // FEATURES_SHARE
            if getattr(lm, "takes_images", False) else 0)
        draft = self.draft if self.draft is not None and _fits(self._draft_lm, lm) else None
        self.models[lm.name] = lm
        self.managers[lm.name] = manager
        if self.kv_events is not None:
            self.kv_events.watch(manager)
        self.schedulers[lm.name] = Scheduler(
            manager, Runner(lm.model, manager, lm.name),
            max_batch=config.max_batch, prefill_chunk=config.prefill_chunk,
            speculate=config.speculate, num_draft_tokens=config.num_draft_tokens, draft=draft,
            name=lm.name, memory=self.memory)
        self.memory.add_model(lm)
        # under pressure: its kept image-processor outputs, its prepared next turns, then what
        # its cache holds that nothing needs
        scheduler, processor = self.schedulers[lm.name], lm.processor

        def shed() -> int:
            drop_image_outputs(processor)
            return scheduler.shed()

        self.memory.shedders[lm.name] = shed

    def add_model(self, lm: LoadedModel) -> None:
        """Serve ``lm`` from the next step on (call on the engine thread: ``call``). A model of
        that name already served is an error."""
        if lm.name in self.models:
            raise ValueError(f"model {lm.name!r} is served already")
        self._open(lm)
        self.memory.apply()  # what the process holds outside MLX grew with it

    def remove_model(self, name: str) -> bool:
        """Stop serving ``name`` once it is idle (call on the engine thread): its cache is
        flushed to disk and closed, its weights leave the budget. False while it has work or
        when it is not served."""
        s = self.schedulers.get(name)
        if s is None or s.busy:
            return False
        s.close()
        self.schedulers.pop(name)
        manager = self.managers.pop(name)
        if self.kv_events is not None:
            self.kv_events.unwatch(manager)
        manager.close()
        del manager
        self.models.pop(name)
        self.memory.remove_model(name)
        self.memory.shedders.pop(name, None)
        del s
        gc.collect()  # finished requests and their choices hold the model in cycles
        mx.clear_cache()  # after the arrays are freed, or their buffers stay cached
        return True

    # -- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="generation", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        for manager in self.managers.values():
            manager.close()
        if self.draft is not None:
            self.draft.close()
        if self.kv_events is not None:
            self.kv_events.close()

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread, between two steps, and return its result."""
        control = Control(fn)
        self._queue.put(control)  # control calls are small: they do not count against the limit
        return await asyncio.wrap_future(control.future)

    def submit(self, job: Job) -> None:
        """Hand ``job`` to the engine thread; a 429 with ``Retry-After`` when ``--max-queue``
        requests already wait to start (``backlog.py``). Its conversation is rendered and
        tokenized first, here on the caller's thread (``Job.prepare``), so the engine thread runs
        passes only; a prompt that cannot run gets its error as an event, as from the engine,
        and never takes a place in the backlog (a job counted there is in the engine's queue)."""
        try:
            job.prepare()
        except Exception as e:
            self._refuse(job, e)
            return
        self.backlog.enter(job)
        self._queue.put(job)

    @property
    def queued(self) -> int:
        """Requests submitted whose prompt has not started yet."""
        return len(self.backlog)

    @property
    def busy(self) -> bool:
        return any(s.busy for s in self.schedulers.values())

    @property
    def batch_size(self) -> int:
        """Sequences decoding together now (all models)."""
        return sum(s.batch_size for s in self.schedulers.values())

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            for s in self.schedulers.values():
                self._deliver(s.close())
            # NOTE: MLX keeps streams per thread; a thread that ran MLX and ends without
            # clearing them can abort the process at exit ("terminate called without an
            # active exception", seen in 3 of 10 threaded runs, 0 of 12 with this).
            mx.clear_streams()

    def _serve(self) -> None:
        while True:
            block = not self.busy
            if block:
                self._idle()
            while True:  # everything queued now, waiting only when there is nothing to step
                try:
                    item = self._queue.get(block=block)
                except queue.Empty:
                    break
                block = False
                if item is None:
                    return
                if isinstance(item, Control):
                    self._control(item)
                else:
                    self._admit(item)
            self._step()

    @staticmethod
    def _idle() -> None:
        """Nothing to step: MLX's buffer cache (freed arrays kept for reuse, resident) goes
        back to the system. While answers run it may grow into what the budget has free
        (``MemoryBudget``), which spares a pass allocating afresh; kept at rest, it held 1.6 GB
        after 200 mixed requests of a tiny model on this CPU, the server's resident memory 1.60x
        what it was after 100 (an earlier run of benchmarks/memory_growth.py, in
        docs/BENCHMARKS.md's git history). What the passes and the requests
        freed through the C allocator goes back too (``platform/heap.py``)."""
        if mx.get_cache_memory():
            give_back()

    def _step(self) -> None:
        """One step of every busy model (a method of its own: its locals, the last scheduler
        among them, go when it returns, so nothing in the loop keeps a removed model alive)."""
        for scheduler in self.schedulers.values():
            if scheduler.busy:
                try:  # a prompt's first token goes out before the next decode step
                    self._deliver(scheduler.step_prompts())
                    self._deliver(scheduler.step_answers())
                except Exception as e:  # the engine never dies with a request
                    log.exception("step failed")
                    self._deliver(scheduler.fail_all(RequestError(
                        500, f"generation failed: {e}", type="server_error")))
        for manager in self.managers.values():
            manager.flush()  # disk writes, after the step's answers are out

    def _deliver(self, events: Events) -> None:
        for job, event in events:
            if isinstance(event, (Accepted, Error, Done)):
                self.backlog.leave(job, started=isinstance(event, Accepted))
            job.send(event)

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            self._deliver([(job, Done())])
            return
        try:
            self.schedulers[job.lm.name].add(job)
        except Exception as e:
            self._refuse(job, e)

    def _refuse(self, job: Job, e: Exception) -> None:
        """``job`` ends before it starts: its error (a ``RequestError`` as it is, anything else
        a 500), then ``Done``. Call from an ``except`` block."""
        if not isinstance(e, RequestError):
            log.exception("%s could not be admitted", job.id)
            e = RequestError(500, f"generation failed: {e}", type="server_error")
        self._deliver([(job, Error(e)), (job, Done())])

    @staticmethod
    def _control(control: Control) -> None:
        if not control.future.set_running_or_notify_cancel():
            return
        try:
            control.future.set_result(control.fn())
        except BaseException as e:
            control.future.set_exception(e)

    # -- reports and cache management (each runs on the worker thread through ``call``) --------

    def cache_stats(self) -> dict:
        """Per model: memory and disk tiers, the tokens prompts read again, and a vision
        model's encoder runs and image features' hits."""
        out = {}
        for name, manager in self.managers.items():
            report, s = manager.report(), self.schedulers[name]
            out[name] = {**report, "reread": dict(s.reread),
                         "images": self._image_stats(name, report),
                         "queue": {**self.backlog.report(), "waiting_for": s.waiting()},
                         "speculation": {"mode": s.speculation.mode,
                                         **s.speculation.stats.as_dict()},
                         "memory": self.memory_report()}
        return out

    def _image_stats(self, name: str, report: dict) -> dict | None:
        """A vision model's encoder runs and features' hits (``features.py``); None for text."""
        features = self.schedulers[name].runner.features
        return features.stats(report["arrays"]) if features is not None else None

    def memory_report(self) -> dict:
        """The budget and what is spent of it: weights, pages, image features kept in memory,
        working buffers, MLX's cache."""
        pages = sum(m.pool_stats().used_bytes for m in self.managers.values())
        features = sum(m.arrays_bytes() for m in self.managers.values())
        rep = self.memory.report()
        rep["pages_bytes"] = pages
        rep["features_bytes"] = features
        # pictures' image-processor outputs (numpy, outside MLX: in the resident memory)
        rep["image_inputs_bytes"] = sum(kept_image_bytes(lm.processor)
                                        for lm in self.models.values())
        rep["working_bytes"] = max(0, rep["mlx_active_bytes"] - rep["weights_bytes"] - pages
                                   - features)
        return rep

    def entry_info(self, key: str) -> dict | None:
        for name, manager in self.managers.items():
            info = manager.describe(key)
            if info is not None:
                return {"object": "kv_cache.entry", "message_id": key, "model": name, **info}
        return None

    def delete_entry(self, key: str) -> bool:
        return any([manager.drop(key) for manager in self.managers.values()])

    def export_entry(self, key: str) -> tuple[str, bytes] | None:
        for name, manager in self.managers.items():
            data = export_entry(manager, key)
            if data is not None:
                return name, data
        return None

    def import_entry(self, model: str, path: str, key: str | None) -> dict:
        manager = self.managers[model]
        entry = import_entry(manager, path, key)
        info = manager.describe(entry.key)
        return {"object": "kv_cache.entry", "message_id": entry.key, "model": model,
                **{k: info[k] for k in ("tokens", "in_memory", "on_disk")}}


def _fits(draft: LoadedModel, lm: LoadedModel) -> bool:
    try:
        check_draft_model(draft, lm)
        return True
    except DraftModelError as e:
        log.warning("no draft model for %s: %s", lm.name, e)
        return False
