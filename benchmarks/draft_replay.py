"""The recorded answers of ``benchmarks/speculation.py`` replayed through the drafter alone:
how many passes each answer needs when every draft the drafter offers is verified (no width
chooser, no pass costs), the draft rows those passes verify, and what that leaves a row of
several clients at most.

An 8-client row ends with its slowest answer: an answer the drafts cannot follow (code its file
does not hold) takes a pass for each of its tokens or two, whatever the other answers do. With
``--plain-steps`` (a server's debug log, or a file holding its ``plain step: N
sequences, M ms`` lines) a bound in time too: without drafts the row takes ``t`` plain steps of
all its answers (the longest answer's tokens); with them at least ``sum over p of plain(live(p))``,
pass ``p`` costing at least a plain step of the answers still being written. Their quotient is
the most speculation could give the row if draft rows cost nothing; on this CPU each costs ~1/4
of a sequence's plain token at eight sequences (read from earlier runs of
``benchmarks/speculation.py``, in docs/BENCHMARKS.md's git history).

The prompts are rebuilt as the server builds them (the API's parsing, the chat template); each
answer's text is tokenized again, which may cut a few tokens differently from the ids the model
wrote. No model pass runs: only the default model's tokenizer is loaded.

    .venv/bin/python -m benchmarks.draft_replay benchmarks/results/speculation/<stamp>.json
        [--workload rewrite] [--num-draft-tokens 8] [--plain-steps LOG ...] [--json FILE]

The result goes to benchmarks/results/draft_replay/<run's UTC time>.json unless --json names a
file.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np

from benchmarks.record import OVERRIDE_HELP, write
from benchmarks.speculation import WORKLOADS
from benchmarks.steps import steps
from mlx_kvserver.engine.speculation.drafts import Drafter


def replay(context: list[int], answer: list[int], max_len: int) -> dict:
    """``answer`` written after ``context`` by passes that verify every draft offered: (passes,
    draft rows verified, draft tokens taken, each pass as ``offered/taken``)."""
    ctx = list(context)
    drafter = Drafter(ctx, max_len)  # it reads the list the answer's tokens are appended to
    pos = rows = taken = 0
    trace: list[str] = []
    while pos < len(answer):
        draft = drafter.propose(len(answer) - pos - 1)  # the pass writes one token of its own
        ok = 0
        while ok < len(draft) and draft[ok] == answer[pos + ok]:
            ok += 1
        ctx.extend(answer[pos:pos + ok + 1])  # the taken tokens and the pass's own
        pos += ok + 1
        rows, taken = rows + len(draft), taken + ok
        drafter.taken(len(draft), ok)
        trace.append(f"{len(draft)}/{ok}")
    return {"tokens": len(answer), "passes": len(trace), "draft_rows": rows,
            "draft_taken": taken, "trace": " ".join(trace)}


def plain_costs(paths: list[Path]) -> dict[int, float]:
    """Median ms of a plain step by its sequences, from log lines ``plain step: N sequences, M
    ms``."""
    seen: dict[int, list[int]] = {}
    for path in paths:
        for n, ms in steps(path.read_text())[0]:
            seen.setdefault(n, []).append(ms)
    return {n: statistics.median(v) for n, v in sorted(seen.items())}


def plain_ms(costs: dict[int, float], n: int) -> float:
    """A plain step of ``n`` sequences: measured, else on the line between the nearest measured
    counts (the nearest one's beyond them)."""
    xs = sorted(costs)
    return float(np.interp(n, xs, [costs[x] for x in xs]))


def time_bound(passes: list[int], longest: int, costs: dict[int, float]) -> dict:
    """(ms without drafts, the least ms with them, their quotient) for answers needing
    ``passes`` passes each and ``longest`` plain steps without drafts."""
    off = longest * plain_ms(costs, len(passes))
    on = sum(plain_ms(costs, sum(m > p for m in passes)) for p in range(max(passes)))
    return {"plain_ms": round(off), "least_ms": round(on), "speedup_at_most": round(off / on, 3)}


def prompt_ids(lm, workload: str, i: int, max_tokens: int) -> list[int]:
    """The prompt's token ids for answer ``i`` of ``workload``, as the server renders it."""
    from mlx_kvserver.api import anthropic, openai_chat
    from mlx_kvserver.chat.render import encode
    from mlx_kvserver.chat.support import chat_support
    from mlx_kvserver.config import ServerConfig

    route, body = WORKLOADS[workload](i, max_tokens)
    parse = anthropic.parse if route == "/v1/messages" else openai_chat.parse
    conv = parse(body, ServerConfig())
    return encode(lm.tokenizer, chat_support(lm).format, conv)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path, nargs="+", help="benchmarks/speculation.py JSON results")
    ap.add_argument("--workload", default="rewrite", choices=["rewrite", "free"])
    ap.add_argument("--num-draft-tokens", type=int, default=8)
    ap.add_argument("--plain-steps", type=Path, nargs="+", default=[],
                    help="server debug logs or steps files with 'plain step' lines")
    ap.add_argument("--json", type=Path, help=OVERRIDE_HELP)
    args = ap.parse_args()
    costs = plain_costs(args.plain_steps)
    from mlx_kvserver.models.loading import resolve_and_load

    lm = resolve_and_load("default")
    out = []
    for path in args.results:
        data = json.loads(path.read_text())
        for run in data["runs"]:
            if run["workload"] != args.workload or run["mode"] != "ngram":
                continue
            max_tokens = max(run["tokens"])
            answers = [replay(prompt_ids(lm, args.workload, i, max_tokens),
                              lm.tokenizer.encode(text), args.num_draft_tokens)
                       for i, text in enumerate(run["texts"])]
            passes = [a["passes"] for a in answers]
            longest = max(a["tokens"] for a in answers)
            row = {"results": str(path), "round": run["round"], "clients": run["clients"],
                   "answers": answers, "longest_tokens": longest,
                   **(time_bound(passes, longest, costs) if costs else {})}
            out.append(row)
            bound = f"; speedup at most {row['speedup_at_most']}x ({row['plain_ms']} ms " \
                    f"plain, at least {row['least_ms']} ms)" if costs else ""
            print(f"{path.name} round {run['round']} x{run['clients']}: passes per answer "
                  f"{sorted(passes)} for {longest} tokens at most{bound}", flush=True)
    write("draft_replay", json.dumps({"argv": sys.argv[1:], "plain_ms": costs, "rows": out},
                                     indent=1), override=args.json)


if __name__ == "__main__":
    main()
