"""The generation worker: one thread owns the models and their caches; requests queue.

The HTTP layer submits a ``Job`` and reads its events from an asyncio queue: ``accepted``
(prompt checked, cache looked up), ``start``/``delta``/``finish`` per choice, ``usage``,
``error`` and finally ``done``. A job whose client went away is cancelled between two steps.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx

from kv_cache.errors import OutOfBlocksError
from kv_cache.manager import CacheManager
from kv_cache.page_pool import PagePool
from kv_cache.sequence import PagedSequence

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
class CacheConfig:
    page_size: int = 32
    max_ram_bytes: int = 2 << 30
    policy: str = "lru"


class Engine:
    """Owns the models' caches and runs jobs one at a time on a worker thread."""

    def __init__(self, models: list[LoadedModel], cache: CacheConfig | None = None,
                 max_queue: int = 64):
        self.models = {lm.name: lm for lm in models}
        self.cache_config = cache or CacheConfig()
        self.managers: dict[str, CacheManager] = {}
        for lm in models:
            pool = PagePool(lm.num_layers, lm.num_kv_heads, lm.head_dim,
                            page_size=self.cache_config.page_size, dtype=lm.dtype,
                            max_bytes=self.cache_config.max_ram_bytes,
                            policy=self.cache_config.policy, fingerprint=lm.fingerprint)
            self.managers[lm.name] = CacheManager(pool)
        self._queue: queue.Queue[Job | None] = queue.Queue(maxsize=max_queue)
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
            self._thread.join(timeout=30)
            self._thread = None

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
        while (job := self._queue.get()) is not None:
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
                self.busy = False
                job.emit("done")

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
        completion_tokens = 0
        try:
            t0 = time.perf_counter()
            logits = prefill(lm.model, seq, prompt[match.tokens:], cancelled)
            log.info("%s: %d prompt tokens, %d from cache (%s), prefill %.2fs", job.id,
                     len(prompt), match.tokens, match.source, time.perf_counter() - t0)
            if req.use_kv_cache:
                self._save(manager, req.messages[-1].message_id, seq)
            for index in range(req.n):
                branch = seq
                if req.n > 1 and req.use_kv_cache:
                    branch = seq.fork()
                elif index > 0:  # no cache: every choice recomputes its prompt
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
                if index == 0 and req.n > 1 and req.use_kv_cache:
                    seq.drop_buffers()  # the branches gather the prompt from its pages
        finally:
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
        out = {}
        for name, manager in self.managers.items():
            s, m = manager.pool.stats(), manager.stats
            out[name] = {
                "entries": len(manager), "hits": m.hits, "misses": m.misses,
                "tokens_served": m.tokens_served, "page_size": s.page_size,
                "pages_used": s.used_pages, "pages_held": s.held_pages,
                "pages_cached": s.cached_pages, "bytes_in_ram": s.used_bytes,
                "ram_budget_bytes": manager.pool.max_bytes, "evictions": s.evictions,
            }
        return out
