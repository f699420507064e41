"""One verify pass of eight sequences, ragged (one row per token, as the runner does it) against
right-padded to the longest piece (as it did), for pieces of equal and of different lengths
(default model, each sequence on its own ~840-token document, no view):

    python scripts/bench_ragged_pass.py [--reps 5] [--json out]

Milliseconds a pass, the median of ``--reps`` (the pieces' positions trimmed after each, so
every pass sees the same context).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import mlx.core as mx  # noqa: E402

from bench_batching import on_document  # noqa: E402
from bench_results import write_result  # noqa: E402
from bench_ttft import document  # noqa: E402
from mlx_kvserver.models.loading import resolve_and_load  # noqa: E402

SHAPES = ([1] * 8, [2] * 8, [4] * 8, [8] + [1] * 7, [8] * 4 + [1] * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    lm = resolve_and_load("default")
    docs = [f"Guide {i}. " + document()[:2500] for i in range(8)]
    _, _, runner, seqs, nxt = on_document(lm, docs, 8, chunk=512)

    def one(lengths: list[int], ragged: bool) -> float:
        runner.ragged = ragged
        t0 = time.perf_counter()
        rows = runner.verify(seqs, [[t] * n for t, n in zip(nxt, lengths)])
        mx.eval([mx.argmax(r, axis=-1) for r in rows])
        dt = time.perf_counter() - t0
        for s, n in zip(seqs, lengths):
            s.trim(n)
        return dt * 1e3

    res = {"argv": sys.argv[1:], "context": [len(s.tokens) for s in seqs], "passes": []}
    for lengths in SHAPES:
        row = {"pieces": lengths}
        for ragged in (False, True):
            row["ragged" if ragged else "padded"] = round(statistics.median(
                one(lengths, ragged) for _ in range(args.reps)), 1)
        print(row, flush=True)
        res["passes"].append(row)
    if args.json:
        write_result(args.json, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
