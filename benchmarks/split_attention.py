"""One sequence's attention over a prefix view, the two ways ``kv_cache.model.attention`` can run it:
the split path (prefix and own positions scored apart, merged by their log-sum-exp) against one
copy of the view's keys and values in front of the sequence's own and MLX's fused kernel (what
``_copy_pays`` chooses between), and the fused kernel over keys already contiguous (a warm
sequence). Per layer: ``--heads`` query heads over ``--kv-heads``, ``--prefix`` positions in
the view, ``--queries`` new positions; medians of ``--repeat`` evaluated calls.

Usage: .venv/bin/python -m benchmarks.split_attention [--json FILE]
       (without shape flags: the shapes of its earlier runs, in docs/BENCHMARKS.md's git history)
The result goes to benchmarks/results/split_attention/<run's UTC time>.json unless --json names a
file.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.record import OVERRIDE_HELP, write
from kv_cache.model.attention import Reads, split_attention

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# (query heads, KV heads, head_dim, prefix positions, queries, dtype): the tiny model of the
# 16,000-token benchmark, and the default model's shape at ~2,400 tokens
SHAPES = [(4, 2, 16, 16000, T, "float32") for T in (1, 8, 16, 25, 32, 76)] + \
         [(4, 2, 16, 16000, 76, "bfloat16"), (9, 3, 64, 2400, 8, "float32"),
          (9, 3, 64, 2400, 76, "float32"), (9, 3, 64, 2400, 512, "float32"),
          (9, 3, 64, 2400, 76, "bfloat16"), (9, 3, 64, 2400, 76, "float16")]


def median_ms(fn, repeat: int) -> float:
    mx.eval(fn())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return sorted(times)[repeat // 2] * 1e3


def one(Hq: int, Hkv: int, D: int, c: int, T: int, dtype: str, repeat: int) -> dict:
    dt = DTYPES[dtype]
    q = mx.random.normal((1, Hq, T, D)).astype(dt)
    kp, vp = (mx.random.normal((Hkv, c, D)).astype(dt) for _ in range(2))
    ko, vo = (mx.random.normal((1, Hkv, T, D)).astype(dt) for _ in range(2))
    mask = "causal" if T > 1 else None
    read = Reads((kp, vp), None, ko, vo, c, c, 0)
    k_all = mx.concatenate([kp[None], ko], axis=2)
    v_all = mx.concatenate([vp[None], vo], axis=2)
    mx.eval(q, kp, vp, ko, vo, k_all, v_all)

    def copied():
        k = mx.concatenate([kp[None], ko], axis=2)
        v = mx.concatenate([vp[None], vo], axis=2)
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=D**-0.5, mask=mask)

    return {"heads": Hq, "kv_heads": Hkv, "head_dim": D, "prefix": c, "queries": T,
            "dtype": dtype,
            "split_ms": round(median_ms(lambda: split_attention(q, [read], D**-0.5), repeat), 2),
            "copy_fused_ms": round(median_ms(copied, repeat), 2),
            "fused_contiguous_ms": round(median_ms(
                lambda: mx.fast.scaled_dot_product_attention(q, k_all, v_all, scale=D**-0.5,
                                                             mask=mask), repeat), 2)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    mx.random.seed(0)
    rows = []
    for shape in SHAPES:
        rows.append(one(*shape, args.repeat))
        print(json.dumps(rows[-1]), flush=True)
    write("split_attention", json.dumps(rows, indent=1), override=args.json)


if __name__ == "__main__":
    main()
