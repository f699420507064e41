"""Where a batched decode step's time goes: 8 sequences on one shared document (default model).

    .venv/bin/python -m benchmarks.batch_step

Prints the step time for 1 and 8 sequences, the same step with attention skipped, and 30
layers of attention for 8 rows through the split path against the fused kernel on 8 contiguous
caches (mlx-lm's batch layout). It writes no file; the figures of its earlier runs are in
docs/BENCHMARKS.md's git history.
"""

from __future__ import annotations

import time

import mlx.core as mx

import kv_cache.model.attention as attention
from benchmarks.batching import on_document
from benchmarks.ttft import document
from mlx_kvserver.models.loading import resolve_and_load


def step_time(runner, seqs, tokens, reps: int = 8) -> float:
    for _ in range(2):
        tokens = mx.argmax(runner.decode(seqs, tokens), axis=-1).tolist()
    t0 = time.perf_counter()
    for _ in range(reps):
        tokens = mx.argmax(runner.decode(seqs, tokens), axis=-1).tolist()
    return (time.perf_counter() - t0) / reps


def main() -> None:
    lm = resolve_and_load("default")
    _, _, runner, seqs, nxt = on_document(lm, document(), 8, chunk=512)
    print("prefix view lengths", [s.view_len for s in seqs])
    for b in (1, 8):
        print(f"step, {b} sequence(s): {step_time(runner, seqs[:b], nxt[:b]) * 1000:.0f} ms")
    split = attention.split_attention
    attention.split_attention = lambda q, reads, scale, sinks=None: q
    print(f"step, 8 sequences, attention skipped: {step_time(runner, seqs, nxt) * 1000:.0f} ms")
    attention.split_attention = split

    reads = [layer.read() for layer in (s.layers[0] for s in seqs)]
    g = lm.cache_spec.groups[0]
    q = mx.random.normal((8, lm.model.args.num_attention_heads, 1, g.head_dim))
    n = reads[0].prefix[0].shape[1] + max(r.keys.shape[2] for r in reads)
    k = mx.random.normal((8, g.num_kv_heads, n, g.head_dim))
    mx.eval(q, k)
    for label, f in (("split path", lambda: split(q, reads, 0.125)),
                     ("fused, 8 contiguous caches",
                      lambda: mx.fast.scaled_dot_product_attention(q, k, k, scale=0.125))):
        mx.eval([f() for _ in range(30)])
        t0 = time.perf_counter()
        mx.eval([f() for _ in range(30)])
        print(f"attention, 30 layers, 8 rows, {label}: {(time.perf_counter() - t0) * 1000:.0f} ms")
    for s in seqs:
        s.close()


if __name__ == "__main__":
    main()
