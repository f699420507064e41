"""Where an answer is in a client's prediction (engine/speculation/prediction.py), without a model.

The prediction's tokens counted as appearing in the answer are checked against the longest
common subsequence (dynamic programming): never more (no token counted twice, none out of
order), and exactly it on answers made from the prediction by separated edits. Where the answer
is in step with the prediction, the prediction's next tokens are the draft.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserver.engine.speculation.prediction import Prediction


def lcs(a: list[int], b: list[int]) -> int:
    row = [0] * (len(b) + 1)
    for x in a:
        prev, row = row, [0]
        for j, y in enumerate(b):
            row.append(prev[j] + 1 if x == y else max(prev[j + 1], row[j]))
    return row[-1]


def follow(pred: list[int], answer: list[int]) -> Prediction:
    p = Prediction(pred)
    for t in answer:
        p.add(t)
    return p


PRED = list(range(100, 140))


def test_an_answer_equal_to_its_prediction_takes_it_all():
    p = follow(PRED, PRED)
    assert (p.accepted, p.rejected) == (40, 0)
    p = follow(PRED, PRED + [7, 8, 9])  # more after it: nothing more to take
    assert (p.accepted, p.rejected) == (40, 0)
    p = follow(PRED, PRED[:25])  # an answer cut short: the rest did not appear
    assert (p.accepted, p.rejected) == (25, 15)


def test_an_unrelated_answer_takes_nothing():
    p = follow(PRED, list(range(500, 560)))
    assert (p.accepted, p.rejected) == (0, 40)
    assert (Prediction([]).accepted, Prediction([]).rejected) == (0, 0)


def test_a_token_changed_added_or_removed():
    changed = PRED[:10] + [7] + PRED[11:]
    added = PRED[:10] + [7, 8, 9] + PRED[10:]
    removed = PRED[:10] + PRED[14:]
    block = PRED[:10] + [1, 2, 3, 4, 5, 6] + PRED[13:]  # three replaced by six
    for answer, want in ((changed, 39), (added, 40), (removed, 36), (block, 37)):
        p = follow(PRED, answer)
        assert p.accepted == want == lcs(PRED, answer), answer
        assert p.accepted + p.rejected == len(PRED)


def test_a_far_jump_needs_more_agreeing_tokens():
    """Two tokens 60 on in the prediction are no evidence enough to skip what lies between
    (they may occur again; the answer may come back): three are."""
    two = follow(PRED, [1, 2] + PRED[30:32] + [3, 4])
    assert two.accepted == 0 and two.pos == 0
    three = follow(PRED, [1, 2] + PRED[30:33] + [3, 4])
    assert three.accepted == 3 and three.pos == 33
    near = follow(PRED, [1, 2] + PRED[5:7] + [3, 4])  # near: two will do
    assert near.accepted == 2 and near.pos == 7


def test_the_next_occurrence_is_taken_never_one_before_where_the_answer_is():
    pred = [1, 2, 3, 4, 5, 1, 2, 6, 7, 8, 1, 2, 9]
    p = follow(pred, [1, 2, 3, 50, 51, 1, 2])
    assert p.accepted == 5 and p.pos == 7  # the "1 2" at 5, not the one at 0 (counted)
    for t in (1, 2, 9):  # three left out: the next "1 2", then on from there
        p.add(t)
    assert p.accepted == 8 and p.pos == 13 == len(pred) and p.rejected == 5


def test_the_draft_is_what_follows_while_the_answer_is_in_step():
    p = Prediction(PRED)
    assert p.in_step and p.draft(4) == PRED[:4]  # the answer's start is the prediction's
    for t in PRED[:6]:
        p.add(t)
    assert p.draft(3) == PRED[6:9]
    p.add(7)  # off it
    assert not p.in_step and p.draft(3) == []
    p.add(PRED[6])  # a token added: the prediction's next one comes right after it
    assert p.in_step and p.draft(2) == PRED[7:9]
    p.add(8)
    p.add(PRED[10])
    assert p.draft(2) == []  # one token is no evidence (the one skipped was changed?)
    p.add(PRED[11])
    assert p.in_step and p.draft(2) == PRED[12:14] and p.accepted == 9
    word = follow(PRED, PRED[:5] + [1, 2] + PRED[7:8])  # two changed for two: on at once
    assert word.in_step and word.accepted == 6 and word.draft(2) == PRED[8:10]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 6), max_size=40), st.lists(st.integers(0, 6), max_size=40))
def test_never_more_than_the_longest_common_subsequence(pred, answer):
    """Few distinct tokens: n-grams recur everywhere, the hardest case for finding the
    prediction again; the count is still an alignment (never above the LCS) and the two counts
    add up to the prediction."""
    p = follow(pred, answer)
    assert 0 <= p.accepted <= lcs(pred, answer)
    assert p.accepted + p.rejected == len(pred)
    assert 0 <= p.pos <= len(pred)


@st.composite
def edited(draw):
    """A prediction of distinct tokens and an answer made of it by edits of up to five tokens
    (changed, added or removed), each followed by at least two untouched tokens."""
    n = draw(st.integers(4, 80))
    pred = list(range(1000, 1000 + n))
    answer, i, fresh = [], 0, iter(range(5000, 6000))
    while i < n:
        keep = draw(st.integers(2, 12))
        answer += pred[i:i + keep]
        i += keep
        op, k = draw(st.sampled_from(["change", "add", "remove"])), draw(st.integers(1, 5))
        if i + (k if op != "add" else 0) + 2 > n:
            answer += pred[i:]
            break
        if op != "add":
            i += k
        if op != "remove":
            answer += [next(fresh) for _ in range(k)]
    return pred, answer


@settings(max_examples=200, deadline=None)
@given(edited())
def test_separated_edits_count_exactly_the_longest_common_subsequence(case):
    pred, answer = case
    p = follow(pred, answer)
    assert p.accepted == lcs(pred, answer)
