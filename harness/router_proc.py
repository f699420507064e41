"""SGLang's router (PyPI ``sglang-router``) in front of real servers, for tests.

The router is a Rust binary with a Python launcher; it lives in a virtual environment of its own
(``build/router-venv``, ignored by git), made on first use with ``pip install`` of
:data:`PACKAGE`, or named by ``SGLANG_ROUTER`` (the path of an installed ``sglang-router``).
Where it cannot be installed or started, the tests that need it skip, saying why (or fail, where
the run requires the ``sglang-router`` service: ``harness/services.py``).
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


def router_binary() -> str:
    """The ``sglang-router`` launcher: ``SGLANG_ROUTER``, or the one in :data:`VENV` (installed
    now when missing); the test skips, saying why, when it cannot be had."""
    given = os.environ.get("SGLANG_ROUTER")
    if given:
        if not os.access(given, os.X_OK):
            unavailable("sglang-router", f"SGLANG_ROUTER={given} is not an executable")
        return given
    binary = VENV / "bin" / "sglang-router"
    if binary.exists():
        return str(binary)
    python = shutil.which("python3") or sys.executable
    try:
        if not (VENV / "bin" / "python").exists():
            subprocess.run([python, "-m", "venv", str(VENV)], check=True, capture_output=True,
                           timeout=120)
        subprocess.run([str(VENV / "bin" / "python"), "-m", "pip", "install", "-q", PACKAGE],
                       check=True, capture_output=True, timeout=600)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as e:
        out = getattr(e, "stderr", b"") or b""
        unavailable("sglang-router", f"cannot install {PACKAGE} into {VENV}: {e} "
                    f"{out.decode(errors='replace')[-500:]}")
    if not binary.exists():
        unavailable("sglang-router", f"{PACKAGE} installed no sglang-router launcher")
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

    def start(self, timeout: float = 60) -> Router:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                unavailable("sglang-router", f"the router exited ({self.proc.returncode}): "
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


# A server that stops answering is out after one failed health check (every second) or one
# failed request (its circuit breaker opens), and the request is retried on another server.
FAILOVER = ("--health-check-interval-secs", "1", "--health-failure-threshold", "1",
            "--cb-failure-threshold", "1", "--retry-max-retries", "3",
            "--retry-initial-backoff-ms", "50")
