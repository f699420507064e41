"""Benchmarks of the paged KV cache library against mlx-lm's KVCache, on the default model.

  1. prefill of a 2,000-token prompt and decode at 2,000 tokens of context: paged vs KVCache;
  2. KV bytes held by 8 sequences that share a 2,000-token prefix and add 100 tokens each,
     and the peak memory while they decode;
  3. a 4-way branch after 2,000 tokens with 128 new tokens per branch: pages held, peak memory.

Ratios are taken in one run with the two caches interleaved; medians of --repeats.
Usage: .venv/bin/python -m benchmarks.kv_cache [--context 2000] [--repeats 3] [--json FILE]
The result goes to benchmarks/results/kv_cache/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from mlx_kvserver.platform import blas

blas.maybe_reexec()

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from benchmarks.record import OVERRIDE_HELP, write  # noqa: E402
from kv_cache.pages.pool import PagePool  # noqa: E402
from kv_cache.model.sequence import PagedSequence  # noqa: E402
from mlx_kvserver.models.loading import resolve_and_load  # noqa: E402

MB = 1 << 20


def run_prefill(model, cache, tokens, chunk=512):
    t0 = time.perf_counter()
    for s in range(0, len(tokens), chunk):
        logits = model(mx.array(tokens[s : s + chunk])[None], cache=cache)
        mx.eval(logits)
    return time.perf_counter() - t0, logits[0, -1]


def run_decode(model, cache, logits, n, on_token=None):
    t0 = time.perf_counter()
    out = []
    for _ in range(n):
        tok = int(mx.argmax(logits).item())
        out.append(tok)
        logits = model(mx.array([[tok]]), cache=cache)[0, -1]
        if on_token:
            on_token(tok)
    mx.eval(logits)
    return time.perf_counter() - t0, out


def make_pool(lm, page_size, max_bytes=8 << 30):
    return PagePool(lm.num_layers, lm.num_kv_heads, lm.head_dim, page_size=page_size,
                    dtype=lm.dtype, max_bytes=max_bytes, fingerprint=lm.fingerprint)


def prefilled(lm, prompt, page_size):
    """A sequence in a fresh pool holding ``prompt``, committed to pages; and its last logits."""
    seq = PagedSequence(make_pool(lm, page_size))
    _, logits = run_prefill(lm.model, seq.layers, prompt)
    seq.append_tokens(prompt)
    seq.commit()
    return seq, logits


def speed(lm, prompt, decode_n, repeats, page_size):
    rows = {"kv_prefill_s": [], "paged_prefill_s": [], "kv_decode_tps": [], "paged_decode_tps": []}
    same = True
    for _ in range(repeats):
        cache = [KVCache() for _ in range(lm.num_layers)]
        t, logits = run_prefill(lm.model, cache, prompt)
        rows["kv_prefill_s"].append(t)
        t, ref = run_decode(lm.model, cache, logits, decode_n)
        rows["kv_decode_tps"].append(decode_n / t)
        del cache

        pool = make_pool(lm, page_size)
        seq = PagedSequence(pool)
        t0 = time.perf_counter()
        _, logits = run_prefill(lm.model, seq.layers, prompt)
        seq.append_tokens(prompt)
        seq.commit()  # the paged path pays for writing its pages
        rows["paged_prefill_s"].append(time.perf_counter() - t0)
        t, out = run_decode(lm.model, seq.layers, logits, decode_n,
                            on_token=lambda tok: seq.append_tokens([tok]))
        rows["paged_decode_tps"].append(decode_n / t)
        same &= out == ref
        seq.close()
    med = {k: statistics.median(v) for k, v in rows.items()}
    return {
        **med,
        "prefill_ratio": med["kv_prefill_s"] / med["paged_prefill_s"],
        "decode_ratio": med["paged_decode_tps"] / med["kv_decode_tps"],
        "greedy_identical": same,
    }


def shared_prefix(lm, prompt, n_seqs, extra, page_size):
    base, _ = prefilled(lm, prompt, page_size)
    pool = base.pool
    seqs = [base.fork() for _ in range(n_seqs)]
    base.close()
    mx.synchronize()
    mx.reset_peak_memory()
    start_active = mx.get_active_memory()
    rng = list(range(100, 100 + extra))
    for i, seq in enumerate(seqs):  # each adds its own tokens, one sequence at a time
        new = [(t * 7 + i * 13) % 5000 + 10 for t in rng]
        lm.model(mx.array(new)[None], cache=seq.prepare())
        seq.append_tokens(new)
        seq.drop_buffers()  # commit; pages are what an idle sequence holds
    peak = mx.get_peak_memory() - start_active
    one = [KVCache() for _ in range(lm.num_layers)]
    run_prefill(lm.model, one, prompt + rng)
    kv_one = sum(c.nbytes for c in one)
    exact_one = (len(prompt) + extra) * pool.page_bytes // pool.page_size
    held = pool.stats().used_bytes
    reports = [s.memory_report() for s in seqs]
    for s in seqs:
        s.close()
    return {
        "page_size": page_size,
        "pages_bytes_mb": held / MB,
        "one_kvcache_mb": kv_one / MB,
        "one_exact_mb": exact_one / MB,
        "ratio_vs_kvcache": held / kv_one,
        "ratio_vs_exact": held / exact_one,
        "plain_kvcaches_ratio": n_seqs * 1.0,
        "peak_while_decoding_mb": peak / MB,
        "divergence_point": reports[0].divergence_point,
        "own_mb_per_seq": reports[0].own_bytes / MB,
    }


def branches(lm, prompt, n_branches, new_tokens, page_size):
    base, logits = prefilled(lm, prompt, page_size)
    pool = base.pool
    base.drop_buffers()
    forks = [base.fork() for _ in range(n_branches)]
    mx.synchronize()
    mx.reset_peak_memory()
    start_active = mx.get_active_memory()
    for i, seq in enumerate(forks):  # branches decode one after another
        first = mx.array(logits)
        first[i] = first.max() + 1  # each branch starts from a different token
        run_decode(lm.model, seq.prepare(), first, new_tokens,
                   on_token=lambda tok, s=seq: s.append_tokens([tok]))
        seq.drop_buffers()
    peak = mx.get_peak_memory() - start_active
    held = pool.stats().used_pages
    prefix_pages = -(-len(prompt) // page_size)
    bound = prefix_pages + n_branches * (-(-new_tokens // page_size) + 1)
    base.close()
    for s in forks:
        s.close()
    return {"page_size": page_size, "pages_held": held, "bound_pages": bound,
            "within_bound": held <= bound, "bytes_held_mb": held * pool.page_bytes / MB,
            "peak_while_decoding_mb": peak / MB}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--context", type=int, default=2000)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=32, help="page size of the speed runs")
    ap.add_argument("--memory-page-sizes", default="16,32",
                    help="page sizes of the memory runs (comma-separated)")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    lm = resolve_and_load(args.model)
    prompt = [(i * 31) % 40000 + 100 for i in range(args.context)]
    prompt = [t % (lm.model.args.vocab_size - 1) for t in prompt]
    result = {"model": lm.name, "blas": blas.blas_status(), "device": str(mx.default_device()),
              "context": args.context}
    if not args.skip_speed:
        result["speed"] = speed(lm, prompt, args.decode, args.repeats, args.page_size)
    sizes = [int(p) for p in args.memory_page_sizes.split(",")]
    result["shared_prefix"] = [shared_prefix(lm, prompt, 8, 100, ps) for ps in sizes]
    result["branches"] = [branches(lm, prompt, 4, 128, ps) for ps in sizes]
    print(json.dumps(result, indent=1))
    write("kv_cache", json.dumps(result, indent=1), override=args.json)


if __name__ == "__main__":
    main()
