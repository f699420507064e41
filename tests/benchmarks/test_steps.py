"""benchmarks/steps.py: a speculating server's answer against its own plain steps, from the
step lines the engine logs at debug level."""

from __future__ import annotations

import re
from pathlib import Path

from benchmarks.steps import in_run

SOURCE = (Path(__file__).resolve().parents[2]
          / "mlx_kvserver/engine/speculation/speculate.py").read_text()


def _format(kind: str) -> str:
    """The engine's own format string for a step line (so a changed log line fails here)."""
    return re.search(r'"(%s: [^"]+)"' % kind, SOURCE)[1]


def _log(plain_ms: list[float], passes: list[tuple[list[int], float, int]], seqs: int = 1) -> str:
    lines = [_format("plain step") % (seqs, ms) for ms in plain_ms]
    lines += [_format("verify pass") % (seqs, d, ms, t) for d, ms, t in passes]
    return "\n".join(f"2026-11-28 18:47:15,591 DEBUG mlx_kvserver.engine: {x}" for x in lines)


def test_an_answer_against_its_own_plain_steps():
    got = in_run(_log([100, 110, 90, 100], [([2], 130.4, 3)]))
    assert got == {"tokens": 7, "verify_passes": 1, "spent_ms": 530, "plain_ms": 100,
                   "speedup": round(7 * 100 / 530, 4)}


def test_drafts_that_fail_cost_what_their_passes_add():
    got = in_run(_log([100] * 6, [([3], 140, 1), ([1], 120, 1)]))
    assert got["tokens"] == 8 and got["speedup"] == round(800 / 860, 4)


def test_several_sequences_or_no_plain_step_give_nothing():
    assert in_run(_log([200, 210], [([2, 0], 260, 3)], seqs=2)) is None
    assert in_run(_log([], [([2], 130, 3)])) is None
    assert in_run("") is None
