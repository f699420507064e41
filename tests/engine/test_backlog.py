"""The requests waiting to start (engine/backlog.py): no time limit, a bound (``--max-queue``)
answered 429 with a ``Retry-After`` from the measured rate prompts start, and the figures the
stats show."""

from __future__ import annotations

import json
import re
import socket
import time

import pytest

from mlx_kvserver.engine.backlog import RETRY_UNMEASURED_S, Backlog
from mlx_kvserver.errors import RequestError
from harness.server_procs import HTTP, Server


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def jobs(n: int) -> list[object]:
    return [object() for _ in range(n)]


def test_a_full_backlog_is_a_429_whose_retry_after_follows_the_start_rate():
    clock = Clock()
    b = Backlog(3, clock)
    a, c, d, e, f, g = jobs(6)
    for j in (a, c, d):
        b.enter(j)
    with pytest.raises(RequestError) as err:
        b.enter(e)
    assert err.value.status == 429 and err.value.code == "queue_full"
    assert err.value.retry_after == RETRY_UNMEASURED_S  # nothing has started yet: no rate
    assert "--max-queue 3" in err.value.message
    clock.t += 10
    assert b.leave(a, started=True) == 10  # how long it waited
    clock.t += 10
    b.leave(c, started=True)  # two starts in 10 s, 10 s ago the first: 2 / 10 s
    b.enter(e)
    b.enter(f)  # d, e, f wait
    with pytest.raises(RequestError) as err:
        b.enter(g)
    assert b.rate() == pytest.approx(2 / 10)
    assert err.value.retry_after == 5  # one more must start: 1 / 0.2 per second
    clock.t += 30  # nothing started for a while: the rate falls, the wait told grows
    with pytest.raises(RequestError) as err:
        b.enter(g)
    assert err.value.retry_after == 20  # 2 starts over 40 s
    assert b.report()["refused"] == 3 and b.report()["waiting"] == 3


def test_no_time_limit_and_every_way_out_leaves_the_backlog():
    clock = Clock()
    b = Backlog(0, clock)  # no bound
    many = jobs(500)
    for j in many:
        b.enter(j)
    clock.t += 1e6  # waiting is never a refusal by itself
    assert len(b) == 500 and b.oldest_s() == 1e6
    b.leave(many[0], started=False)  # ended before it started (an error, a hang-up)
    assert b.leave(many[0], started=True) is None  # once
    b.leave(many[1], started=True)
    rep = b.report()
    assert rep["waiting"] == 498 and rep["started"] == 1 and rep["mean_wait_s"] == 1e6


def post_raw(url: str, body: dict) -> socket.socket:
    """A chat request sent on a socket of its own, left unread (a client that may hang up)."""
    host, port = url.removeprefix("http://").split(":")
    data = json.dumps(body).encode()
    sock = socket.create_connection((host, int(port)))
    sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: " + host.encode()
                 + b"\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_server_queues_to_max_queue_then_429s_and_a_client_that_hangs_up_leaves(
        tiny_model_dir, tmp_path):
    """``--max-batch 1 --max-queue 1``: while one answer runs, one request waits for its place
    (the stats, /metrics and the log say so) and the next is a 429 in OpenAI's shape with a
    ``Retry-After``; the waiting client hangs up and leaves the queue, and the server goes on
    answering."""
    s = Server(tiny_model_dir, tmp_path / "kv", tmp_path / "s.log", "--max-batch", "1",
               "--max-queue", "1", "--speculate", "off", warm=True).start()
    body = lambda n: {"model": "default", "max_tokens": n, "temperature": 0,
                      "messages": [{"role": "user", "content": "hello there"}]}
    try:
        queued = lambda: HTTP.get(f"{s.url}/health").json()["queued"]
        with HTTP.stream("POST", f"{s.url}/v1/chat/completions", timeout=120,
                         json={**body(2000), "stream": True}) as first:
            lines = first.iter_lines()
            next(line for line in lines if '"content"' in line)  # it runs
            waiting = post_raw(s.url, body(4))
            wait_for(lambda: queued() == 1)
            full = HTTP.post(f"{s.url}/v1/chat/completions", json=body(4))
            assert full.status_code == 429, full.text
            assert full.json()["error"]["code"] == "queue_full"
            assert int(full.headers["retry-after"]) >= 1
            stats = next(iter(HTTP.get(f"{s.url}/v1/kv_cache/stats").json()["models"]
                              .values()))["queue"]
            assert stats["waiting"] == 1 and stats["waiting_for"]["batch"] == 1
            assert stats["refused"] == 1 and stats["max_queue"] == 1
            metrics = HTTP.get(f"{s.url}/metrics").text
            assert re.search(r'queue_waiting\{model="[^"]+",reason="batch"\} 1\.0', metrics)
            assert re.search(r"queue_refused_total 1\.0", metrics)
            waiting.close()  # its client hangs up while it waits
            wait_for(lambda: queued() == 0)
            for _ in lines:  # the first answer goes on to its end
                pass
        ok = HTTP.post(f"{s.url}/v1/chat/completions", json=body(4))
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        log = s.log_text()
        assert log.count("waits for a place in the batch") == 1
    finally:
        s.stop()
