"""KV pages in 8 and 4 bits against full precision, on this machine (docs/BENCHMARKS.md).

  attention  one decode step's attention over ``--history`` positions of the default model's
             shape (9 query heads, 3 KV heads, head_dim 64) per layer, 30 layers: over
             quantized keys and values with ``mx.quantized_matmul`` (mlx-lm's quantized SDPA)
             against float working buffers (``mx.fast.scaled_dot_product_attention``), and
             the cost of the per-layer round trip of a fresh key and value. Decides which
             attention a backend gets.

Usage: python scripts/bench_kv_bits.py attention [--history 2400] [--reps 20] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
from mlx_lm.models.base import quantized_scaled_dot_product_attention

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kv_cache.pages.quant import KVQuant  # noqa: E402

SETTINGS = (None, 8, 4)
LAYERS, Q_HEADS, KV_HEADS, HEAD_DIM = 30, 9, 3, 64


def _median_ms(fn, reps: int) -> float:
    """Median wall milliseconds of ``fn`` evaluated (after two warm-up runs)."""
    for _ in range(2):
        mx.eval(fn())
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        mx.eval(fn())
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def attention(history: int, reps: int, queries: int = 1) -> dict:
    """Milliseconds for ``queries`` query positions attending to ``history`` keys in every
    layer: float32 buffers, then each setting's quantized pages."""
    key = mx.random.key(0)
    shape = (1, KV_HEADS, history, HEAD_DIM)
    ks = [mx.random.normal(shape, key=mx.random.split(key, 2 * LAYERS)[i]) for i in range(2 * LAYERS)]
    q = mx.random.normal((1, Q_HEADS, queries, HEAD_DIM), key=key)
    mask = "causal" if queries > 1 else None
    scale = HEAD_DIM ** -0.5
    mx.eval(ks, q)
    out: dict = {"history": history, "queries": queries, "device": str(mx.default_device())}

    def dense(buffers):
        return [mx.fast.scaled_dot_product_attention(q, buffers[2 * i], buffers[2 * i + 1],
                                                     scale=scale, mask=mask)
                for i in range(LAYERS)]

    out["float32_buffers_ms"] = _median_ms(lambda: dense(ks), reps)
    for bits in SETTINGS[1:]:
        c = KVQuant(bits)
        quant = [c.quantize(k) for k in ks]
        mx.eval(quant)

        def quantized():
            return [quantized_scaled_dot_product_attention(
                q, quant[2 * i], quant[2 * i + 1], scale=scale, mask=mask,
                group_size=c.group_size, bits=bits) for i in range(LAYERS)]

        out[f"q{bits}_matmul_ms"] = _median_ms(quantized, reps)
        out[f"q{bits}_dequantize_each_step_ms"] = _median_ms(
            lambda: dense([c.dequantize(p) for p in quant]), reps)
        fresh = mx.random.normal((1, KV_HEADS, queries, HEAD_DIM), key=key)
        out[f"q{bits}_round_trip_ms"] = _median_ms(
            lambda: [c.round_trip_pair(fresh, fresh) for _ in range(LAYERS)], reps)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("what", choices=["attention"])
    ap.add_argument("--history", type=int, default=2400)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = {"decode": attention(args.history, args.reps),
              "prefill_256": attention(args.history, max(3, args.reps // 5), queries=256)}
    print(json.dumps(result, indent=1))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
