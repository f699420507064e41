"""A real ``redis-server`` for tests and benchmarks: its own port and folder, nothing persisted.

Tests that need one use ``running_redis`` (or ``RedisProc`` directly); where the
binary is missing they are skipped, saying so (``.ci/run`` installs Debian's ``redis-server``).
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import time
from pathlib import Path
from typing import Iterator

from harness.services import unavailable

BINARY = shutil.which("redis-server")
SKIP_REASON = "no redis-server binary (apt-get install redis-server; .ci/run does)"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisProc:
    """``redis-server`` on 127.0.0.1:``port`` in ``folder``; ``extra``: more config flags
    (``--maxmemory 2mb``, ``--requirepass x``). ``stop`` and ``start`` again keep the port
    (a restart: the data is gone, as nothing is saved)."""

    def __init__(self, folder: Path, *extra: str, port: int | None = None):
        self.folder, self.extra = Path(folder), list(extra)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisProc":
        if BINARY is None:
            unavailable("redis-server", SKIP_REASON)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [BINARY, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.folder),
             "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return self
            except OSError:
                time.sleep(0.02)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def client(self, **kw):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, **kw)


@contextlib.contextmanager
def running_redis(folder: Path, *extra: str) -> Iterator[RedisProc]:
    """A started ``RedisProc``, stopped at the end (a test's fixture: ``redis_server``)."""
    proc = RedisProc(folder, *extra).start()
    try:
        yield proc
    finally:
        proc.stop()
