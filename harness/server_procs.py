"""Real server processes for tests: ``mlx_kvserver``'s command line in a process of its own.

A :class:`Server` starts cold (``python -m mlx_kvserver ...`` in a new interpreter, optionally
under a command prefix such as ``setpriv``) or warm (``warm=True``): forked from a process that
has already imported the server's modules, where the child runs the same ``mlx_kvserver.cli.main``
with the same arguments and environment. Either way it is a process of its own that loads the
model, opens the store, serves HTTP on its port and dies by a real SIGKILL; warm only skips the
interpreter start and the imports (mlx-lm, transformers: ~2-3 s of every start on two cores),
which matters to a test that starts a server fifty times.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
# One client for the servers' many short connections (no keep-alive: a server may die).
HTTP = httpx.Client(timeout=60, limits=httpx.Limits(max_keepalive_connections=0))
ENV = {"PYTHONPATH": str(REPO), "MLX_KVSERVER_NO_BLAS": "1", "HF_HUB_OFFLINE": "1",
       "TOKENIZERS_PARALLELISM": "false"}
# What the warm parent imports before it forks (the child imports nothing heavy itself).
WARM_MODULES = ["mlx_kvserver.cli", "mlx_kvserver.api", "mlx_kvserver.engine",
                "mlx_kvserver.models", "uvicorn", __name__]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mlx_kvserver`` in a process of its own (see the module's docstring)."""

    def __init__(self, model_dir: Path, cache: Path, log: Path, *extra: str,
                 prefix: list[str] = (), preexec=None, warm: bool = False):
        assert not (warm and (prefix or preexec)), "a warm start runs no prefix or preexec"
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--model", str(model_dir), "--port", str(self.port), "--kv-cache-dir",
                     str(cache), "--no-fast-blas", "--log-level", "info", *extra]
        self.cmd = [*prefix, sys.executable, "-m", "mlx_kvserver", *self.args]
        self.log, self.preexec, self.warm, self.proc = log, preexec, warm, None
        self.env = {**os.environ, **ENV}

    def start(self, timeout: float = 90) -> Server:
        if self.warm:
            self.proc = Forked(self.args, self.log)
        else:
            with open(self.log, "ab") as log:
                self.proc = subprocess.Popen(self.cmd, cwd=REPO, env=self.env, stdout=log,
                                             stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                             preexec_fn=self.preexec)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"the server exited ({self.proc.returncode}):\n"
                                     + self.log_text()[-3000:])
            try:
                if HTTP.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError("the server did not start:\n" + self.log_text()[-3000:])
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        if self.proc is not None:
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


# -- warm starts -----------------------------------------------------------------------------------


def _serve(args: list[str], log: str) -> None:
    """The forked child: the environment and output of a cold start, then the CLI's main."""
    os.environ.update(ENV)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.chdir(REPO)
    from mlx_kvserver.cli import main

    main(args)


_context = None


def _warm_context():
    """The forkserver context; its server process starts once, in the servers' environment (some
    of it is read at import time), and imports :data:`WARM_MODULES`."""
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(WARM_MODULES)
        saved = {k: os.environ.get(k) for k in ENV}
        os.environ.update(ENV)
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        _context = ctx
    return _context


class Forked:
    """A warm-started server process, with what :class:`Server` uses of ``subprocess.Popen``."""

    def __init__(self, args: list[str], log: Path):
        self.process = _warm_context().Process(target=_serve, args=(args, str(log)),
                                               daemon=True)  # a failed test's left-over dies
        self.process.start()
        self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.exitcode

    def poll(self) -> int | None:
        return self.process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self.process.join(timeout)
        if self.process.exitcode is None:
            raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
        return self.process.exitcode

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)
