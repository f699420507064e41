"""What a wider forward pass costs against a plain decode step, measured as the server runs:
:class:`PassCost` (used by ``speculate.Speculation._width`` to pick each step's width).

Plain steps (one token a sequence) and wide passes (a verify pass: a sequence's last token and
its draft) are kept apart, because the two need not lie on one line: on a CPU a pass costs about
``fixed + b * rows`` whatever its width (measured: docs/BENCHMARKS.md section 17), but on a GPU a
plain step runs kernels made for one query row (a matrix-vector product, attention for one
query) and a pass of two rows or more other ones, so a wide pass can cost several plain steps
however few its rows (measured on an H100: ~8x for the default model alone, section 17). So:

- a plain step of ``B`` sequences costs the median of that batch size's recent plain steps;
- a wide pass of ``rows`` costs what that batch size's recent wide passes of as many rows took
  (the median), or between two row counts measured the segment joining them, beyond them the
  nearest one plus a line's slope (least squares over them all, ``fixed + b * rows``); with
  fewer than two row counts measured the line through them with the prior ``b / fixed =
  PRIOR``, and before any the prior with the fixed part taken from the plain steps. On a CPU
  the first draft row of each sequence costs more than the next ones (measured: section 17,
  "the whole benchmark on the AMD EPYC box"), so one line through all widths made a width of
  3-4 look dearer than it was and a width of 2 won steps it should not;
- each kind keeps its own recent window, so a long run of plain steps never pushes the wide
  passes out (which made a machine where drafts do not pay try them again and again).

A batch size whose wide passes were found not to pay is probed again now and then, the gap
doubling each time it still does not (``probe_due``): costs change with the context and the
batch, and a probe costs one wide pass.
"""

from __future__ import annotations

import bisect
import statistics


class PassCost:
    """Recent passes per batch size: plain steps and wide passes apart (module docstring)."""

    PRIOR, WINDOW = 0.05, 32
    FIRST_PROBE, LAST_PROBE = 16, 1024  # plain steps declined before a wide pass is tried again

    def __init__(self) -> None:
        self.plain: dict[int, list[float]] = {}
        self.wide: dict[int, list[tuple[int, float]]] = {}
        self._declined: dict[int, int] = {}
        self._gap: dict[int, int] = {}
        self._fits: dict[int, tuple] = {}  # per batch size, (plain, line) until its next pass

    def add(self, seqs: int, rows: int, seconds: float) -> None:
        """A pass of ``seqs`` sequences over ``rows`` token rows took ``seconds``."""
        if rows <= seqs:
            got: list = self.plain.setdefault(seqs, [])
            got.append(seconds)
        else:
            got = self.wide.setdefault(seqs, [])
            got.append((rows, seconds))
        del got[:-self.WINDOW]
        self._fits.pop(seqs, None)

    def relative(self, seqs: int, width: int, rows: int | None = None) -> float:
        """What a pass of ``seqs`` sequences ``width`` tokens wide costs, in plain steps of
        ``seqs`` (1.0 for ``width`` 1; never below 1): a pass of ``rows`` token rows (fewer
        than ``seqs * width`` where it is ragged), ``seqs * width`` unless given."""
        rows = seqs * width if rows is None else rows
        if width <= 1:
            return 1.0
        if seqs not in self._fits:  # fitted once a step, not once a width tried
            self._fits[seqs] = (statistics.median(self.plain[seqs]) if self.plain.get(seqs)
                                else None, self._line(seqs), self._measured(seqs))
        plain, line, measured = self._fits[seqs]
        if line is None or plain is None:
            if line is not None:  # no plain step of this size yet: the line at one row a sequence
                plain = line[0] + line[1] * seqs
            else:
                return (1 + self.PRIOR * rows) / (1 + self.PRIOR * seqs)
        cost = _along(measured, rows, line)
        return max(1.0, cost / plain) if plain > 0 else 1.0

    def _measured(self, seqs: int) -> list[tuple[int, float]]:
        """``(rows, seconds)`` for each row count of the recent wide passes of ``seqs``, by
        rows: the median of each, then made non-decreasing (pooled where a count cost less than
        a smaller one: a pass of more rows never costs less)."""
        by_rows: dict[int, list[float]] = {}
        for rows, t in self.wide.get(seqs, []):
            by_rows.setdefault(rows, []).append(t)
        blocks: list[list[float]] = []  # [first rows, last rows, weight, mean], pooled
        for rows in sorted(by_rows):
            blocks.append([rows, rows, len(by_rows[rows]), statistics.median(by_rows[rows])])
            while len(blocks) > 1 and blocks[-2][3] > blocks[-1][3]:
                lo, hi = blocks[-2], blocks.pop()
                w = lo[2] + hi[2]
                lo[1:] = [hi[1], w, (lo[3] * lo[2] + hi[3] * hi[2]) / w]
        return [(r, t) for first, last, _, t in blocks for r in sorted({first, last})]

    def _line(self, seqs: int) -> tuple[float, float] | None:
        """``(fixed, b)`` for wide passes of ``seqs`` sequences: fitted where they were of two
        widths or more, else through their mean with the prior slope; None before any."""
        got = self.wide.get(seqs, [])
        if not got:
            return None
        xs = [r for r, _ in got]
        n = len(xs)
        mx_, my = sum(xs) / n, sum(t for _, t in got) / n
        if len(set(xs)) < 2 or n < 4:
            a = my / (1 + self.PRIOR * mx_)
            return a, self.PRIOR * a
        sxx = sum((x - mx_) ** 2 for x in xs)
        b = max(0.0, sum((x - mx_) * (t - my) for x, t in got) / sxx)
        a = my - b * mx_
        if a <= 0:  # rows are all there is (or noise): a small fixed part
            a = max(my * 0.05, 1e-6)
        return a, b

    def probe_due(self, seqs: int, declined: bool) -> bool:
        """Called once a step that had drafts: ``declined`` when its width came out 1 by cost.
        True when this step should verify anyway (a probe); a step that chose a wide pass on its
        own merit resets the gap."""
        if not declined:
            self._declined[seqs] = 0
            self._gap[seqs] = self.FIRST_PROBE
            return False
        n = self._declined.get(seqs, 0) + 1
        gap = self._gap.get(seqs, self.FIRST_PROBE)
        if n < gap:
            self._declined[seqs] = n
            return False
        self._declined[seqs] = 0
        self._gap[seqs] = min(gap * 2, self.LAST_PROBE)
        return True


def _along(measured: list[tuple[int, float]], rows: int, line: tuple[float, float]) -> float:
    """Seconds for a pass of ``rows`` (module docstring): on ``measured`` where it spans
    ``rows``, from its nearest end along the line's slope beyond it, the line itself where it
    holds fewer than two row counts."""
    a, b = line
    if len(measured) < 2:
        return a + b * rows
    xs = [r for r, _ in measured]
    i = bisect.bisect_left(xs, rows)
    if i < len(xs) and xs[i] == rows:
        return measured[i][1]
    if i == 0 or i == len(xs):
        r0, t0 = measured[0] if i == 0 else measured[-1]
        return max(t0 + b * (rows - r0), t0 * 0.05)
    (r0, t0), (r1, t1) = measured[i - 1], measured[i]
    return t0 + (t1 - t0) * (rows - r0) / (r1 - r0)
