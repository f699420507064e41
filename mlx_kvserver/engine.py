"""The engine: one thread owns the models, their caches and their schedulers.

The HTTP layer submits a ``Job`` (``request.py``) and reads its events from an asyncio queue.
The engine thread admits queued jobs between steps, runs cache-management calls (``call``)
between steps, and steps every model's scheduler (``scheduler.py``) while any has work: many
requests are answered at once, each step decoding one token for all of them.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import queue
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from kv_cache.model.attention import PrefixViews
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from kv_cache.transfer import export_entry, import_entry

from .errors import RequestError
from .models import LoadedModel
from .request import Job
from .runner import Runner
from .scheduler import MAX_BATCH, PREFILL_CHUNK, Scheduler

log = logging.getLogger("mlx_kvserver.engine")

__all__ = ["CacheConfig", "Engine", "Job", "open_store"]


@dataclass
class Control:
    """A function to run on the worker thread (cache management), with its result."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class CacheConfig:
    page_size: int = 32
    max_ram_bytes: int = 2 << 30
    policy: str = "lru"
    disk_dir: Path | None = None  # None: memory only
    max_disk_bytes: int = 10 << 30
    disk_policy: str = "lru"
    max_resident: int = 4  # finished sequences kept with their working buffers


def open_store(lm: LoadedModel, cache: CacheConfig) -> DiskStore | None:
    """The model's disk store under ``disk_dir/<fingerprint prefix>``, or None (logged) when
    the directory cannot be used: the server then runs with its memory cache only."""
    if cache.disk_dir is None:
        return None
    root = Path(cache.disk_dir) / hashlib.sha256(lm.fingerprint.encode()).hexdigest()[:16]
    if root.is_symlink():  # NOTE: planted in our directory; following it would leave the tree
        log.warning("disk cache: %s is a symlink, not a directory; removed", root)
        try:
            root.unlink()
        except OSError:
            pass
    try:
        store = DiskStore(root, fingerprint=lm.fingerprint, spec=lm.cache_spec,
                          page_size=cache.page_size, max_bytes=cache.max_disk_bytes,
                          policy=cache.disk_policy)
    except Exception as e:  # unreadable dir, locked by another server, ...
        log.warning("disk cache for %s disabled: cannot open %s: %s", lm.name, root, e)
        return None
    note = json.dumps({"name": lm.name, "source": lm.source, "fingerprint": lm.fingerprint})
    store.write_note("model.json", note.encode())
    log.info("disk cache for %s at %s (%d entries)", lm.name, root, len(store.keys()))
    return store


class Engine:
    """Owns the models' caches and schedulers and steps them on one thread."""

    def __init__(self, models: list[LoadedModel], cache: CacheConfig | None = None,
                 max_queue: int = 64, max_batch: int = MAX_BATCH,
                 prefill_chunk: int = PREFILL_CHUNK):
        self.models = {lm.name: lm for lm in models}
        self.cache_config = cache or CacheConfig()
        self.managers: dict[str, CacheManager] = {}
        self.schedulers: dict[str, Scheduler] = {}
        for lm in models:
            pool = PagePool(spec=lm.cache_spec, page_size=self.cache_config.page_size,
                            max_bytes=self.cache_config.max_ram_bytes,
                            policy=self.cache_config.policy, fingerprint=lm.fingerprint)
            manager = CacheManager(pool, open_store(lm, self.cache_config),
                                   max_resident=self.cache_config.max_resident)
            runner = Runner(lm.model, manager, lm.name)
            if runner.batched:
                manager.views = PrefixViews(pool)
            self.managers[lm.name] = manager
            self.schedulers[lm.name] = Scheduler(manager, runner, max_batch=max_batch,
                                                 prefill_chunk=prefill_chunk)
        self._queue: queue.Queue[Job | Control | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None

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

    async def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the engine thread, between two steps, and return its result."""
        control = Control(fn)
        self._queue.put(control)  # control calls are small: they do not count against the limit
        return await asyncio.wrap_future(control.future)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise RequestError(429, "the server is busy; try again shortly",
                           type="rate_limit_error", code="queue_full")

    @property
    def queued(self) -> int:
        return self._queue.qsize()

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
                s.close()
            # NOTE: MLX keeps streams per thread; a thread that ran MLX and ends without
            # clearing them can abort the process at exit ("terminate called without an
            # active exception", seen in 3 of 10 threaded runs, 0 of 12 with this).
            mx.clear_streams()

    def _serve(self) -> None:
        while True:
            block = not self.busy
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
            for scheduler in self.schedulers.values():
                if scheduler.busy:
                    try:
                        scheduler.step()
                    except Exception as e:  # the engine never dies with a request
                        log.exception("step failed")
                        scheduler.fail_all(RequestError(500, f"generation failed: {e}",
                                                    type="server_error"))
            for manager in self.managers.values():
                manager.flush()  # disk writes, after the step's answers are out

    def _admit(self, job: Job) -> None:
        if job.cancelled.is_set():
            job.emit("done")
            return
        try:
            self.schedulers[job.lm.name].add(job)
        except RequestError as e:
            job.emit("error", e)
            job.emit("done")
        except Exception as e:
            log.exception("%s could not be admitted", job.id)
            job.emit("error", RequestError(500, f"generation failed: {e}",
                                           type="server_error"))
            job.emit("done")

    @staticmethod
    def _control(control: Control) -> None:
        if not control.future.set_running_or_notify_cancel():
            return
        try:
            control.future.set_result(control.fn())
        except BaseException as e:
            control.future.set_exception(e)

    # -- reports --------------------------------------------------------------------------------

    def cache_stats(self) -> dict:
        """Per model: memory and disk tiers (call on the worker thread)."""
        out = {}
        for name, manager in self.managers.items():
            manager.sync()
            pool = manager.pool
            s, m = pool.stats(), manager.stats
            refs = pool.ref_counts()
            ram = {"entries": len(manager), "pages": s.used_pages, "pages_held": s.held_pages,
                   "pages_cached": s.cached_pages, "bytes": s.used_bytes,
                   "bytes_shared": sum(pool.block_bytes(b) for b, n in refs.items() if n > 1),
                   "budget_bytes": pool.max_bytes, "page_size": s.page_size,
                   "resident_sequence_tokens": manager.resident_tokens(),
                   "prefix_view_bytes": manager.views.nbytes if manager.views else 0,
                   "evictions": s.evictions}
            disk = asdict(manager.store.stats()) if manager.store is not None else None
            out[name] = {"hits": m.hits, "misses": m.misses, "tokens_served": m.tokens_served,
                         "disk_hits": m.disk_hits, "tokens_from_disk": m.tokens_from_disk,
                         "pages_read_from_disk": m.pages_read_from_disk,
                         "disk_saves": m.disk_saves,
                         "disk_save_failures": m.disk_save_failures,
                         "ram": ram, "disk": disk,
                         "disk_enabled": manager.store is not None,
                         "reread": dict(self.schedulers[name].reread)}
        return out

    # -- cache management (each runs on the worker thread through ``call``) ---------------------

    def entry_info(self, key: str) -> dict | None:
        for name, manager in self.managers.items():
            manager.sync()
            entry = manager.get(key)
            stored = manager.store.get(key) if manager.store is not None else None
            if entry is None and stored is None:
                continue
            tokens = entry.tokens if entry is not None else stored.tokens
            return {"object": "kv_cache.entry", "message_id": key, "model": name,
                    "tokens": len(tokens), "in_memory": entry is not None,
                    "on_disk": stored is not None, "page_size": manager.pool.page_size,
                    "pages": -(-len(tokens) // manager.pool.page_size)}
        return None

    def delete_entry(self, key: str) -> bool:
        return any([manager.drop(key) for manager in self.managers.values()])

    def export_entry(self, key: str) -> tuple[str, bytes] | None:
        for name, manager in self.managers.items():
            manager.sync()
            data = export_entry(manager, key)
            if data is not None:
                return name, data
        return None

    def import_entry(self, model: str, path: str, key: str | None) -> dict:
        manager = self.managers[model]
        entry = import_entry(manager, path, key)
        manager.sync()
        return {"object": "kv_cache.entry", "message_id": entry.key, "model": model,
                "tokens": len(entry.tokens), "in_memory": True,
                "on_disk": manager.store is not None and manager.store.get(entry.key) is not None}
