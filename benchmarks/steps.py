"""A speculating server's decode steps read from its debug log (``--log-level debug``): what
its answers would have cost in plain steps, measured inside the same run.

Two servers taking turns (``benchmarks/speculation.py``) carry this machine's drift between them: on
the 2-core development VM, two servers both with ``--speculate off`` differed by up to 11% in
one pair (three pairs through its rows, in docs/BENCHMARKS.md's git history). One server's own
steps do not: a speculating answer's time (its plain steps and verify passes) against its tokens
at the mean of its own plain steps is what speculation saved or cost it, whatever the machine did
between the runs. That holds for one sequence (every step the same batch); with several, the
batch and so a plain step's cost change as answers end.

    .venv/bin/python -m benchmarks.steps LOG...
"""

from __future__ import annotations

import re
import statistics
import sys

_VERIFY = re.compile(r"verify pass: (\d+) sequences, drafts \[[\d, ]*\], (\d+) ms, (\d+) tokens")
_PLAIN = re.compile(r"plain step: (\d+) sequences, (\d+) ms")


def steps(text: str) -> tuple[list[tuple[int, int]], list[tuple[int, int, int]]]:
    """The engine's step lines in ``text`` (a debug log, or a file of its step lines): plain
    steps as (sequences, ms), verify passes as (sequences, ms, tokens), in order."""
    plain, verify = [], []
    for line in text.splitlines():
        if m := _PLAIN.search(line):
            plain.append((int(m[1]), int(m[2])))
        elif m := _VERIFY.search(line):
            verify.append((int(m[1]), int(m[2]), int(m[3])))
    return plain, verify


def in_run(text: str) -> dict | None:
    """From one server's log: ``tokens`` its decode steps gave, ``spent_ms`` they took,
    ``plain_ms`` (the mean plain step), ``speedup``: ``tokens x plain_ms / spent_ms``. None where
    the log has no plain step or holds steps of more than one sequence."""
    plain, verify = steps(text)
    if not plain or any(n != 1 for n, *_ in plain + verify):
        return None
    tokens = len(plain) + sum(t for *_, t in verify)
    spent = sum(ms for _, ms in plain) + sum(ms for _, ms, _ in verify)
    mean = statistics.mean(ms for _, ms in plain)
    return {"tokens": tokens, "verify_passes": len(verify), "spent_ms": spent,
            "plain_ms": round(mean, 2), "speedup": round(tokens * mean / spent, 4)}


if __name__ == "__main__":
    for path in sys.argv[1:]:
        with open(path) as f:
            print(path, in_run(f.read()))
