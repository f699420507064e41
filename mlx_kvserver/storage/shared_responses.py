"""Stored responses shared by the servers of one KV store (``--kv-store``): a response created on
one server is found by ``previous_response_id`` (and ``GET``/``DELETE /v1/responses/{id}``) on
any other, as their KV pages are.

Each record stays in the server's own store (``ResponseStore``: its disk) and is written to the
shared one too, under ``<namespace>:responses:v<FORMAT>:<sha256(id) hex>`` (a response id is
client input: only its hash is a key), as the same JSON a file holds (``format``, ``id``,
``record``). A read asks the shared store only when the local one has no record, and keeps what
it finds locally. The store is never a dependency of an answer: every command has a short
timeout, and after an error none is sent for ``COOL_DOWN`` seconds (a miss meanwhile); a value
that is not a record of its id is a miss, logged and deleted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from ..config import ServerConfig
from .responses import FORMAT, ResponseStore

log = logging.getLogger("mlx_kvserver.responses")

COOL_DOWN = 5.0  # seconds without a command after one failed
PASSWORD_ENV = "KV_STORE_PASSWORD"


def record_key(namespace: str, response_id: str) -> str:
    digest = hashlib.sha256(response_id.encode("utf-8", "surrogatepass")).hexdigest()
    return f"{namespace}:responses:v{FORMAT}:{digest}"


def connect(url: str) -> Any:
    """A ``redis`` client for a store URL (``valkey://`` is ``redis://``), short timeouts, the
    password from ``KV_STORE_PASSWORD`` when the URL has none."""
    import redis

    parts = urlsplit(url)
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    extra = {"password": os.environ[PASSWORD_ENV]} \
        if parts.password is None and os.environ.get(PASSWORD_ENV) else {}
    return redis.Redis.from_url(urlunsplit((scheme, *parts[1:])), socket_connect_timeout=0.5,
                                socket_timeout=2.0, **extra)


def open_store(config: ServerConfig) -> ResponseStore | SharedResponses:
    """The server's stored responses: its own store (``ResponseStore.open``), and with a shared
    KV store (``--kv-store``) shared through it too."""
    local = ResponseStore.open(config)
    if config.kv_store is None:
        return local
    return SharedResponses(local, connect(config.kv_store), config.kv_store_namespace)


class SharedResponses:
    """``ResponseStore``'s interface over a local store and the shared one."""

    def __init__(self, local: ResponseStore, client: Any, namespace: str):
        self.local, self.client, self.namespace = local, client, namespace
        self.memory, self.root = local.memory, local.root
        self._quiet_until = 0.0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.local)

    def _command(self, what: str, fn) -> Any:
        """``fn(client)``, or None when the store failed now or lately (logged once each)."""
        if time.monotonic() < self._quiet_until:
            return None
        try:
            return fn(self.client)
        except Exception as e:  # the library's errors, a refused connection, a timeout
            with self._lock:
                self._quiet_until = time.monotonic() + COOL_DOWN
            log.warning("response store: the shared store failed to %s (%s: %s); not asked "
                        "for %.0f s", what, type(e).__name__, e, COOL_DOWN)
            return None

    def get(self, response_id: str) -> dict | None:
        record = self.local.get(response_id)
        if record is not None:
            return record
        key = record_key(self.namespace, response_id)
        value = self._command("read", lambda c: c.get(key))
        if value is None:
            return None
        try:
            stored = json.loads(value)
            if not isinstance(stored, dict) or stored.get("format") != FORMAT \
                    or stored.get("id") != response_id or not isinstance(stored["record"], dict):
                raise ValueError("not a stored response of this id")
        except (ValueError, KeyError, RecursionError) as e:
            log.warning("response store: the shared value of %s is unreadable (%s); deleted",
                        key, e)
            self._command("delete", lambda c: c.delete(key))
            return None
        self.local.put(response_id, stored["record"])
        return stored["record"]

    def put(self, response_id: str, record: dict) -> bool:
        kept = self.local.put(response_id, record)
        data = json.dumps({"format": FORMAT, "id": response_id, "record": record},
                          ensure_ascii=False).encode("utf-8", "surrogatepass")
        if len(data) <= self.local.max_bytes:
            self._command("write", lambda c: c.set(record_key(self.namespace, response_id),
                                                   data))
        return kept

    def delete(self, response_id: str) -> bool:
        here = self.local.delete(response_id)
        there = self._command("delete", lambda c: c.delete(record_key(self.namespace,
                                                                      response_id)))
        return here or bool(there)

    def close(self) -> None:
        self.local.close()
        try:
            self.client.close()
        except Exception:
            pass
