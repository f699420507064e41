"""SGLang's router (PyPI ``sglang-router``, :class:`Router`) or vLLM's (PyPI ``vllm-router``,
:class:`VllmRouter`) in front of real servers, for tests and benchmarks.

Each router is a Rust binary with a Python launcher; it lives in a virtual environment of its own
(``build/router-venv``, ``build/vllm-router-venv``, ignored by git), made on first use with
``pip install`` of :data:`PACKAGE` (:data:`VLLM_PACKAGE`), or named by ``SGLANG_ROUTER``
(``VLLM_ROUTER``): the path of an installed launcher. Where one cannot be installed or started,
the tests that need it skip, saying why (or fail, where the run requires the ``sglang-router``
or ``vllm-router`` service: ``harness/services.py``).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from harness.server_procs import free_port
from harness.services import unavailable

REPO = Path(__file__).resolve().parent.parent
PACKAGE = "sglang-router==0.3.2"
VENV = REPO / "build" / "router-venv"


VLLM_PACKAGE = "vllm-router==0.1.17"
VLLM_VENV = REPO / "build" / "vllm-router-venv"


def router_binary() -> str:
    """The ``sglang-router`` launcher: ``SGLANG_ROUTER``, or the one in :data:`VENV` (installed
    now when missing); the test skips, saying why, when it cannot be had."""
    return _launcher("sglang-router", "SGLANG_ROUTER", VENV, PACKAGE)


def vllm_router_binary() -> str:
    """The ``vllm-router`` launcher: ``VLLM_ROUTER``, or the one in :data:`VLLM_VENV` (installed
    now when missing); the test skips, saying why, when it cannot be had."""
    return _launcher("vllm-router", "VLLM_ROUTER", VLLM_VENV, VLLM_PACKAGE)


def _launcher(service: str, variable: str, venv: Path, package: str) -> str:
    """The launcher ``service`` installed by ``package``: named by the environment's
    ``variable``, else ``venv``'s, made there now when missing."""
    given = os.environ.get(variable)
    if given:
        if not os.access(given, os.X_OK):
            unavailable(service, f"{variable}={given} is not an executable")
        return given
    binary = venv / "bin" / service
    if binary.exists():
        return str(binary)
    python = shutil.which("python3") or sys.executable
    try:
        if not (venv / "bin" / "python").exists():
            subprocess.run([python, "-m", "venv", str(venv)], check=True, capture_output=True,
                           timeout=120)
        subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", package],
                       check=True, capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        out = getattr(e, "stderr", b"") or b""
        unavailable(service, f"cannot install {package} into {venv}: {e} "
                    f"{out.decode(errors='replace')[-500:]}")
    if not binary.exists():
        unavailable(service, f"{package} installed no {service} launcher")
    return str(binary)


class Router:
    """``sglang-router launch`` over ``workers`` (base URLs) with the ``cache_aware`` policy, a
    health check every second and a retry on another server when one does not answer."""

    def __init__(self, workers: list[str], log: Path, *extra: str, policy: str = "cache_aware"):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [router_binary(), "launch", "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port",
                    str(self.metrics_port), "--worker-urls", *workers, "--policy", policy,
                    *FAILOVER, *extra]
        self.workers, self.log, self.proc = workers, log, None
        self.service = "sglang-router"

    def start(self, timeout: float = 60) -> Router:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                unavailable(self.service, f"the router exited ({self.proc.returncode}): "
                            + self.log.read_text(errors="replace")[-2000:])
            try:
                workers = httpx.get(f"{self.url}/workers", timeout=2).json()["workers"]
                if len([w for w in workers if w["is_healthy"]]) == len(self.workers):
                    return self
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        self.stop()
        raise AssertionError("the router did not register its workers:\n"
                             + self.log.read_text(errors="replace")[-3000:])

    def registered(self) -> list[dict]:
        """The router's view of its workers (``GET /workers``)."""
        return httpx.get(f"{self.url}/workers", timeout=5).json()["workers"]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)


class VllmRouter(Router):
    """vLLM's router (``vllm-router``) over ``workers`` (base URLs), by default with its
    ``kv_aware`` policy fed by each worker's KV events (``kv_events``: per worker, its events
    endpoints as the server was given them, ``[--kv-events, --kv-events-replay]`` or just the
    first; a ``*`` host is read as 127.0.0.1), whose pages hold ``block_size`` tokens (the
    servers' ``--page-size``); the same health checks and retries as :class:`Router`. The router
    asks each worker for a request's token ids (``api/tokenize.py``) and reads the events as
    maps only (the servers' ``--kv-events-format map``)."""

    def __init__(self, workers: list[str], log: Path, *extra: str, policy: str = "kv_aware",
                 kv_events: list[list[str]] = (), block_size: int = 16,
                 model: str = "mlx-kvserver"):
        self.port, self.metrics_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        sources = []
        for worker, endpoints in zip(workers, kv_events):
            ends = [e.replace("://*:", "://127.0.0.1:") for e in endpoints if e]
            sources += ["--kv-event-source", f"{worker}={ends[0]}"]
            if len(ends) > 1:
                sources += ["--kv-event-replay-source", f"{worker}={ends[1]}"]
        if sources:  # the model flag only names the servers' shared model to the router
            sources += ["--kv-event-block-size", str(block_size), "--kv-event-model", model]
        self.cmd = [vllm_router_binary(), "--host", "127.0.0.1", "--port", str(self.port),
                    "--prometheus-host", "127.0.0.1", "--prometheus-port",
                    str(self.metrics_port), "--worker-urls", *workers, "--policy", policy,
                    *sources, *FAILOVER, *extra]
        self.workers, self.log, self.proc = workers, log, None
        self.service = "vllm-router"


# A server that stops answering is out after one failed health check (every second) or one
# failed request (its circuit breaker opens), and the request is retried on another server.
FAILOVER = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--cb-failure-threshold", "1", "--retry-max-retries", "3",
            "--retry-initial-backoff-ms", "50")
