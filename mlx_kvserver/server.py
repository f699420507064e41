"""Starting a server, for ``mlx-kvserver`` (``cli.py``) and ``mlx-kvchat`` (``clients/repl.py``)
alike: :func:`load_server` loads the configured models into an engine and builds the application
over them; the :class:`Server` it returns serves in the foreground (:meth:`Server.run`) or on a
thread of its own (:meth:`Server.start`, :meth:`Server.stop`)."""

from __future__ import annotations

import gc
import logging
import socket
import threading
import time

from .config import ServerConfig

log = logging.getLogger("mlx_kvserver")
LOOPBACK = ("127.0.0.1", "localhost", "::1")


def load_engine(config: ServerConfig):
    """Load the configured models and build the registry and the engine."""
    from .engine.speculation.draft_model import DraftModelError
    from .engine.engine import Engine
    from .engine.memory import MemoryBudget, ModelTooLarge
    from .models.registry import ModelRegistry
    from .models.loading import resolve_and_load

    memory = MemoryBudget.of(config)  # each load checked against it before it allocates

    def load(spec: str | None):
        try:
            return resolve_and_load(spec, dequantize=config.dequantize, fits=memory.check_load)
        except ModelTooLarge as e:
            raise SystemExit(str(e))

    models = []
    for spec in config.models:
        log.info("loading model %s", spec)
        models.append(load(spec))
    try:
        registry = ModelRegistry(models, config.model_aliases)
    except ValueError as e:
        raise SystemExit(str(e))
    draft = None
    if config.draft_model and config.speculate == "draft":
        log.info("loading draft model %s", config.draft_model)
        draft = load(config.draft_model)
    try:
        return registry, Engine(models, config, draft=draft)
    except DraftModelError as e:  # a draft model that fits no served model
        raise SystemExit(f"--draft-model: {e}")
    except ValueError as e:  # a cache the model cannot have (--kv-bits: its head_dim)
        raise SystemExit(str(e))


class Server:
    """A loaded server: ``app`` over ``registry``'s models (and those loaded on demand) and
    ``engine``, not yet listening."""

    def __init__(self, config: ServerConfig, registry, engine, app) -> None:
        self.config, self.registry, self.engine, self.app = config, registry, engine, app
        self._uvicorn = None
        self._thread: threading.Thread | None = None
        self._sock: socket.socket | None = None

    def run(self, log_level: str = "info") -> None:
        """Serve at ``--host``:``--port`` until interrupted (uvicorn's own signal handling)."""
        import uvicorn

        config = self.config
        url = f"http://{config.host}:{config.port}/v1"
        if config.host not in LOOPBACK:
            log.warning("listening on %s: other machines can reach this server%s", config.host,
                        "" if config.api_key else " (no --api-key set)")
            if not config.allowed_hosts:
                log.warning("only requests naming this server localhost, 127.0.0.1, [::1] or %s "
                            "in their Host header are answered; add names with --allowed-host",
                            config.host)
        log.info("serving %s at %s; point an OpenAI client at base_url=%s",
                 ", ".join(self.registry.names()), url, url)
        uvicorn.run(self.app, host=config.host, port=config.port, log_level=log_level.lower())

    def start(self, log_level: str = "warning") -> str:
        """Serve on a thread at ``--host``:``--port`` (port 0: a free one); the base URL
        (``http://host:port/v1``) once it listens."""
        import uvicorn

        # NOTE: with the protocol given, asyncio sets TCP_NODELAY on accepted connections (with
        # proto 0 it does not, and Nagle + delayed ACKs add ~40 ms to every response and chunk).
        sock = self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.config.host, self.config.port))
        server = self._uvicorn = uvicorn.Server(uvicorn.Config(
            self.app, log_level=log_level.lower(), lifespan="on"))
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        daemon=True)
        self._thread.start()
        while not server.started:
            if not self._thread.is_alive():
                raise SystemExit("the in-process server failed to start")
            time.sleep(0.02)
        host, port = sock.getsockname()[:2]
        return f"http://{host}:{port}/v1"

    def stop(self) -> None:
        """Stop what :meth:`start` started: the engine stopped, its stores closed."""
        if self._uvicorn is not None and self._thread is not None:
            self._uvicorn.should_exit = True
            self._thread.join(timeout=30)
        if self._sock is not None:
            self._sock.close()


def load_server(config: ServerConfig) -> Server:
    """The configured models loaded into an engine, and the application built over them
    (SystemExit with the reason when a rule, a model or its cache cannot be used)."""
    from .api import build_app
    from .chat.normalize import Normalizer
    from .models.serving import OnDemand

    try:  # a bad rule stops the start, with the reason, before any model loads
        Normalizer.from_config(config.volatile_rules, config.volatile_rule,
                               config.volatile_rule_files)
    except (OSError, ValueError) as e:
        raise SystemExit(f"volatile rules: {e}")
    registry, engine = load_engine(config)
    app = build_app(config, OnDemand(config, registry, engine), engine)
    # What start-up made (models, tokenizers, the stores' indexes) lives as long as the server:
    # kept out of the collector's way, a full collection during a request does not walk it
    # (one took ~45 ms of a restored turn, beside earlier runs of benchmarks/restore.py:
    # docs/BENCHMARKS.md's git history).
    gc.collect()
    gc.freeze()
    return Server(config, registry, engine, app)
