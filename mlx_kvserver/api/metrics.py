"""Prometheus metrics for ``GET /metrics`` (text format, through ``prometheus_client``).

Each app has its own ``CollectorRegistry``, so several servers in one process keep their own
counts. Three sources feed it:

- :class:`RequestCounter`, an ASGI middleware: every HTTP response by route and status (routes
  are fixed labels; a ``message_id`` in a path never becomes a label value);
- :class:`ChatWatch`, fed the events of each chat completion by the API layer: time to first
  token (from the request reaching its handler, queue wait included), decode tokens/s (tokens
  after the first over the time they took), prompt, cached and completion tokens, and the
  tokens of requests' predictions that appeared in the completion or not;
- a snapshot of the engine's cache stats taken at scrape time (:meth:`Metrics.scrape`): RAM
  pages held, cached and shared, bytes against the budget, disk bytes and entries against the
  budget, hits, evictions; a vision model's encoder runs and its image features' hits (memory,
  disk); speculative decoding (``engine/speculation/speculate.py``): draft
  tokens verified and accepted, decode forward passes and the tokens they produced, the mode as a
  label, so that
  ``rate(speculation_accepted_tokens_total) / rate(speculation_draft_tokens_total)`` is the
  acceptance rate and ``rate(decode_step_tokens_total) / rate(decode_steps_total)`` the tokens
  per forward pass; plus the queue depth and the batch size. The batch size is the
  engine's ``batch_size`` attribute when it has one, else 1 while a job runs and 0 when idle.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               generate_latest)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..chat.output import (Error, Event, ReasoningDelta, TextDelta, ToolCallEnd, ToolCallStart,
                           Usage)

__all__ = ["CONTENT_TYPE_LATEST", "ChatWatch", "Metrics", "RequestCounter", "route_label"]

P = "mlx_kvserver_"
EXACT_ROUTES = frozenset({"/", "/health", "/metrics", "/openapi.json", "/v1/models",
                          "/v1/chat/completions", "/v1/completions", "/v1/messages",
                          "/v1/messages/count_tokens", "/v1/responses", "/v1/kv_cache/stats",
                          "/v1/kv_cache/import"})
PREFIX_ROUTES = (("/static/", "/static/{path}"),
                 ("/v1/responses/", "/v1/responses/{response_id}"),
                 ("/v1/kv_cache/export/", "/v1/kv_cache/export/{message_id}"),
                 ("/v1/kv_cache/", "/v1/kv_cache/{message_id}"))
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
RATE_BUCKETS = (1, 2, 5, 10, 20, 30, 50, 75, 100, 200, 500)
CALL_PROBLEMS = frozenset({"truncated", "invalid_json", "invalid_markup", "unknown_tool", "schema",
                           "unparsed", "dropped"})  # a bounded label
STATS_TIMEOUT_S = 2.0  # a scrape during a long job serves the last snapshot instead of waiting


def route_label(path: str) -> str:
    """A bounded label for a request path."""
    if path in EXACT_ROUTES:
        return path
    for prefix, label in PREFIX_ROUTES:
        if path.startswith(prefix):
            return label
    return "other"


class Metrics:
    """The registry of one app and the metrics in it."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.requests = Counter(P + "http_requests", "HTTP responses by route and status",
                                ["route", "status"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Time from a chat request "
                              "reaching the server to its first token", ["model"],
                              buckets=TTFT_BUCKETS, registry=r)
        self.rate = Histogram(P + "decode_tokens_per_second", "Completion tokens after the "
                              "first over the time they took, per request", ["model"],
                              buckets=RATE_BUCKETS, registry=r)
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prompt tokens of finished chat "
                                     "requests", ["model"], registry=r)
        self.cached_tokens = Counter(P + "cached_prompt_tokens", "Prompt tokens that came from "
                                     "the KV cache", ["model"], registry=r)
        self.completion_tokens = Counter(P + "completion_tokens", "Generated tokens", ["model"],
                                         registry=r)
        self.reread = Counter(P + "reread_prompt_tokens", "Prompt tokens read again because "
                              "the prompt differed inside a history held before (the log and "
                              "usage.kv_cache_divergence say where)", ["model"], registry=r)
        self.errors = Counter(P + "generation_errors", "Chat requests that failed after being "
                              "accepted", ["model"], registry=r)
        self.call_problems = Counter(P + "tool_call_problems", "Tool calls the model wrote "
                                     "badly, by kind (chat/call_events.py: truncated, "
                                     "invalid_json, invalid_markup, unknown_tool, schema, "
                                     "unparsed, dropped)", ["model", "kind"], registry=r)
        self.reasoning_tokens = Counter(P + "reasoning_tokens", "Generated tokens inside "
                                        "reasoning", ["model"], registry=r)
        self.prediction_tokens = Counter(P + "prediction_tokens", "Tokens of requests' "
                                         "predictions (Predicted Outputs) that appeared in the "
                                         "completion (accepted) or not (rejected)",
                                         ["model", "outcome"], registry=r)
        self.queue_depth = Gauge(P + "queue_depth", "Requests submitted whose prompt has not "
                                 "started (the queue --max-queue bounds)",
                                 registry=r)
        self.batch_size = Gauge(P + "batch_size", "Sequences the engine is running now",
                                registry=r)
        self.cache = CacheCollector()
        r.register(self.cache)

    def watch(self, model: str) -> "ChatWatch":
        return ChatWatch(self, model)

    async def scrape(self, engine) -> bytes:
        """The text exposition, with a fresh cache snapshot when the worker answers in time."""
        try:
            stats = await asyncio.wait_for(engine.call(engine.cache_stats), STATS_TIMEOUT_S)
            self.cache.update(stats)
        except asyncio.TimeoutError:
            pass  # the worker is in a long job: the last snapshot stands (see its age)
        self.queue_depth.set(engine.queued)
        batch = getattr(engine, "batch_size", None)
        self.batch_size.set(batch if batch is not None else int(bool(engine.busy)))
        return generate_latest(self.registry)


STORE_COUNTERS = (
    ("hits", "Lookups the shared store answered"), ("misses", "Lookups it did not"),
    ("pages_read", "Pages read from the shared store"),
    ("pages_written", "Pages written to the shared store"),
    ("bytes_read", "Bytes read from the shared store"),
    ("bytes_written", "Bytes written to the shared store"),
    ("bad_values", "Store values that failed a check (deleted)"),
    ("errors", "Store commands that failed or timed out"),
    ("dropped_pages", "Pages not written: the store's write queue was full"),
    ("breaker_opens", "Times the store's breaker opened"),
    ("seconds", "Seconds spent in store commands"))

SPECULATION_COUNTERS = (  # (metric, key of the snapshot's "speculation", help)
    ("decode_steps", "decode_steps", "Forward passes that decoded answers (after each answer's "
     "first token; one pass serves the whole batch)"),
    ("decode_step_tokens", "tokens", "Tokens those forward passes produced"),
    ("speculation_verify_steps", "verify_steps", "Of those passes, the ones that verified drafts"),
    ("speculation_draft_tokens", "drafted", "Draft tokens verified (every source: the "
     "sequence, the cache, a draft model, a grammar, a prediction; usage's accepted_draft_tokens "
     "+ rejected_draft_tokens)"),
    ("speculation_accepted_tokens", "accepted", "Draft tokens the answers took"))


class ChatWatch:
    """Follows one chat completion's events (deltas, ``Usage``, ``Error``); ``close`` at the
    end records the decode rate."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.metrics, self.model = metrics, model
        self.t0, self.t_first = time.perf_counter(), None
        self.completion = 0

    def event(self, event: Event) -> None:
        """One of a job's events (``chat/output.py`` types): the first delta that carries
        output (text, reasoning or a tool call) is the first token."""
        m, model = self.metrics, self.model
        if isinstance(event, (TextDelta, ReasoningDelta, ToolCallStart)):
            if self.t_first is None and (event.name if isinstance(event, ToolCallStart)
                                         else event.text):
                self.t_first = time.perf_counter()
                m.ttft.labels(model).observe(self.t_first - self.t0)
        elif isinstance(event, ToolCallEnd):
            if event.problem:
                kind = event.problem.split(":", 1)[0]
                m.call_problems.labels(model, kind if kind in CALL_PROBLEMS else "other").inc()
        elif isinstance(event, Usage):
            m.reasoning_tokens.labels(model).inc(event.reasoning_tokens)
            if event.prediction_accepted or event.prediction_rejected:
                m.prediction_tokens.labels(model, "accepted").inc(event.prediction_accepted)
                m.prediction_tokens.labels(model, "rejected").inc(event.prediction_rejected)
            m.prompt_tokens.labels(model).inc(event.prompt_tokens)
            m.cached_tokens.labels(model).inc(event.cached_tokens)
            m.completion_tokens.labels(model).inc(event.completion_tokens)
            self.completion = event.completion_tokens
            if event.divergence is not None:
                m.reread.labels(model).inc(event.divergence.reread_tokens)
        elif isinstance(event, Error):
            m.errors.labels(model).inc()

    def close(self) -> None:
        if self.t_first is not None and self.completion > 1:
            elapsed = time.perf_counter() - self.t_first
            if elapsed > 0:
                self.metrics.rate.labels(self.model).observe((self.completion - 1) / elapsed)
        self.t_first = None  # once


class CacheCollector:
    """Gauges and counters read from the last ``Engine.cache_stats()`` snapshot."""

    def __init__(self) -> None:
        self.stats: dict[str, dict] | None = None
        self.taken = 0.0

    def update(self, stats: dict[str, dict]) -> None:
        self.stats, self.taken = stats, time.monotonic()

    def describe(self):
        return []  # the families depend on the snapshot; nothing to check at registration

    def collect(self):
        if self.stats is None:
            return
        families: dict[str, Any] = {}

        def add(kind, name: str, doc: str, model: str, value, **labels) -> None:
            if value is None:
                return
            if name not in families:
                families[name] = kind(P + name, doc, labels=["model", *labels])
            families[name].add_metric([model, *labels.values()], float(value))

        counter, gauge = CounterMetricFamily, GaugeMetricFamily
        for model, s in self.stats.items():
            ram, disk = s["ram"], s.get("disk") or {}
            add(counter, "kv_cache_hits", "Lookups that reused cached tokens", model, s["hits"])
            add(counter, "kv_cache_misses", "Lookups that found nothing", model, s["misses"])
            add(counter, "kv_cache_tokens_served", "Prompt tokens served from the cache", model,
                s["tokens_served"])
            add(counter, "kv_cache_disk_hits", "Hits read from disk", model, s["disk_hits"])
            page_bytes = ram["bytes"] // ram["pages"] if ram["pages"] else 0
            shared = ram["bytes_shared"] // page_bytes if page_bytes else 0
            for state, n in (("held", ram["pages_held"]), ("cached", ram["pages_cached"]),
                             ("shared", shared)):
                add(gauge, "kv_ram_pages", "KV pages in RAM: held by a sequence or entry, "
                    "cached for reuse, shared by more than one holder", model, n, state=state)
            add(gauge, "kv_ram_bytes", "Bytes of KV pages in RAM", model, ram["bytes"])
            add(gauge, "kv_ram_shared_bytes", "Bytes of RAM pages with more than one holder",
                model, ram["bytes_shared"])
            add(gauge, "kv_ram_budget_bytes", "RAM budget of the KV pages", model,
                ram["budget_bytes"])
            add(gauge, "kv_ram_entries", "Cache entries in RAM", model, ram["entries"])
            add(counter, "kv_ram_evictions", "Pages evicted from RAM", model, ram["evictions"])
            add(gauge, "kv_disk_enabled", "1 when the disk tier is on", model,
                int(bool(s.get("disk_enabled"))))
            add(gauge, "kv_disk_bytes", "Bytes of the disk tier", model, disk.get("bytes_on_disk"))
            add(gauge, "kv_disk_budget_bytes", "Disk budget", model, disk.get("budget"))
            add(gauge, "kv_disk_entries", "Cache entries on disk", model, disk.get("entries"))
            add(counter, "kv_disk_evictions", "Entries evicted from disk", model,
                disk.get("evictions"))
            add(counter, "kv_disk_errors", "Disk tier I/O errors", model, disk.get("errors"))
            images = s.get("images")
            if images is not None:  # a vision model's encoder and its features kept by image
                add(counter, "image_encoder_runs", "Vision encoder runs: once per distinct "
                    "image while its features are kept", model, images["encoder_runs"])
                for source in ("memory", "disk"):
                    add(counter, "image_feature_hits", "Images whose encoder output came from "
                        "the cache (memory or disk) instead of the encoder", model,
                        images["feature_hits_" + source], source=source)
                add(gauge, "image_features_bytes", "Bytes of image features kept in memory",
                    model, images["features_bytes"])
            store = s.get("store")
            add(gauge, "kv_store_enabled", "1 when the shared store tier is on", model,
                int(store is not None))
            for name, doc in STORE_COUNTERS:
                add(counter, "kv_store_" + name, doc, model, (store or {}).get(name))
            for reason, n in (s.get("queue") or {}).get("waiting_for", {}).items():
                add(gauge, "queue_waiting", "Requests admitted whose prompt has not started, by "
                    "what they wait for (memory, batch: a place in --max-batch, prompts_ahead)",
                    model, n, reason=reason)
            spec = s.get("speculation")
            if spec is not None:
                add(gauge, "speculation_mode", "1 for the model's speculative decoding mode "
                    "(off, ngram, draft)", model, 1, mode=spec.get("mode", "off"))
                for name, key, doc in SPECULATION_COUNTERS:
                    add(counter, name, doc, model, spec.get(key))
            if store is not None:
                add(gauge, "kv_store_breaker_open", "1 while the store is not asked (its "
                    "breaker open after repeated errors)", model, int(store["breaker"] != "closed"))
                add(gauge, "kv_store_queued", "Entry writes not finished for the store (waiting or being written)", model,
                    store["queued"])
        yield from families.values()
        first = next(iter(self.stats.values()), {})
        yield from _memory(first.get("memory"))
        yield from _queue(first.get("queue"))
        age = GaugeMetricFamily(P + "kv_stats_age_seconds", "Age of the cache snapshot above")
        age.add_metric([], time.monotonic() - self.taken)
        yield age


MEMORY_GAUGES = (
    ("limit_bytes", "The server's memory limit (--memory-limit)"),
    ("weights_bytes", "Bytes of the loaded models' weights"),
    ("pages_bytes", "Bytes of KV pages in RAM, all models"),
    ("features_bytes", "Bytes of image features kept in memory, all models"),
    ("image_inputs_bytes", "Bytes of pictures' image-processor outputs kept, all models"),
    ("working_bytes", "Bytes MLX holds beyond weights and pages: working buffers, views"),
    ("mlx_active_bytes", "Bytes MLX holds now"), ("mlx_cache_bytes", "MLX's buffer cache"),
    ("mlx_peak_bytes", "The most MLX has held since the process started, loads included"),
    ("load_peak_bytes", "The most MLX held while a model was loading"),
    ("outside_mlx_bytes", "What the process holds outside MLX (measured, or --memory-reserve)"),
    ("margin_bytes", "Kept free for what the process adds between two of the budget's checks"))


def _memory(m: dict | None):
    """The server's memory budget and what is spent of it (no model label: one budget)."""
    if not m:
        return
    for key, doc in MEMORY_GAUGES:
        g = GaugeMetricFamily(P + "memory_" + key, doc)
        g.add_metric([], float(m.get(key) or 0))
        yield g
    for key, doc in (("refused", "Requests refused: they could not fit even alone"),
                     ("pressure_events", "Times memory ran short before a pass")):
        c = CounterMetricFamily(P + "memory_" + key, doc)
        c.add_metric([], float(m.get(key) or 0))
        yield c


def _queue(q: dict | None):
    """The requests waiting to start, all models (``engine/backlog.py``)."""
    if not q:
        return
    g = GaugeMetricFamily(P + "queue_oldest_wait_seconds", "Seconds the longest-waiting "
                          "request has waited to start")
    g.add_metric([], float(q.get("oldest_wait_s") or 0))
    yield g
    c = CounterMetricFamily(P + "queue_refused", "Requests refused with a 429: --max-queue "
                            "requests were waiting")
    c.add_metric([], float(q.get("refused") or 0))
    yield c


class RequestCounter:
    """ASGI middleware: counts every HTTP response by route and status (500 for an exception
    that escapes before a response starts)."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        route, status = route_label(scope.get("path", "")), None

        async def counted(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.requests.labels(route, str(status)).inc()
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception:
            if status is None:
                self.metrics.requests.labels(route, "500").inc()
            raise
