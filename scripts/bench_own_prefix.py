"""Where a row's own keys before its queries pay to be read as a prefix of its own
(``attention._own_prefix``, x86's CPU): attention alone, 30 layers of eight rows that read no
view (resident sequences), random queries, keys and values, by the keys before the queries and
the queries a row has (1: a plain step; 4, 9: verify passes), in three arms taking turns:

- ``prefix``: always read as a prefix (``OWN_PREFIX_FROM = 0``);
- ``plain``: never (``OWN_PREFIX_FROM = math.inf``): each row's products on its own keys, ``power``;
- ``rule``: as the server does (``c * sqrt(t) >= OWN_PREFIX_FROM``).

    python scripts/bench_own_prefix.py [--reps 6] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402

from bench_results import write_result  # noqa: E402
from kv_cache.model import attention  # noqa: E402
from kv_cache.model.attention import Reads, split_attention  # noqa: E402

ROWS, HEADS, KV_HEADS, DIM, LAYERS = 8, 9, 3, 64, 30  # the default model's attention


def rows(c: int, t: int) -> list[Reads]:
    """Eight rows, each ``c`` own keys before its ``t`` queries, in buffers with room to grow."""
    out = []
    for _ in range(ROWS):
        k, v = (mx.random.normal((1, KV_HEADS, c + t + 64, DIM)) for _ in range(2))
        mx.eval(k, v)
        out.append(Reads(None, None, k[:, :, : c + t], v[:, :, : c + t], 0, c, 0, buffer=(k, v)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, nargs="+", default=[300, 600, 1000, 1500, 2500, 4000])
    ap.add_argument("--queries", type=int, nargs="+", default=[1, 4, 9])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rule = attention.OWN_PREFIX_FROM
    arms = {"prefix": 0, "plain": math.inf, "rule": rule}
    mx.random.seed(0)
    res: dict = {"argv": sys.argv[1:], "device": str(mx.default_device()),
                 "machine": platform.machine(), "processor": platform.processor(),
                 "mlx": mx.__version__, "own_prefix_from": rule, "ms_per_step": {}}
    for t in args.queries:
        q = mx.random.normal((ROWS, HEADS, t, DIM))
        for c in args.keys:
            reads = rows(c, t)
            times: dict[str, list[float]] = {a: [] for a in arms}
            for rep in range(args.reps + 1):  # the first rep warms up, unrecorded
                for arm in (list(arms) if rep % 2 else list(reversed(arms))):
                    attention.OWN_PREFIX_FROM = arms[arm]
                    t0 = time.perf_counter()
                    mx.eval([split_attention(q, reads, 0.125) for _ in range(LAYERS)])
                    if rep:
                        times[arm].append((time.perf_counter() - t0) * 1e3)
            med = {a: round(statistics.median(v), 1) for a, v in times.items()}
            res["ms_per_step"][f"t={t} c={c}"] = med
            print(f"t={t} c={c:5d}", " ".join(f"{a} {m:6.1f}" for a, m in med.items()), flush=True)
    attention.OWN_PREFIX_FROM = rule
    if args.json:
        write_result(args.json, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
