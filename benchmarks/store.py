"""The shared page store (``--kv-store``), in one run against a real ``redis-server``:

  clients     plain pipelined GETs of an entry's pages (the default model's page size: ~1.5 MB
              values at page 32, float32) with ``redis`` + ``hiredis``, ``redis`` with its
              pure-Python parser and, where installed, ``valkey`` (+ ``libvalkey``): MB/s,
              medians of ``--repeat``;
  throughput  the store tier's read of the same pages (``TieredStore.load_run`` over an empty
              disk: pipelined GETs, every value checked, one MLX array) against plain pipelined
              GETs of the same keys with the same client and batch, in the same run;
  ttft        three servers (``benchmarks.ttft``'s helpers, the ~2,400-token 4-turn chat): A and B
              share the store, C has none. A holds conversation r (3 turns) and answers turn 4
              of conversation w warm; B answers turn 4 of r restored from the store; C answers
              it cold. Each new process answers a one-token request first (its first forward
              pass is not the restore's cost). Same question, same new tokens everywhere.

Usage: .venv/bin/python -m benchmarks.store [--tokens 2400] [--repeat 5] [--reps 2] [--no-ttft]
       [--tiny] [--json FILE]
(``--tiny``: a tiny random-weight llama model instead of the default model, for the ttft part.)
The result goes to benchmarks/results/store/<run's UTC time>.json (with --tiny in a folder tiny/
below it, with --no-ttft in throughput/ or tiny/throughput/) unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import httpx
import mlx.core as mx
import numpy as np

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import QUESTIONS, Server, ask, conversation, document, free_port
from kv_cache.layout.spec import CacheSpec
from kv_cache.pages.hashing import chain_hashes
from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk.file_format import Geometry
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.tiers.store import TieredStore, open_shared
from kv_cache.tiers.store.shared import WriteJob, _pipelined
from harness.redis_proc import RedisProc

PAGE = 32  # the server's default page size


def geometry(tiny: bool) -> Geometry:
    from mlx_kvserver.models.loading import resolve_and_load

    if tiny:
        return Geometry("tiny", PAGE, CacheSpec.plain(2, 2, 16, mx.float32))
    lm = resolve_and_load("default")
    return Geometry(lm.fingerprint, PAGE, lm.cache_spec)


def fill(url: str, geo: Geometry, tokens: int):
    """An entry of ``tokens`` random tokens with random page data, written to the store."""
    toks = tuple(int(t) for t in np.random.default_rng(0).integers(10, 30000, tokens))
    hashes = chain_hashes(geo.root(0), toks, PAGE)
    shape = geo.shape(PAGE, 0)
    rng = np.random.default_rng(1)
    pages = [PageRecord(h, toks[i * PAGE : (i + 1) * PAGE],
                        rng.standard_normal(shape, dtype=np.float32), 0)
             for i, h in enumerate(hashes)]
    shared = open_shared(url, geo, "bench")
    n = len(hashes) * PAGE
    assert shared.write(WriteJob("bench", toks[:n], pages, {}, [(0, len(pages))]))
    return shared, hashes


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def plain_gets(client, names: list[str], batch: int) -> int:
    total = 0
    for at in range(0, len(names), batch):
        total += sum(len(v) for v in _pipelined(client, "get", names[at : at + batch]))
    return total


def clients(proc: RedisProc, names: list[str], batch: int, repeat: int) -> dict:
    import redis
    from redis._parsers import _RESP2Parser

    pure = redis.ConnectionPool(port=proc.port, parser_class=_RESP2Parser)
    makers = {"redis+hiredis": lambda: redis.Redis(port=proc.port),
              "redis (pure Python parser)": lambda: redis.Redis(connection_pool=pure)}
    try:
        import valkey

        parser = valkey.connection.DefaultParser.__name__
        makers[f"valkey ({parser})"] = lambda: valkey.Valkey(port=proc.port)
    except ImportError:
        pass
    made = {name: make() for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in made}
    size = plain_gets(made["redis+hiredis"], names, batch)
    for _ in range(repeat + 1):  # rounds of every client in turn: the machine's drift shared
        for name, client in made.items():
            times[name].append(timed(lambda: plain_gets(client, names, batch)))
    out = {}
    for name, client in made.items():
        t = statistics.median(times[name][1:])
        out[name] = {"MB_per_s": round(size / t / 1e6, 1), "seconds": round(t, 4)}
        client.close()
    return out


def throughput(proc: RedisProc, geo: Geometry, tokens: int, repeat: int, work: Path) -> dict:
    shared, hashes = fill(proc.url, geo, tokens)
    names = [shared.keys.page(h) for h in hashes]
    client = shared.link.client
    size = plain_gets(client, names, shared.batch)
    disk = DiskStore(work / "disk", fingerprint=geo.fingerprint, spec=geo.spec,
                     page_size=PAGE, max_bytes=1 << 30)
    tier = TieredStore(disk, shared)

    def restore():
        arr, k = tier.load_run(hashes, 0)
        assert k == len(hashes)
        mx.eval(arr)

    restore()
    plains, tiers = [], []
    for _ in range(repeat):  # alternated: the machine's drift shared
        plains.append(timed(lambda: plain_gets(client, names, shared.batch)))
        tiers.append(timed(restore))
    plain, t = statistics.median(plains), statistics.median(tiers)
    result = {"pages": len(hashes), "bytes": size, "batch": shared.batch,
              "plain_gets_MB_per_s": round(size / plain / 1e6, 1),
              "tier_MB_per_s": round(size / t / 1e6, 1), "tier_over_plain": round(plain / t, 2),
              "clients": clients(proc, names, shared.batch, repeat)}
    tier.close()
    return result


def stored_everything(server: Server, deadline: float = 60) -> None:
    """Wait until the server's store writes are done (they run after each answer)."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        stats = httpx.get(server.url + "/kv_cache/stats", timeout=10).json()
        if all((m.get("store") or {}).get("queued", 0) == 0 for m in stats["models"].values()):
            return
        time.sleep(0.2)


def ttft(proc: RedisProc, reps: int, max_tokens: int, work: Path, extra: list[str]) -> dict:
    store = ["--kv-store", proc.url, *extra]
    docs = [f"(Copy {k + 1}) {document()}" for k in range(reps)]
    q = QUESTIONS[3]
    a = Server(work / "a", free_port(), store)
    warm, hists = [], []
    try:
        ask(a.url, [{"role": "user", "content": "Hi."}], False, 1)
        for k in range(reps):
            hists.append(conversation(a.url, f"r{k}", True, max_tokens, docs[k],
                                      QUESTIONS[:3])[1])
            _, hist = conversation(a.url, f"w{k}", True, max_tokens, docs[k], QUESTIONS[:3])
            msgs = hist + [{"role": "user", "content": q, "message_id": f"w{k}-u3"}]
            warm.append(ask(a.url, msgs, True, max_tokens))
        stored_everything(a)
    finally:
        a.stop()
    results = {}
    for name, flags in (("restored", store), ("cold", extra)):
        server = Server(work / name, free_port(), list(flags))
        try:
            ask(server.url, [{"role": "user", "content": "Hi."}], False, 1)
            results[name] = [ask(server.url, hists[k] + [{"role": "user", "content": q,
                                                           "message_id": f"r{k}-u3"}],
                                 True, max_tokens) for k in range(reps)]
            if name == "restored":
                stats = httpx.get(server.url + "/kv_cache/stats", timeout=10).json()
                results["store_stats"] = [m.get("store") for m in stats["models"].values()]
        finally:
            server.stop()
    w = statistics.median(r["ttft"] for r in warm)
    r = statistics.median(r["ttft"] for r in results["restored"])
    c = statistics.median(r["ttft"] for r in results["cold"])
    return {"prompt_tokens": [x["prompt_tokens"] for x in results["restored"]],
            "cached_tokens_warm_A": [x["cached_tokens"] for x in warm],
            "cached_tokens_restored_B": [x["cached_tokens"] for x in results["restored"]],
            "warm_A_ttft_s": [round(x["ttft"], 3) for x in warm],
            "restored_B_ttft_s": [round(x["ttft"], 3) for x in results["restored"]],
            "cold_B_no_store_ttft_s": [round(x["ttft"], 3) for x in results["cold"]],
            "restored_over_warm": round(r / w, 2), "cold_over_warm": round(c / w, 2),
            "same_answers": [a["text"] == b["text"] == c["text"] for a, b, c in
                             zip(warm, results["restored"], results["cold"])],
            "store_stats_B": results["store_stats"]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=2400)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        proc = RedisProc(work / "redis").start()
        try:
            out = {"model": "tiny" if args.tiny else "default",
                   "throughput": throughput(proc, geometry(args.tiny), args.tokens, args.repeat,
                                            work)}
            print(json.dumps(out, indent=1), flush=True)
            if not args.no_ttft:
                extra = []
                if args.tiny:
                    from harness.tiny_model import make_tiny_model_dir

                    make_tiny_model_dir(work / "tiny", seed=0)
                    extra = ["--model", str(work / "tiny")]
                out["ttft"] = ttft(proc, args.reps, args.max_tokens, work, extra)
                print(json.dumps(out["ttft"], indent=1), flush=True)
        finally:
            proc.stop()
    name = "/".join(["store", *(["tiny"] if args.tiny else []),
                     *(["throughput"] if args.no_ttft else [])])
    write(name, json.dumps(out, indent=1), override=args.json)


if __name__ == "__main__":
    main()
