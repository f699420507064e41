"""One verify pass of eight sequences, ragged (one row per token, as the runner does it) against
right-padded to the longest piece (as it did), for pieces of equal and of different lengths
(default model, each sequence on its own ~840-token document, no view):

    .venv/bin/python -m benchmarks.ragged_pass [--reps 5] [--json FILE]

Milliseconds a pass, the median of ``--reps`` (the pieces' positions trimmed after each, so
every pass sees the same context). The result goes to
benchmarks/results/ragged_pass/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batching import on_document
from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import document
from mlx_kvserver.models.loading import resolve_and_load

SHAPES = ([1] * 8, [2] * 8, [4] * 8, [8] + [1] * 7, [8] * 4 + [1] * 4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
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
    write("ragged_pass", json.dumps(res, indent=1), override=args.json)


if __name__ == "__main__":
    main()
