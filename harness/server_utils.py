"""Run the real server (uvicorn on loopback, in a thread) for tests and tools."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from pathlib import Path
from typing import Iterator

import uvicorn

from mlx_kvserver.api import build_app
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import LoadedModel
from mlx_kvserver.models.registry import ModelRegistry
from mlx_kvserver.models.serving import OnDemand
from mlx_kvserver.engine.engine import Engine


def make_engine(models: list[LoadedModel], config: ServerConfig) -> Engine:
    return Engine(models, config)


class QuickServer(uvicorn.Server):
    """uvicorn's server, stopped without its fixed waits (~0.18 s a stop, 150 stops a suite):
    :meth:`stop` wakes the main loop, which otherwise looks for the exit flag every 0.1 s; and
    with no connection open, the shutdown skips the 0.1 s it grants open connections to close.
    Everything else is uvicorn's: the listening socket closed, the lifespan's shutdown (the
    engine stopped, its stores closed) before :meth:`stop` returns."""

    _wake: asyncio.Event | None = None

    async def main_loop(self) -> None:
        loop, self._wake = asyncio.get_running_loop(), asyncio.Event()
        self._loop = loop
        counter = 0
        while not await self.on_tick(counter):  # uvicorn's loop, woken early by stop()
            counter = (counter + 1) % 864000
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), 0.1)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.server_state.connections:
            return await super().shutdown(sockets)
        for server in self.servers:
            server.close()
        for sock in sockets or []:
            sock.close()
        for server in self.servers:
            await server.wait_closed()
        if not self.force_exit:
            await self.lifespan.shutdown()

    def stop(self, thread: threading.Thread) -> None:
        """Ask the server (running in ``thread``) to exit and wait until it has."""
        self.should_exit = True
        if self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        thread.join(timeout=30)


@contextlib.contextmanager
def running_server(models: list[LoadedModel], config: ServerConfig | None = None,
                   engine: Engine | None = None, port: int = 0) -> Iterator[str]:
    """Serve ``models`` on 127.0.0.1 at ``port`` (0: a free one); yields the base URL
    (``http://.../v1``)."""
    config = config or ServerConfig()
    engine = engine or make_engine(models, config)
    app = build_app(config, OnDemand(config, ModelRegistry(models, config.model_aliases), engine),
                    engine)
    with serve_app(app, port, lifespan="on") as root:
        yield root + "/v1"


@contextlib.contextmanager
def serve_app(app, port: int = 0, lifespan: str = "off") -> Iterator[str]:
    """Serve an ASGI ``app`` with uvicorn on 127.0.0.1 at ``port`` (0: a free one), in a thread;
    yields its root URL (``http://127.0.0.1:PORT``)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)  # NOTE: with
    # proto 0, asyncio does not set TCP_NODELAY on accepted connections: 40 ms per request.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    server = QuickServer(uvicorn.Config(app, log_level="warning", lifespan=lifespan))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the server did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.stop(thread)
        sock.close()


def tiny_dir(tmp_path_factory, seed: int = 0) -> Path:
    from harness.tiny_model import make_tiny_model_dir

    path = tmp_path_factory.mktemp(f"tiny-model-{seed}")
    make_tiny_model_dir(path, seed=seed)
    return path
