"""Attention's forms of ``kv_cache/model/cpu_forms.py`` against the plain ops, in whole passes of
the default model (MLX's CPU backend on x86): the prefix's products (``--toggle products``) or
``exp`` (``--toggle exp``: the polynomial against ``power``; ``--toggle fused``: the polynomial
of the prefix's differences compiled into fused kernels against its ops one by one; ``--toggle
own``: sequences holding their whole context in their own buffers, as resident ones do, their
keys before the queries read as a prefix where it pays or never, ``attention.OWN_PREFIX_FROM``;
``--toggle from``: the same, always or where it pays; with
``--shared-head S``, their documents begin with the same ``S`` sentences, which all eight read
through one view of those pages, as agents sharing a system prompt do).

Eight conversations each on its own document (eight agents on eight files), cached in pages and
closed; each then starts from its pages (one prefix view each, as an agent's next turn does)
with one new token. Each rep runs a plain step and verify passes 2, 3 and 4 tokens wide, with the
forms on and off taking turns pass by pass (``cpu_forms.PRODUCTS``, ``POLY_EXP`` or ``FUSED``),
so a drift in the machine's speed falls on both:

    python scripts/bench_cpu_forms.py [--toggle products|exp|fused|own|from] [--sentences 190]
                                      [--shared-head 0] [--widths 1 2 3 4] [--reps 6]
                                      [--json FILE]

Prints the milliseconds of each pass (medians) and each width's cost in plain steps.
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

from bench_batching import on_document  # noqa: E402
from bench_pass_width import _pass  # noqa: E402
from bench_results import write_result  # noqa: E402
from bench_ttft import document  # noqa: E402
from bench_warm_turns import cached_turns  # noqa: E402
from kv_cache.model import attention, cpu_forms  # noqa: E402
from mlx_kvserver.engine.memory import MemoryBudget  # noqa: E402
from mlx_kvserver.models.loading import resolve_and_load  # noqa: E402


# each toggle: the module and flag it sets, and its two arms' names (flag off, flag on)
TOGGLES = {"products": (cpu_forms, "PRODUCTS", {"plain products": False, "forms": True}),
           "exp": (cpu_forms, "POLY_EXP", {"exp by power": False, "exp by polynomial": True}),
           "fused": (cpu_forms, "FUSED", {"exp's ops one by one": False, "exp fused": True}),
           "own": (attention, "OWN_PREFIX_FROM", {"own keys": math.inf,
                                                  "own as prefix": attention.OWN_PREFIX_FROM}),
           "from": (attention, "OWN_PREFIX_FROM", {"own as prefix always": 0,
                                                   "where it pays": attention.OWN_PREFIX_FROM})}


def on_views(lm, n: int, sentences: int, views: bool = True):
    """``n`` sequences, each started from the cached pages of its own document plus one new
    token (``views``: through a prefix view each; else its pages gathered into its own buffers,
    as a resident sequence holds its context): (runner, sequences, each one's next token)."""
    manager, runner, prompts = cached_turns(lm, [1] * n, sentences)
    if not views:
        manager.views.min_pages = 1 << 62
    started = [manager.start(p, []) for p in prompts]
    seqs = [s for s, _ in started]
    rows = runner.prefill_many(seqs, [p[m.tokens:] for p, (_, m) in zip(prompts, started)],
                               [True] * n)
    return runner, seqs, [int(mx.argmax(r.reshape(-1, r.shape[-1])[-1]).item()) for r in rows]


def on_shared_head(lm, n: int, sentences: int, head: int):
    """``n`` sequences on documents that begin with the same ``head`` sentences, read one after
    the other as a server reads them: the later ones find the head in the first one's pages, and
    all read it through one view (the first takes it up at its next step) and hold the rest in
    their own buffers (runner, sequences, next tokens)."""
    common = "You are a coding agent. " + document(head)
    docs = [f"{common} Guide {i + 1} of {n}. " + document(sentences - head) for i in range(n)]
    _, _, runner, seqs, nxt = on_document(lm, docs, n, chunk=512)
    return runner, seqs, nxt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sequences", type=int, default=8)
    ap.add_argument("--sentences", type=int, default=190, help="document length (190: ~3,700 "
                    "tokens)")
    ap.add_argument("--shared-head", type=int, default=0, metavar="S",
                    help="with --toggle own or from: the documents' first S sentences the same, "
                         "read through one view by all (0: none)")
    ap.add_argument("--widths", type=int, nargs="+", default=[1, 2, 3, 4])
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--model", default="default")
    ap.add_argument("--toggle", choices=list(TOGGLES), default="products")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    where, flag, modes = TOGGLES[args.toggle]
    if not cpu_forms.on_x86_cpu():
        sys.exit("the forms are used on MLX's CPU backend on x86 only")
    lm = resolve_and_load(args.model)
    t0 = time.perf_counter()
    if args.shared_head and args.toggle in ("own", "from"):
        runner, seqs, nxt = on_shared_head(lm, args.sequences, args.sentences, args.shared_head)
    else:
        runner, seqs, nxt = on_views(lm, args.sequences, args.sentences,
                                     args.toggle not in ("own", "from"))
    print(f"{len(seqs)} conversations read and started from their pages in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    budget = MemoryBudget()  # MLX's limits as the server sets them: without, MLX's buffer
    budget.apply()  # cache keeps 32 MiB here, and a wide pass's temporaries come from fresh
    budget.in_use()  # memory every time (48,000 page faults a pass 4 tokens wide)
    times: dict[str, dict[int, list[float]]] = {m: {w: [] for w in args.widths} for m in modes}
    for rep in range(args.reps + 1):  # the first rep warms up, unrecorded
        for w in args.widths:
            for mode, on in (modes.items() if rep % 2 else reversed(modes.items())):
                setattr(where, flag, on)
                t = time.perf_counter()
                _pass(runner, seqs, nxt, w)
                if rep:
                    times[mode][w].append((time.perf_counter() - t) * 1e3)
    setattr(where, flag, True)
    res = {"argv": sys.argv[1:], "device": str(mx.default_device()),
           "machine": platform.machine(), "processor": platform.processor(),
           "mlx": mx.__version__, "model": lm.name, "context": [len(s.tokens) for s in seqs],
           "views": [s.view is not None for s in seqs],
           "mlx_cache_limit": budget.cache_limit}
    for mode, by_w in times.items():
        med = {w: round(statistics.median(t), 1) for w, t in by_w.items()}
        res[mode] = {"pass_ms": med, "in_plain_steps": {
            w: round(m / med[args.widths[0]], 2) for w, m in med.items()},
            "pass_ms_all": {w: [round(x, 1) for x in t] for w, t in by_w.items()}}
        print(f"{mode:17s}", " ".join(f"w{w} {m:.0f} ms" for w, m in med.items()), "| in plain "
              "steps", " ".join(f"{v:.2f}" for v in res[mode]["in_plain_steps"].values()),
              flush=True)
    if args.json:
        write_result(args.json, json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
