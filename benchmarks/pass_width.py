"""What a forward pass ``w`` tokens wide costs against a plain decode step (default model).

A verify pass (engine/speculation/speculate.py) feeds each sequence its last token and a draft of
``w - 1``; speculation pays where such a pass costs little more than a step
(engine/speculation/pass_cost.py measures it as the server runs). This script measures it apart, per
backend:

    .venv/bin/python -m benchmarks.pass_width [--widths 1 2 4 9] [--batches 1 8] [--reps 8]
        [--cases shared distinct mlx_lm] [--attention now|padded|none] [--json FILE]

Cases: ``shared``: sequences on one ~2,000-token document (one prefix view for all), ``distinct``:
each sequence on its own document (a view each), both through the server's runner and pages;
``mlx_lm``: one sequence in mlx-lm's own ``KVCache`` (no pages, the fused attention kernel), for
reference. Width 1 is the plain decode step (``Runner.decode``); a wider pass is
``Runner.verify`` with its argmax read, then the draft's positions trimmed (a verify step that
takes nothing, so every pass sees the same context). Milliseconds per pass (median of
``--reps``) and each width's cost in plain steps; and the seconds the case's prompts took
(``prefill_s``: one sequence alone on its document reads it through mlx-lm's function). On a
GPU, MLX compiles kernels at first use: the first pass of each shape is left out (two warm-up
passes per cell). The result goes to benchmarks/results/pass_width/<run's UTC time>.json unless
--json names a file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import mlx.core as mx

from benchmarks.batching import on_document, question
from benchmarks.kv_bits import _median_ms
from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.ttft import document
from mlx_kvserver.models.loading import resolve_and_load


def _pass(runner, seqs, nxt: list[int], w: int) -> None:
    if w == 1:
        mx.eval(mx.argmax(runner.decode(seqs, nxt), axis=-1))
        for s in seqs:
            s.trim(1)
        return
    rows = runner.verify(seqs, [[t] * w for t in nxt])
    mx.eval([mx.argmax(r, axis=-1) for r in rows])
    for s in seqs:
        s.trim(w)


def paged(lm, docs: list[str], widths, batches, reps: int) -> dict:
    t0 = time.perf_counter()
    _, _, runner, seqs, nxt = on_document(lm, docs, max(batches), chunk=512)
    out: dict = {"prefill_s": round(time.perf_counter() - t0, 2)}
    print("prompts read in", out["prefill_s"], "s", flush=True)
    for b in batches:
        out[b] = {w: _median_ms(lambda: _pass(runner, seqs[:b], nxt[:b], w), reps)
                  for w in widths}
        print(b, {w: round(t, 2) for w, t in out[b].items()}, flush=True)
    for s in seqs:
        s.close()
    return out


def mlx_lm_reference(lm, doc: str, widths, reps: int) -> dict:
    from mlx_lm.models.cache import make_prompt_cache

    tok = lm.tokenizer
    prompt = tok.encode(tok.render([{"role": "system", "content": doc},
                                    {"role": "user", "content": question(0)}],
                                   add_generation_prompt=True))
    cache = make_prompt_cache(lm.model)
    for at in range(0, len(prompt), 512):
        lm.model(mx.array([prompt[at : at + 512]]), cache=cache)
        mx.eval([c.state for c in cache])

    def one(w: int) -> None:
        mx.eval(mx.argmax(lm.model(mx.array([[5] * w]), cache=cache), axis=-1))
        for c in cache:
            c.trim(w)

    out = {w: _median_ms(lambda: one(w), reps) for w in widths}
    print("mlx-lm", {w: round(t, 2) for w, t in out.items()}, flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 4, 9])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--model", default="default")
    ap.add_argument("--cases", nargs="+", default=["shared", "distinct", "mlx_lm"],
                    choices=["shared", "distinct", "mlx_lm"])
    ap.add_argument("--attention", choices=["now", "padded", "none"], default="now",
                    help="padded: the split path as before own keys were read where they are "
                    "(every sequence's padded into one array each layer); "
                    "none: the split path skipped (its output is the queries), so a "
                    "pass costs its weights and the rest alone: against `now`, what attention "
                    "costs (the logits are not the model's)")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    if args.attention == "padded":
        from kv_cache.model import attention

        attention.OWN_KEYS_APART = 1 << 30
    if args.attention == "none":
        from kv_cache.model import attention

        attention.split_attention = lambda queries, reads, scale, sinks=None: queries
    lm = resolve_and_load(args.model)
    n = max(args.batches)
    doc = document()
    res: dict = {"argv": sys.argv[1:], "device": str(mx.default_device()),
                 "machine": platform.machine(), "mlx": mx.__version__,
                 "env": {k: os.environ.get(k) for k in ("MLX_USE_CUDA_GRAPHS",
                                                        "MLX_CUDA_USE_CUDNN_SDPA")},
                 "model": lm.name, "attention": args.attention, "cases": {}}
    if "shared" in args.cases:
        print("shared document", flush=True)
        res["cases"]["shared"] = paged(lm, [doc] * n, args.widths, args.batches, args.reps)
    if "distinct" in args.cases:
        print("a document each", flush=True)
        docs = [f"Guide {i + 1} of {n}. " + doc for i in range(n)]
        res["cases"]["distinct"] = paged(lm, docs, args.widths, args.batches, args.reps)
    if "mlx_lm" in args.cases:
        res["cases"]["mlx_lm"] = {1: mlx_lm_reference(lm, doc, args.widths, args.reps)}
    res["in_steps"] = {case: {b: {w: round(t / cells[b][args.widths[0]], 3)
                                  for w, t in cells[b].items()} for b in cells
                              if b != "prefill_s"}
                       for case, cells in res["cases"].items()}
    print(json.dumps(res["in_steps"]), flush=True)
    write("pass_width", json.dumps(res, indent=1), override=args.json)


if __name__ == "__main__":
    main()
