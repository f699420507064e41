"""The generation worker: one thread owns the models and their caches; requests queue.

The HTTP layer submits a ``Job`` and reads its events from an asyncio queue: ``accepted``
(prompt checked, cache looked up), ``start``/``delta``/``finish`` per choice, ``usage``,
``error`` and finally ``done``. A job whose client went away is cancelled between two steps.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import mlx.core as mx

from kv_cache.disk_store import DiskStore
from kv_cache.errors import OutOfBlocksError
from kv_cache.manager import CacheManager
from kv_cache.page_pool import PagePool
from kv_cache.sequence import PagedSequence
from kv_cache.transfer import export_entry, import_entry

from .errors import APIError
from .generation import Cancelled, ChoiceResult, decode, prefill
from .models import LoadedModel
from .schemas import ChatRequest

log = logging.getLogger("mlx_kvserver.worker")


def new_message_id() -> str:
    return f"msg-{uuid.uuid4().hex}"


@dataclass
class Job:
    request: ChatRequest
    lm: LoadedModel
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex}")
    created: int = field(default_factory=lambda: int(time.time()))

    def emit(self, kind: str, data: Any = None) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, data))

    def cancel(self) -> None:
        self.cancelled.set()


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
    """Owns the models' caches and runs jobs one at a time on a worker thread."""

    def __init__(self, models: list[LoadedModel], cache: CacheConfig | None = None,
                 max_queue: int = 64):
        self.models = {lm.name: lm for lm in models}
        self.cache_config = cache or CacheConfig()
        self.managers: dict[str, CacheManager] = {}
        for lm in models:
            pool = PagePool(spec=lm.cache_spec, page_size=self.cache_config.page_size,
                            max_bytes=self.cache_config.max_ram_bytes,
                            policy=self.cache_config.policy, fingerprint=lm.fingerprint)
            self.managers[lm.name] = CacheManager(pool, open_store(lm, self.cache_config),
                                                  max_resident=self.cache_config.max_resident)
        self._queue: queue.Queue[Job | Control | None] = queue.Queue(maxsize=max_queue)
        self._thread: threading.Thread | None = None
        self.busy = False

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
        """Run ``fn`` on the worker thread, between two jobs, and return its result."""
        control = Control(fn)
        self._queue.put(control)  # control calls are small: they do not count against the limit
        return await asyncio.wrap_future(control.future)

    def submit(self, job: Job) -> None:
        try:
            self._queue.put_nowait(job)
        except queue.Full:
            raise APIError(429, "the server is busy; try again shortly",
                           type="rate_limit_error", code="queue_full")

    @property
    def queued(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        try:
            self._serve()
        finally:
            # NOTE: MLX keeps streams per thread; a thread that ran MLX and ends without
            # clearing them can abort the process at exit ("terminate called without an
            # active exception", seen in 3 of 10 threaded runs, 0 of 12 with this).
            mx.clear_streams()

    def _serve(self) -> None:
        while (job := self._queue.get()) is not None:
            if isinstance(job, Control):
                self._control(job)
                continue
            self.busy = True
            try:
                if job.cancelled.is_set():
                    continue
                self._run(job)
            except Cancelled:
                log.info("%s cancelled by the client", job.id)
            except APIError as e:
                job.emit("error", e)
            except Exception as e:  # the worker never dies with a request
                log.exception("%s failed", job.id)
                job.emit("error", APIError(500, f"generation failed: {e}", type="server_error"))
            finally:
                job.emit("done")
                for manager in self.managers.values():
                    manager.flush()  # disk writes, after the answer is out
                self.busy = False

    @staticmethod
    def _control(control: Control) -> None:
        if not control.future.set_running_or_notify_cancel():
            return
        try:
            control.future.set_result(control.fn())
        except BaseException as e:
            control.future.set_exception(e)

    # -- one job --------------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        req, lm = job.request, job.lm
        tok = lm.tokenizer
        prompt = tok.encode(tok.render([m.as_template_dict() for m in req.messages],
                                       add_generation_prompt=True))
        room = lm.context_length - len(prompt)
        if room < 1:
            raise APIError(400, f"the prompt has {len(prompt)} tokens; this model's context is "
                           f"{lm.context_length}", param="messages",
                           code="context_length_exceeded")
        max_tokens = min(req.params.max_tokens or room, room)
        manager = self.managers[lm.name]
        keys = [m.message_id for m in reversed(req.messages) if m.message_id]
        cancelled = job.cancelled.is_set
        seq, match = manager.start(prompt, keys, use_cache=req.use_kv_cache)
        job.emit("accepted", {"prompt_tokens": len(prompt), "cached_tokens": match.tokens,
                              "source": match.source})
        if req.params.seed is not None:
            mx.random.seed(req.params.seed)
        completion_tokens, keep = 0, False
        try:
            t0 = time.perf_counter()
            logits = prefill(lm.model, seq, prompt[match.tokens:], cancelled)
            log.info("%s: %d prompt tokens, %d from cache (%s), prefill %.2fs", job.id,
                     len(prompt), match.tokens, match.source, time.perf_counter() - t0)
            if req.use_kv_cache:
                self._save(manager, req.messages[-1].message_id, seq)
            shared = req.n > 1 and req.use_kv_cache  # the choices fork the prompt's pages
            for index in range(req.n):
                branch = seq
                if shared:
                    try:
                        branch = seq.fork()
                    except OutOfBlocksError as e:  # the prompt does not fit the page pool
                        log.warning("%s: %s; each choice recomputes the prompt", job.id, e)
                        shared = False
                if not shared and index > 0:  # no cache: every choice recomputes its prompt
                    branch = PagedSequence(manager.pool)
                    logits = prefill(lm.model, branch, prompt, cancelled)
                result = ChoiceResult(index, new_message_id())
                job.emit("start", {"index": index, "message_id": result.message_id})
                try:
                    decode(lm.model, tok, branch, logits, max_tokens=max_tokens,
                           temperature=req.params.temperature, top_p=req.params.top_p,
                           stop=req.params.stop, result=result, is_cancelled=cancelled,
                           on_text=lambda t, i=index: job.emit("delta", {"index": i, "text": t}))
                    if req.use_kv_cache:
                        self._save(manager, result.message_id, branch)
                finally:
                    if branch is not seq:
                        branch.close()
                completion_tokens += len(result.tokens)
                job.emit("finish", {"index": index, "reason": result.finish_reason,
                                    "message_id": result.message_id, "text": result.text})
                if index == 0 and shared:
                    seq.drop_buffers()  # the branches gather the prompt from its pages
            keep = req.use_kv_cache and req.n == 1
        finally:
            if keep:  # the next turn of this conversation goes on from its buffers
                manager.keep(seq)
            else:
                seq.close()
        job.emit("usage", {"prompt_tokens": len(prompt), "completion_tokens": completion_tokens,
                           "cached_tokens": match.tokens})

    @staticmethod
    def _save(manager: CacheManager, key: str | None, seq: PagedSequence) -> None:
        if not key:
            return
        try:
            manager.save(key, seq)
        except OutOfBlocksError as e:  # the answer still goes out, without a cache entry
            log.warning("not caching %s: %s", key, e)

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
                   "evictions": s.evictions}
            disk = manager.store.stats() if manager.store is not None else None
            out[name] = {"hits": m.hits, "misses": m.misses, "tokens_served": m.tokens_served,
                         "disk_hits": m.disk_hits, "tokens_from_disk": m.tokens_from_disk,
                         "pages_read_from_disk": m.pages_read_from_disk,
                         "disk_saves": m.disk_saves,
                         "disk_save_failures": m.disk_save_failures,
                         "ram": ram, "disk": disk,
                         "disk_enabled": manager.store is not None}
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
