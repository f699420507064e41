"""A bounded soak: concurrent clients with mixed traffic until a request or time limit.

Starts its own server on loopback (the tiny random-weight test model by default, or
``--model default`` / any model spec) with small RAM and disk budgets, or talks to ``--url``.
Clients keep conversations going (streamed or not, sometimes forked, sometimes checked against
the same request without the cache), hang up mid-answer, send bad requests, and use the
KV-cache routes (stats, entry, export and import, delete). A monitor polls the stats and counts
budget violations. It ends with ONE summary line on stdout:

    soak: requests=... seconds=... ok=... errors_by_status={...} unexpected=... mismatches=...
          hangups=... bytes_on_disk=... disk_budget=... pages_held=... entries=...
          budget_violations=.../... checks

and exits 1 if anything unexpected happened (a 5xx, a wrong status, a cached answer that differs
from the no-cache one, a budget violation). Usage:

    .venv/bin/python -m benchmarks.soak --max-requests 2000 --max-seconds 120 [--clients 4] \\
        [--url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
BAD_BODIES = [b"{", b"[]", b'{"messages": []}', b'{"messages": [{"role": "wizard"}]}',
              b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}',
              b'{"messages": [{"role": "user", "content": "x"}], "temperature": 9}',
              b'{"messages": [{"role": "user", "content": "x", "message_id": "a\\u0000b"}]}',
              b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
              b"[" * 10_000 + b"]" * 10_000]
WORDS = ("sea river stone bread lamp tower winter garden copper violin harbour meadow clock "
         "lantern orchard canyon").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class OwnServer:
    """``python -m mlx_kvserver`` on a free loopback port, logging to a file."""

    def __init__(self, model: str, cache: Path, log: Path, ram_gb: float, disk_gb: float,
                 max_tokens: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/v1"
        self.cache, self.log = cache, log
        cmd = [sys.executable, "-m", "mlx_kvserver", "--model", model, "--port", str(self.port),
               "--kv-cache-dir", str(cache), "--max-kv-ram-gb", str(ram_gb),
               "--max-kv-size-gb", str(disk_gb), "--page-size", "16",
               "--max-tokens", str(max_tokens), "--log-level", "warning"]
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        with open(log, "ab") as f:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f,
                                         stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                sys.exit(f"soak: the server exited; see {log}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                sys.exit(f"soak: the server did not start; see {log}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


class Soak:
    def __init__(self, url: str, args: argparse.Namespace):
        self.url, self.args = url, args
        self.base = url.removesuffix("/v1")
        self.headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.lock = threading.Lock()
        self.statuses: Counter = Counter()
        self.counts: Counter = Counter()
        self.notes: list[str] = []
        self.started = time.monotonic()
        self.stop = threading.Event()
        models = httpx.get(f"{url}/models", headers=self.headers, timeout=60).json()["data"]
        self.model = models[0]["id"]

    # -- bookkeeping ----------------------------------------------------------------------------

    def take(self) -> bool:
        """One more request, if the budget allows it."""
        with self.lock:
            if self.stop.is_set() or self.counts["requests"] >= self.args.max_requests or \
                    time.monotonic() - self.started > self.args.max_seconds:
                self.stop.set()
                return False
            self.counts["requests"] += 1
            return True

    def record(self, status: int | str, expected: bool, note: str = "") -> None:
        with self.lock:
            self.statuses[status] += 1
            if not expected:
                self.counts["unexpected"] += 1
                if len(self.notes) < 5:
                    self.notes.append(f"{status} {note}"[:300])

    # -- traffic --------------------------------------------------------------------------------

    def chat(self, http: httpx.Client, messages: list, *, stream: bool, use_cache: bool = True,
             hang_up: bool = False) -> tuple[str, str] | None:
        body = {"model": self.model, "messages": messages, "temperature": 0,
                "max_tokens": self.args.max_tokens if not hang_up else 256,
                "stream": stream, "use_kv_cache": use_cache}
        try:
            if not stream:
                r = http.post(f"{self.url}/chat/completions", json=body)
                self.record(r.status_code, r.status_code == 200, r.text)
                if r.status_code != 200:
                    return None
                m = r.json()["choices"][0]["message"]
                return m["content"], m["message_id"]
            text, mid = [], None
            with http.stream("POST", f"{self.url}/chat/completions", json=body) as r:
                if r.status_code != 200:
                    self.record(r.status_code, False, r.read().decode(errors="replace"))
                    return None
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.record("stream-error", False, line)
                        return None
                    mid = chunk.get("message_id", mid)
                    for c in chunk["choices"]:
                        text.append(c["delta"].get("content") or "")
                        if hang_up and text[-1]:
                            self.record("hung-up", True)
                            with self.lock:
                                self.counts["hangups"] += 1
                            return None
            self.record(200, True)
            return "".join(text), mid
        except httpx.HTTPError as e:
            self.record(type(e).__name__, False, str(e))
            return None

    def client(self, index: int) -> None:
        rng = random.Random(self.args.seed * 1000 + index)
        conv, turn = 0, 0
        history: list[dict] = []
        with httpx.Client(timeout=600, headers=self.headers) as http:
            while self.take():
                roll = rng.random()
                if roll < 0.08:
                    body = rng.choice(BAD_BODIES)
                    r = http.post(f"{self.url}/chat/completions", content=body)
                    self.record(r.status_code, 400 <= r.status_code < 500, body[:60].decode())
                    continue
                if roll < 0.16:
                    self.cache_route(http, rng, history)
                    continue
                if not history or len(history) > 14 or roll < 0.19:
                    conv += 1
                    if history and roll < 0.19:  # fork an earlier point of this conversation
                        history = history[: 2 * rng.randint(0, len(history) // 2)]
                    else:
                        history = [{"role": "system", "content": "You are helpful.",
                                    "message_id": f"s{index}-sys"}]
                turn += 1
                words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 40)))
                history = history + [{"role": "user", "content": f"Tell me about {words}.",
                                      "message_id": f"s{index}-c{conv}-u{turn}"}]
                if roll > 0.96:
                    self.chat(http, history, stream=True, hang_up=True)
                    continue
                got = self.chat(http, history, stream=rng.random() < 0.5)
                if got is None:
                    history = history[:-1]
                    continue
                if rng.random() < 0.15 and self.take():  # the answer must equal the cold one
                    cold = self.chat(http, history, stream=False, use_cache=False)
                    if cold is not None and cold[0] != got[0]:
                        with self.lock:
                            self.counts["mismatches"] += 1
                history = history + [{"role": "assistant", "content": got[0],
                                      "message_id": got[1]}]

    def cache_route(self, http: httpx.Client, rng: random.Random, history: list) -> None:
        ids = [m["message_id"] for m in history if m.get("message_id")]
        key = rng.choice(ids) if ids else "none"
        what = rng.choice(["stats", "entry", "export", "delete", "missing"])
        if what == "stats":
            r = http.get(f"{self.url}/kv_cache/stats")
            self.record(r.status_code, r.status_code == 200, r.text)
        elif what == "missing":
            r = http.get(f"{self.url}/kv_cache/never-{rng.random()}")
            self.record(r.status_code, r.status_code == 404, r.text)
        elif what == "entry":
            r = http.get(f"{self.url}/kv_cache/{key}")
            self.record(r.status_code, r.status_code in (200, 404), r.text)
        elif what == "delete":
            r = http.delete(f"{self.url}/kv_cache/{key}")
            self.record(r.status_code, r.status_code in (200, 404), r.text)
        else:
            r = http.get(f"{self.url}/kv_cache/export/{key}")
            self.record(r.status_code, r.status_code in (200, 404), r.text)
            if r.status_code == 200 and self.take():
                imp = http.post(f"{self.url}/kv_cache/import?message_id={key}-copy",
                                content=r.content)
                self.record(imp.status_code, imp.status_code == 200, imp.text)

    def monitor(self, cache: Path | None) -> None:
        while not self.stop.wait(0.5):
            self.check_budgets(cache)

    def check_budgets(self, cache: Path | None) -> dict:
        try:
            stats = httpx.get(f"{self.url}/kv_cache/stats", headers=self.headers,
                              timeout=60).json()["models"]
        except httpx.HTTPError:
            return {}
        bad = 0
        for s in stats.values():
            bad += s["ram"]["bytes"] > s["ram"]["budget_bytes"]
            if s["disk"]:
                bad += s["disk"]["bytes_on_disk"] > s["disk"]["budget"]
        if cache is not None and stats:
            budget = sum(s["disk"]["budget"] for s in stats.values() if s["disk"])
            bad += disk_bytes(cache) > budget
        with self.lock:
            self.counts["budget_violations"] += bad
            self.counts["budget_checks"] += 1
        return stats


def disk_bytes(cache: Path) -> int:
    return sum(p.stat().st_size for p in cache.rglob("*.safetensors")
               if p.is_file() and not p.is_symlink())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server's base URL (http://HOST:PORT/v1)")
    p.add_argument("--model", default="tiny",
                   help="'tiny' (the random-weight test model, default), 'default' or a spec")
    p.add_argument("--max-requests", type=int, default=1000)
    p.add_argument("--max-seconds", type=float, default=60)
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--max-kv-ram-gb", type=float, default=0.002)
    p.add_argument("--max-kv-size-gb", type=float, default=0.002)
    p.add_argument("--api-key", default=os.environ.get("MLX_KVSERVER_API_KEY"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", action="store_true", help="keep the temporary cache dir and log")
    args = p.parse_args(argv)
    if args.max_requests <= 0 or args.max_seconds <= 0:
        p.error("--max-requests and --max-seconds must be positive")

    server, cache, tmp = None, None, None
    if args.url is None:
        tmp = Path(tempfile.mkdtemp(prefix="kvserver-soak-"))
        model = args.model
        if model == "tiny":
            from harness.tiny_model import make_tiny_model_dir

            model = str(make_tiny_model_dir(tmp / "model"))
        cache = tmp / "kv"
        server = OwnServer(model, cache, tmp / "server.log", args.max_kv_ram_gb,
                           args.max_kv_size_gb, args.max_tokens)
    url = args.url or server.url
    try:
        soak = Soak(url.rstrip("/"), args)
        monitor = threading.Thread(target=soak.monitor, args=(cache,), daemon=True)
        monitor.start()
        clients = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join()
        seconds = time.monotonic() - soak.started
        soak.stop.set()
        monitor.join()
        time.sleep(0.5)  # let cancelled generations reach the worker
        stats = soak.check_budgets(cache)
        c = soak.counts
        errors = {str(k): n for k, n in soak.statuses.items() if k not in (200, "hung-up")}
        on_disk = disk_bytes(cache) if cache is not None else sum(
            s["disk"]["bytes_on_disk"] for s in stats.values() if s["disk"])
        line = (
            f"soak: requests={c['requests']} seconds={seconds:.1f} clients={args.clients} "
            f"ok={soak.statuses[200]} errors_by_status={json.dumps(errors, sort_keys=True)} "
            f"unexpected={c['unexpected']} mismatches={c['mismatches']} hangups={c['hangups']} "
            f"bytes_on_disk={on_disk} "
            f"disk_budget={sum(s['disk']['budget'] for s in stats.values() if s['disk'])} "
            f"pages_held={sum(s['ram']['pages_held'] for s in stats.values())} "
            f"entries={sum(s['ram']['entries'] for s in stats.values())} "
            f"budget_violations={c['budget_violations']}/{c['budget_checks']} checks")
        if soak.notes:
            print("soak: first unexpected answers: " + " | ".join(soak.notes), file=sys.stderr)
        print(line, flush=True)
        return int(bool(c["unexpected"] or c["mismatches"] or c["budget_violations"]))
    finally:
        if server is not None:
            server.stop()
        if tmp is not None and not args.keep:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp is not None:
            print(f"soak: kept {tmp}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
