"""What a wider forward pass costs against a plain decode step, measured as the server runs:
:class:`PassCost` (used by ``speculate.Speculation._width`` to pick each step's width).

Plain steps (one token a sequence) and wide passes (a verify pass: a sequence's last token and
its draft) are kept apart, because the two need not lie on one line: on a CPU a pass costs about
``fixed + b * rows`` whatever its width (measured with benchmarks/pass_width.py), but on a GPU a
plain step runs kernels made for one query row (a matrix-vector product, attention for one
query) and a pass of two rows or more other ones, so a wide pass can cost several plain steps
however few its rows (measured on an H100 with benchmarks/speculation.py: ~8x for the default
model alone). Both from earlier runs, in docs/BENCHMARKS.md's git history. So:

- a plain step of ``B`` sequences costs the median of that batch size's recent plain steps;
- a wide pass of ``rows`` costs a line ``fixed + b * rows`` through that batch size's recent
  wide passes, or, before they say anything, the prior ``b / fixed = PRIOR`` with the fixed part
  taken from the plain steps. The slope ``b`` is what one more row costs, which is the same
  whatever the batch (a row's weights and its own attention): it is read from the passes of every
  batch size together, as the median of the slopes between two passes of one batch size
  (Theil-Sen), and the fixed part of each batch size is the median of its passes' ``time - b *
  rows``. One slow pass (the machine busy elsewhere for a moment) moves neither, and a batch size
  seldom run wide borrows the slope the others measured (NOTE in ``_line``);
- each kind keeps its own recent window, so a long run of plain steps never pushes the wide
  passes out (which made a machine where drafts do not pay try them again and again).

A batch size whose wide passes were found not to pay is probed again now and then, the gap
doubling each time it still does not (``probe_due``): costs change with the context and the
batch, and a probe costs one wide pass.
"""

from __future__ import annotations

import statistics

import numpy as np


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
        self._slope: tuple[float, float] | None = None  # (slope, rows' spread), all batch sizes

    def add(self, seqs: int, rows: int, seconds: float) -> None:
        """A pass of ``seqs`` sequences over ``rows`` token rows took ``seconds``."""
        if rows <= seqs:
            got: list = self.plain.setdefault(seqs, [])
            got.append(seconds)
        else:
            got = self.wide.setdefault(seqs, [])
            got.append((rows, seconds))
            self._fits.clear()  # the slope is every batch size's
            self._slope = None
        del got[:-self.WINDOW]
        self._fits.pop(seqs, None)

    def relative(self, seqs: int, rows: int) -> float:
        """What a pass of ``seqs`` sequences over ``rows`` token rows costs, in plain steps of
        ``seqs`` (1.0 for a plain step, ``rows <= seqs``; never below 1). ``rows`` are the rows
        the pass will have, as ``add`` is told them (a ragged pass: the drafts' own)."""
        if rows <= seqs:
            return 1.0
        if seqs not in self._fits:  # fitted once a step, not once a width tried
            self._fits[seqs] = (statistics.median(self.plain[seqs]) if self.plain.get(seqs)
                                else None, self._line(seqs))
        plain, line = self._fits[seqs]
        if line is None or plain is None:
            if line is not None:  # no plain step of this size yet: the line at one row a sequence
                plain = line[0] + line[1] * seqs
            else:
                return (1 + self.PRIOR * rows) / (1 + self.PRIOR * seqs)
        a, b = line
        return max(1.0, (a + b * rows) / plain) if plain > 0 else 1.0

    def _line(self, seqs: int) -> tuple[float, float] | None:
        """``(fixed, b)`` for wide passes of ``seqs`` sequences; None before any. ``b``: the
        slope of every batch size's passes (``_pooled``) drawn toward the prior one through
        this batch size's mean by how little their rows spread; with no two passes of
        different rows anywhere, the prior alone."""
        got = self.wide.get(seqs, [])
        if not got:
            return None
        xs = [r for r, _ in got]
        n = len(xs)
        mx_, my = sum(xs) / n, sum(t for _, t in got) / n
        prior = self.PRIOR * my / (1 + self.PRIOR * mx_)  # the prior slope through their mean
        fitted, sxx = self._pooled()
        if sxx == 0:
            return prior / self.PRIOR, prior
        # NOTE: the slope is drawn toward the prior one by ``seqs ** 2`` rows squared of weight:
        # passes whose rows spread little say little of it (seen: eight sequences' passes of 16
        # and 18 rows gave 32 ms a row, three times the true slope, so drafts taken 99% of the
        # time were declined for the rest of the answers); a spread of passes outweighs it. It
        # is every batch size's and robust (module docstring): fitted by least squares per batch
        # size, one pass of 434 ms among three of ~130 (three answers left, rows 4 to 9) set 33
        # ms a row against ~3, and the last three answers of an 8-client `rewrite` row, their
        # drafts taken 69-98% of the time, verified one token a pass for 34 passes (the width
        # chosen from that slope never spread the rows enough to correct it)
        b = (fitted * sxx + prior * seqs ** 2) / (sxx + seqs ** 2)
        a = statistics.median(t - b * r for r, t in got)
        if a <= 0:  # rows are all there is (or noise): a small fixed part
            a = max(my * 0.05, 1e-6)
        return a, b

    def _pooled(self) -> tuple[float, float]:
        """(the median slope between two wide passes of one batch size and different rows, over
        every batch size; the rows' spread about each batch size's mean, summed); (0, 0) with no
        such pair."""
        if self._slope is None:
            slopes, sxx = [], 0.0
            for got in self.wide.values():
                x = np.array([r for r, _ in got], np.float64)
                t = np.array([s for _, s in got], np.float64)
                i, j = np.triu_indices(len(x), 1)
                dx = x[j] - x[i]
                keep = dx != 0
                slopes.append((t[j] - t[i])[keep] / dx[keep])
                sxx += float(((x - x.mean()) ** 2).sum())
            every = np.concatenate(slopes) if slopes else np.zeros(0)
            self._slope = (max(0.0, float(np.median(every))), sxx) if every.size else (0.0, 0.0)
        return self._slope

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
