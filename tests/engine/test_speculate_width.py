"""How wide a verify pass is (engine/speculate.py ``Speculation._width``, ``PassCost``): the
width that gives the most tokens per second, by each answer's recent acceptance and what wider
passes cost on this machine; 1 (a plain decode step) where drafts would not pay."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from mlx_kvserver.engine.drafts import Drafter
from mlx_kvserver.engine.speculate import PassCost, Speculation


def choice(rate: float, source: str = "context"):
    d = Drafter([1, 2, 3], max_len=8)
    d.hits, d.fails = rate * 10, (1 - rate) * 10
    return SimpleNamespace(drafter=d, draft_source=source)


def spec(ratio: float) -> Speculation:
    s = Speculation(runner=None, mode="ngram", max_draft=8)
    s.cost.ratio = lambda seqs: ratio
    return s


def test_the_fit_of_what_rows_cost():
    c = PassCost()
    assert c.ratio(8) == PassCost.PRIOR  # nothing measured yet
    for w in (1, 2, 3, 5, 9) * 2:  # the default model on this CPU, 8 x 2,500 tokens of context
        c.add(8, 8 * w, 0.510 + 0.021 * 8 * w)
        c.add(1, w, 0.115 + 0.021 * w)
    assert c.ratio(8) == pytest.approx(0.021 / 0.510)
    assert c.ratio(1) == pytest.approx(0.021 / 0.115)  # a batch's fixed part is its own
    assert c.ratio(4) == PassCost.PRIOR  # no passes of 4 yet
    c = PassCost()
    for _ in range(10):
        c.add(8, 8, 0.1)
    assert c.ratio(8) == PassCost.PRIOR  # one width only: nothing to fit
    c = PassCost()
    for rows in (1, 2, 3, 4) * 3:
        c.add(1, rows, 0.01 * rows)  # no fixed part at all
    assert c.ratio(1) > 5  # rows are nearly all a pass costs


def test_free_passes_verify_the_whole_draft():
    s = spec(0.0)
    group = [choice(0.2), choice(0.9), choice(0.5)]
    assert s._width(group, [[1, 2], [3, 4, 5, 6, 7, 8], []]) == 7


def test_a_wide_pass_that_costs_what_the_rows_do_is_not_worth_a_weak_draft():
    s = spec(0.3)  # a CPU: 8 rows cost 3.4x the fixed part
    weak = [choice(0.2) for _ in range(8)]
    assert s._width(weak, [[1] * 8] * 8) == 1  # a plain decode step
    strong = [choice(0.95) for _ in range(8)]
    w = s._width(strong, [[1] * 8] * 8)
    assert 1 < w < 9  # worth it, but not all of it


def test_one_answer_alone_takes_a_longer_draft_than_eight_together():
    s = spec(0.03)
    alone = s._width([choice(0.8)], [[1] * 8])
    eight = s._width([choice(0.8) for _ in range(8)], [[1] * 8] * 8)
    assert alone > eight >= 1


def test_a_grammar_forced_draft_counts_as_taken():
    s = spec(0.05)
    forced = [choice(0.0, "grammar")] + [choice(0.2) for _ in range(3)]
    assert s._width(forced, [[1] * 6, [], [], []]) >= 5  # nearly all of it
    unforced = [choice(0.0)] + [choice(0.2) for _ in range(3)]
    assert s._width(unforced, [[1] * 6, [], [], []]) == 1
