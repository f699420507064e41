"""Restoring a cache entry from disk, in one run:

  throughput  an entry of ``--tokens`` tokens of the default model's KV geometry (random data)
              is saved, the store reopened (a restart), and the entry's files read back: by the
              store page by page (``load_entry`` + ``load_pages``) and by a whole restore as a
              turn needs it (``CacheManager.start`` with prefix views, as the engine runs it:
              manifest, pages into one run array, the view), against the machine's own limit:
              the same files read with plain buffered reads into preallocated memory, and into
              new memory (``np.empty`` each time: the first touch of new memory included, as a
              restore into new memory pays it). Page cache warm for all (each is read once
              first); medians of ``--repeat``.
  in_process  turn 4's cache step and prompt pass without the HTTP server (a manager with prefix
              views and ``Runner.prefill``, as the engine runs them): warm (resident sequence)
              against restored (new pool and store on the same directory);
  tiny        (``--tiny``, alone) the in_process step for a tiny random-weight llama model
              (``harness/tiny_model.py``) with ``--tiny-history`` tokens (~16,000) of history;
  ttft        with the real server (``benchmarks.ttft``'s helpers): the 4-turn ~2,400-token chat;
              turn 4 sent warm (the history in memory) and after a restart (the history from disk),
              ``--reps`` times each with a slightly different question; restored / warm TTFT.
              After a restart a one-token request without the cache runs first (unless
              ``--no-warmup``): the new process's first forward pass is not the restore's cost.

Usage: .venv/bin/python -m benchmarks.restore [--tokens 2400] [--repeat 5] [--reps 3] [--no-ttft]
       [--json FILE]
       .venv/bin/python -m benchmarks.restore --tiny [--tiny-history 16000] [--reps 5] [--json FILE]
The result goes to benchmarks/results/restore/<run's UTC time>.json (with --tiny:
benchmarks/results/restore/tiny/) unless --json names a file.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Sequence

import mlx.core as mx
import numpy as np

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import QUESTIONS, Server, ask, conversation, document, free_port
from kv_cache.model.views import PrefixViews
from kv_cache.tiers.base import PageRecord
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.pages.hashing import chain_hashes
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from mlx_kvserver.models.loading import resolve_and_load
from mlx_kvserver.engine.runner import Runner

PAGE = 32  # the server's default page size


def files_of(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.safetensors") if p.is_file())


def plain_read(files: list[Path], buf: np.ndarray) -> float:
    """Seconds to read every file into ``buf`` (preallocated) with plain buffered reads."""
    t0, off = time.perf_counter(), 0
    for f in files:
        with open(f, "rb") as fh:
            n = fh.readinto(memoryview(buf)[off:])
        off += n
    return time.perf_counter() - t0


def throughput(lm, tokens: int, repeat: int, work: Path) -> dict:
    spec, fp = lm.cache_spec, lm.fingerprint
    toks = [int(t) for t in np.random.default_rng(0).integers(10, 30000, tokens)]
    root = work / "store"
    g = spec.groups[0]
    with DiskStore(root, fingerprint=fp, spec=spec, page_size=PAGE, max_bytes=1 << 36) as s:
        hs = chain_hashes(s.geo.root(0), toks, PAGE)
        recs = [PageRecord(h, tuple(toks[i * PAGE : (i + 1) * PAGE]),
                           mx.random.normal(g.shape(PAGE)).astype(g.mx_dtype))
                for i, h in enumerate(hs)]
        tail = tokens % PAGE
        if tail:
            recs.append(PageRecord(None, tuple(toks[-tail:]),
                                   mx.random.normal(g.shape(tail)).astype(g.mx_dtype)))
        assert s.put("e", toks, recs)
    files = files_of(root)
    total = sum(f.stat().st_size for f in files)
    buf = np.empty(total, dtype=np.uint8)
    plain_read(files, buf)  # warm the page cache
    plain, fresh, store_t, restore_t, paged_t, views = [], [], [], [], [], []
    for _ in range(repeat):
        plain.append(plain_read(files, buf))
        fresh.append(plain_read(files, np.empty(total, dtype=np.uint8)))
        with DiskStore(root, fingerprint=fp, spec=spec, page_size=PAGE, max_bytes=1 << 36) as s:
            t0 = time.perf_counter()
            e = s.load_entry("e")
            pages = s.load_pages(e.entry.page_hashes)
            mx.eval(list(pages.values()) + list(e.tails.values()))
            store_t.append(time.perf_counter() - t0)
            assert all(v is not None for v in pages.values())
            del pages, e
        for runs, times in ((True, restore_t), (False, paged_t)):
            pool = PagePool(spec=spec, page_size=PAGE, max_bytes=2 * total + (64 << 20),
                            fingerprint=fp)
            m = CacheManager(pool, DiskStore(root, fingerprint=fp, spec=spec, page_size=PAGE,
                                             max_bytes=1 << 36), max_resident=0)
            m.views = PrefixViews(pool)  # as the engine sets it up
            if not runs:  # as before runs: page by page, then the view copies the pages
                m.restore._load_run = lambda *a: None
            gc.collect()  # the previous rep's arrays are gone (a server collects them too)
            t0 = time.perf_counter()
            seq, match = m.start(toks + [1], ["e"])
            mx.eval([pool.data(b) for t in match.tables for b in t if b is not None])
            times.append(time.perf_counter() - t0)
            assert match.tokens == tokens, match
            if runs:
                views.append(seq.view is not None and seq.view.nbytes == 0)
            seq.close()
            m.close()
    t0 = time.perf_counter()
    for _ in range(repeat):  # MLX's first touch of new memory, the run's size
        mx.eval(mx.zeros((total // 4,), dtype=mx.float32))
    touch = (time.perf_counter() - t0) / repeat
    mb = total / 2**20
    med = {k: statistics.median(v) for k, v in
           (("plain", plain), ("fresh", fresh), ("store", store_t), ("restore", restore_t),
            ("paged", paged_t))}
    return {"tokens": tokens, "files": len(files), "mb": round(mb, 1),
            "plain_read_mb_s": round(mb / med["plain"]),
            "plain_read_new_memory_mb_s": round(mb / med["fresh"]),
            "store_read_mb_s": round(mb / med["store"]),
            "restore_with_view_mb_s": round(mb / med["restore"]),
            "restore_with_view_ms": [round(1e3 * t, 1) for t in restore_t],
            "view_without_copy": all(views),
            "page_by_page_then_view_copy_mb_s": round(mb / med["paged"]),
            "page_by_page_then_view_copy_ms": [round(1e3 * t, 1) for t in paged_t],
            "mlx_new_memory_mb_s": round(mb / touch),
            "store_over_plain": round(med["plain"] / med["store"], 2),
            "restore_over_plain": round(med["plain"] / med["restore"], 2),
            "restore_over_plain_new_memory": round(med["fresh"] / med["restore"], 2)}


def in_process(lm, reps: int, work: Path, history: int = 2266, new_tokens: int = 25) -> dict:
    """Turn 4's cache step and forward pass in one process, the server left out: warm (the
    resident sequence) against restored (a new pool and store on the same directory)."""
    doc = lm.tokenizer.encode(document())
    toks = (doc * (-(-(history + new_tokens) // len(doc))))[: history + new_tokens]
    hist, new = toks[:history], toks[history:]
    root = work / f"inproc-{history}"

    def manager() -> tuple[CacheManager, Runner]:
        """A manager and runner set up as the server's engine sets them up (prefix views)."""
        pool = PagePool(spec=lm.cache_spec, page_size=PAGE, max_bytes=1 << 30,
                        fingerprint=lm.fingerprint)
        m = CacheManager(pool, DiskStore(root, fingerprint=lm.fingerprint, spec=lm.cache_spec,
                                         page_size=PAGE, max_bytes=1 << 34))
        m.views = PrefixViews(pool)
        return m, Runner(lm.model, m)

    def turn(m: CacheManager, runner: Runner) -> tuple[float, float, int]:
        t0 = time.perf_counter()
        seq, match = m.start(hist + new, ["h"])
        t1 = time.perf_counter()
        runner.prefill(seq, new)  # the server's prompt pass (evaluated)
        t2 = time.perf_counter()
        seq.trim(len(new))  # a warm turn's sequence goes back to the history (untimed), so
        m.keep(seq)  # every warm turn starts from exactly what a restored one starts from
        return t1 - t0, t2 - t1, match.tokens

    m, runner = manager()
    seq, _ = m.start(hist, [])
    for i in range(0, len(hist), 512):
        runner.prefill(seq, hist[i : i + 512])
    m.save("h", seq)
    m.keep(seq)
    m.sync()
    gc.collect()
    gc.freeze()  # as the server does after start-up (mlx_kvserver.cli)
    warm = [turn(m, runner) for _ in range(reps)]
    m.close()
    restored = []
    for _ in range(reps):
        m, runner = manager()
        restored.append(turn(m, runner))
        m.close()
        del m, runner
        gc.collect()  # the rep's run freed (its objects hold cycles) before the next allocates
    w = statistics.median(a + b for a, b, _ in warm)
    r = statistics.median(a + b for a, b, _ in restored)
    return {"history_tokens": len(hist), "new_tokens": len(new),
            "warm_s": round(w, 4), "restored_s": round(r, 4),
            "warm_start_forward_s": [[round(a, 3), round(b, 3)] for a, b, _ in warm],
            "restored_start_forward_s": [[round(a, 3), round(b, 3)] for a, b, _ in restored],
            "warm_tokens": [n for _, _, n in warm],
            "restored_tokens": [n for _, _, n in restored],
            "restored_over_warm": round(r / w, 2)}


def ttft(reps: int, max_tokens: int, work: Path, warmup: bool, extra: Sequence[str] = (),
         sentences: int = 112, tag: str = "kv") -> dict:
    """Turn 4 warm (right after turn 3, the history in memory) and restored (after a restart),
    ``reps`` times each. Rep ``k`` is its own conversation on its own copy of the document (it
    differs from the first token), so a warm turn reuses its own history and nothing of
    another rep's turn 4: warm and restored turns compute the same new tokens. ``extra``: more
    server flags (another model); ``sentences``: the document's length; ``tag``: the cache's
    folder in ``work``."""
    cache_dir, port, q = work / tag, free_port(), QUESTIONS[3]
    docs = [f"(Copy {k + 1}) {document(sentences)}" for k in range(reps)]
    server = Server(cache_dir, port, list(extra))
    warm, hists = [], []
    try:
        for k in range(reps):
            _, hist = conversation(server.url, f"w{k}", True, max_tokens, docs[k], QUESTIONS[:3])
            msgs = hist + [{"role": "user", "content": q, "message_id": f"w{k}-u3"}]
            warm.append(ask(server.url, msgs, True, max_tokens))
        for k in range(reps):
            hists.append(conversation(server.url, f"r{k}", True, max_tokens, docs[k],
                                      QUESTIONS[:3])[1])
    finally:
        server.stop()
    restored = []
    for k in range(reps):
        server = Server(cache_dir, port, list(extra))
        try:
            if warmup:  # the new process's first forward pass, apart from the restore
                ask(server.url, [{"role": "user", "content": "Hi."}], False, 1)
            msgs = hists[k] + [{"role": "user", "content": q, "message_id": f"r{k}-u3"}]
            restored.append(ask(server.url, msgs, True, max_tokens))
        finally:
            server.stop()
    w = statistics.median(r["ttft"] for r in warm)
    r = statistics.median(r["ttft"] for r in restored)
    return {"process_warmup": warmup, "prompt_tokens": [x["prompt_tokens"] for x in restored],
            "cached_tokens_warm": [x["cached_tokens"] for x in warm],
            "cached_tokens_restored": [x["cached_tokens"] for x in restored],
            "warm_ttft_s": [round(x["ttft"], 3) for x in warm],
            "restored_ttft_s": [round(x["ttft"], 3) for x in restored],
            "restored_over_warm": round(r / w, 2),
            "same_answers": [a["text"] == b["text"] for a, b in zip(warm, restored)]}


def tiny(history: int, reps: int, work: Path, server: bool) -> dict:
    """``in_process`` for a tiny random-weight llama model written to ``work``, and with
    ``server`` the ``ttft`` chat with that model and a document long enough for ``history``
    tokens before turn 4."""
    from harness.tiny_model import make_tiny_model_dir

    path = make_tiny_model_dir(work / "tiny-model", seed=0)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 4 * history  # the server's context limit
    (path / "config.json").write_text(json.dumps(config))
    lm = resolve_and_load(str(path))
    spec = lm.cache_spec
    per_token = sum(2 * len(g.layers) * g.num_kv_heads * g.head_dim * g.mx_dtype.size
                    for g in spec.groups)
    out = {"model": "tiny llama (harness/tiny_model.py: 2 layers, 2 KV heads of 16, float32)",
           "kv_bytes_per_token": per_token,
           "in_process": in_process(lm, reps, work, history=history)}
    if server:
        per_sentence = len(lm.tokenizer.encode(document(100))) / 100
        sentences = int((history - 250) / per_sentence)  # the rest: questions, answers, template
        del lm
        out["ttft"] = ttft(reps, 16, work, True, ["--model", str(path)], sentences, "kv-tiny")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2400)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--no-ttft", action="store_true")
    ap.add_argument("--no-warmup", action="store_true",
                    help="send turn 4 as the restarted server's very first request")
    ap.add_argument("--tiny", action="store_true",
                    help="only the in-process warm / restored step, tiny model, long history "
                         "(with --tiny-server, the server's TTFT too)")
    ap.add_argument("--tiny-server", action="store_true")
    ap.add_argument("--tiny-history", type=int, default=16000)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-restore-"))
    if args.tiny:
        out = tiny(args.tiny_history, args.reps, work, args.tiny_server)
        print(json.dumps(out, indent=1))
        write("restore/tiny", json.dumps(out, indent=1), override=args.json)
        return
    lm = resolve_and_load(None)
    out = {"model": lm.name, "throughput": throughput(lm, args.tokens, args.repeat, work),
           "in_process": in_process(lm, args.reps, work)}
    del lm
    print(json.dumps(out, indent=1), flush=True)
    if not args.no_ttft:
        out["ttft"] = ttft(args.reps, args.max_tokens, work, not args.no_warmup)
    print(json.dumps(out, indent=1))
    write("restore", json.dumps(out, indent=1), override=args.json)


if __name__ == "__main__":
    main()
