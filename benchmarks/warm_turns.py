"""The next turns of several cached conversations arriving together (default model): the one
prompt pass that reads their new tokens, right-padded to the longest against ragged.

Agents' turns after a cached prefix carry a few to a few dozen new tokens each (a tool result,
a short user line, the tail of a page the cache does not hold whole), and the scheduler reads
all that arrive together in one pass (``Runner.prefill_many``). Padded, every sequence costs
the longest piece's rows; ragged (``Runner._pass``), its own. Each conversation is on its own
document (as eight agents on eight files), cached in pages and closed; each rep starts every
conversation's next turn from those pages and reads the new tokens in one pass, padded and
ragged taking turns (``runner.ragged`` off and on), so a drift in the machine's speed falls on
both:

    .venv/bin/python -m benchmarks.warm_turns [--new 1 4 14 20 25 28 31] [--sentences 112]
        [--reps 5] [--json FILE]

Prints the milliseconds to start the sequences from their pages and of the pass (medians). The
result goes to benchmarks/results/warm_turns/<run's UTC time>.json unless --json names a file.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batching import on_document
from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import document
from mlx_kvserver.models.loading import resolve_and_load


def turn(manager, runner, prompts: list[list[int]], ragged: bool) -> tuple[float, float]:
    """Start each prompt's sequence from the pages and read its new tokens in one pass:
    (ms to start them, ms of the pass)."""
    runner.ragged = ragged
    t0 = time.perf_counter()
    started = [manager.start(p, []) for p in prompts]
    t1 = time.perf_counter()
    seqs = [s for s, _ in started]
    pieces = [p[m.tokens:] for p, (_, m) in zip(prompts, started)]
    mx.eval(runner.prefill_many(seqs, pieces, [True] * len(seqs)))
    t2 = time.perf_counter()
    for s in seqs:
        s.close()
    return (t1 - t0) * 1e3, (t2 - t1) * 1e3


def cached_turns(lm, new: list[int], sentences: int):
    """One conversation per entry of ``new``, each on its own document, read and cached in
    pages and closed: (manager, runner, each one's next prompt: its cached pages, then
    ``new[i]`` new tokens)."""
    docs = [f"Guide {i + 1} of {len(new)}. " + document(sentences) for i in range(len(new))]
    _, manager, runner, seqs, _ = on_document(lm, docs, len(new), chunk=512)
    page = manager.pool.page_size
    prompts = []
    for s, k in zip(seqs, new):
        cached = list(s.tokens)[: page * (len(s.tokens) // page)]
        prompts.append(cached + [100 + j for j in range(k)])
        s.commit()
        s.close()
    return manager, runner, prompts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--new", type=int, nargs="+", default=[1, 4, 14, 20, 25, 28, 31],
                    help="new tokens of each conversation's next turn (one conversation each)")
    ap.add_argument("--sentences", type=int, default=112, help="document length (112: ~2,000 "
                    "tokens)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--model", default="default")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    lm = resolve_and_load(args.model)
    n = len(args.new)
    t0 = time.perf_counter()
    manager, runner, prompts = cached_turns(lm, args.new, args.sentences)
    print(f"{n} documents read in {time.perf_counter() - t0:.1f} s", flush=True)
    if not runner.ragged:
        sys.exit("this model's passes cannot go ragged (runner.ragged is off)")
    rows = {"padded": n * max(args.new), "ragged": sum(args.new)}
    times: dict[str, list[tuple[float, float]]] = {"padded": [], "ragged": []}
    for rep in range(args.reps + 1):  # the first rep warms up, unrecorded
        for mode in (("padded", "ragged") if rep % 2 == 0 else ("ragged", "padded")):
            got = turn(manager, runner, prompts, mode == "ragged")
            if rep:
                times[mode].append(got)
    res = {"argv": sys.argv[1:], "device": str(mx.default_device()),
           "machine": platform.machine(), "mlx": mx.__version__, "model": lm.name,
           "new_tokens": args.new, "context": [len(p) for p in prompts], "rows": rows}
    for mode, ts in times.items():
        res[mode] = {"start_ms": round(statistics.median(t[0] for t in ts), 1),
                     "pass_ms": round(statistics.median(t[1] for t in ts), 1),
                     "pass_ms_all": [round(t[1], 1) for t in ts]}
        print(f"{mode:6s} ({rows[mode]} rows): start {res[mode]['start_ms']} ms, pass "
              f"{res[mode]['pass_ms']} ms", flush=True)
    res["ragged_over_padded"] = round(res["ragged"]["pass_ms"] / res["padded"]["pass_ms"], 3)
    print(f"ragged pass / padded pass: {res['ragged_over_padded']}", flush=True)
    write("warm_turns", json.dumps(res, indent=1), override=args.json)


if __name__ == "__main__":
    main()
