"""The link to a Valkey or Redis server: its URL, short timeouts, and a breaker.

The store is an accelerator, never a dependency of an answer: every command has short connect
and command timeouts, and after ``fail_limit`` consecutive errors the breaker opens and no
command is sent for ``cool_down`` seconds (each call then fails at once, as a miss). The next
call after that is a trial: its success closes the breaker, its failure opens it again. The
client library (``redis`` with ``hiredis``, see docs/BENCHMARKS.md) is imported when a link is
made, so a server without a store needs nothing of it.

A URL is ``redis://``, ``rediss://`` (TLS), ``valkey://`` / ``valkeys://`` (the same protocol)
or ``unix://``; a password comes from the URL or else from ``KV_STORE_PASSWORD``. The password
never reaches a log line: ``redact`` is what is shown.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, TypeVar
from urllib.parse import urlsplit, urlunsplit

log = logging.getLogger("kv_cache.store")
T = TypeVar("T")
PASSWORD_ENV = "KV_STORE_PASSWORD"
FAIL_LIMIT, COOL_DOWN = 3, 5.0  # the breaker's defaults: errors in a row, seconds not asked
SCHEMES = {"redis": "redis", "rediss": "rediss", "valkey": "redis", "valkeys": "rediss",
           "unix": "unix"}


class StoreUnavailable(Exception):
    """A command was not answered (an error, a timeout, or the breaker is open)."""


def normalize_url(url: str) -> str:
    """``url`` in the client's own scheme (``valkey`` is ``redis``); ValueError if not a store
    URL."""
    parts = urlsplit(url)
    scheme = SCHEMES.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"not a store URL (redis://, rediss://, valkey://, unix://): "
                         f"{redact(url)}")
    if scheme != "unix" and not parts.hostname:
        raise ValueError(f"no host in the store URL {redact(url)}")
    if scheme == "unix" and not parts.path:
        raise ValueError(f"no socket path in the store URL {redact(url)}")
    return urlunsplit((scheme,) + tuple(parts[1:]))


def redact(url: str) -> str:
    """``url`` with its password (if any) replaced by ``***``: what logs and stats show."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit((parts.scheme, f"{user}:***@{host}") + tuple(parts[2:]))


class Breaker:
    """Consecutive failures open it for ``cool_down`` seconds; then one trial call decides."""

    def __init__(self, fail_limit: int | None = None, cool_down: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.fail_limit = FAIL_LIMIT if fail_limit is None else fail_limit
        self.cool_down = COOL_DOWN if cool_down is None else cool_down
        self.clock = clock
        self.failures = 0
        self.opened_at: float | None = None
        self.opens = 0
        self._lock = threading.Lock()

    @property
    def state(self) -> str:
        with self._lock:
            if self.opened_at is None:
                return "closed"
            return "open" if self.clock() - self.opened_at < self.cool_down else "half-open"

    def allow(self) -> bool:
        """Whether a call may go out now (closed, or a trial once the cool-down is over)."""
        with self._lock:
            if self.opened_at is None:
                return True
            if self.clock() - self.opened_at < self.cool_down:
                return False
            self.opened_at = self.clock()  # NOTE: one trial per cool-down, the rest wait
            return True

    def success(self) -> bool:
        """Record a success; True if that closed an open breaker."""
        with self._lock:
            was_open = self.opened_at is not None
            self.failures, self.opened_at = 0, None
            return was_open

    def failure(self) -> bool:
        """Record a failure; True if that opened the breaker."""
        with self._lock:
            self.failures += 1
            if self.failures >= self.fail_limit:
                opening = self.opened_at is None
                self.opened_at = self.clock()
                self.opens += opening
                return opening
            return False


class Link:
    """One client (a connection pool: thread-safe) to the store, behind a ``Breaker``.

    ``call(fn)`` runs ``fn(client)``; any error or an open breaker is ``StoreUnavailable``.
    ``errors`` and ``seconds`` count what calls cost."""

    def __init__(self, url: str, connect_timeout: float = 0.5, timeout: float = 2.0,
                 breaker: Breaker | None = None, client: Any = None):
        self.url = redact(url)
        self.breaker = breaker or Breaker()
        self.errors = 0
        self.seconds = 0.0
        self.last_error = ""
        self._lock = threading.Lock()
        self.client = client if client is not None else _client(url, connect_timeout, timeout)

    def call(self, fn: Callable[[Any], T]) -> T:
        if not self.breaker.allow():
            raise StoreUnavailable("the store's breaker is open")
        t0 = time.perf_counter()
        try:
            out = fn(self.client)
        except Exception as e:  # the library's errors, a refused connection, a timeout
            self._failed(e)
            raise StoreUnavailable(str(e)) from e
        finally:
            with self._lock:
                self.seconds += time.perf_counter() - t0
        if self.breaker.success():
            log.warning("kv store %s answers again: in use again", self.url)
        return out

    def check(self) -> bool:
        """A start-up check (PING): False, with a clear warning, when the store cannot be used
        now (unreachable, wrong password); the server runs on its local tiers meanwhile."""
        try:
            self.call(lambda c: c.ping())
            return True
        except StoreUnavailable as e:
            cause = e.__cause__
            what = "authentication failed (check the password in the URL or " \
                f"{PASSWORD_ENV})" if _is_auth_error(cause) else f"unreachable ({cause or e})"
            log.warning("kv store %s: %s; answering from the local tiers until it answers",
                        self.url, what)
            return False

    def _failed(self, e: Exception) -> None:
        with self._lock:
            self.errors += 1
            self.last_error = type(e).__name__
        if self.breaker.failure():
            log.warning("kv store %s failing (%s: %s): not asked for %.0f s", self.url,
                        type(e).__name__, e, self.breaker.cool_down)
        else:
            log.info("kv store %s: %s: %s", self.url, type(e).__name__, e)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


def _is_auth_error(e: BaseException | None) -> bool:
    name = type(e).__name__
    text = str(e).lower()
    return name in ("AuthenticationError", "AuthenticationWrongNumberOfArgsError") \
        or "wrongpass" in text or "noauth" in text or "invalid password" in text


def _client(url: str, connect_timeout: float, timeout: float):
    """A ``redis`` client for ``url`` (imported here: only a server with a store needs it):
    short timeouts, one retry (a pooled connection that a store restart broke reconnects),
    the password from ``KV_STORE_PASSWORD`` when the URL has none."""
    import redis
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    url = normalize_url(url)
    kwargs: dict[str, Any] = dict(socket_connect_timeout=connect_timeout,
                                  socket_timeout=timeout, retry=Retry(NoBackoff(), 1),
                                  health_check_interval=0)
    if urlsplit(url).password is None and os.environ.get(PASSWORD_ENV):
        kwargs["password"] = os.environ[PASSWORD_ENV]
    return redis.Redis.from_url(url, **kwargs)
