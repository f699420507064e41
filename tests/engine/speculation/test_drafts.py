"""Draft sources for speculative decoding (engine/speculation/drafts.py), without a model.

``NgramIndex`` is checked against a brute-force search for the latest earlier occurrence of a
suffix, built in steps of one token and in bulk (the numpy path); ``SharedIndex`` on saved
sequences and its bound; ``Drafter`` on the source it picks (the one the answer follows, else
the one that agrees with more of the answer) and its adaptive draft length.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from mlx_kvserver.engine.speculation.drafts import Drafter, NgramIndex, SharedIndex, _key

BIG = (1 << 20) - 1  # the largest token id a key packs


def latest(tokens: list[int], end: int, ns: tuple[int, ...]) -> tuple[int, int] | None:
    """Brute force: (position after the latest occurrence, ending before ``end``, of the
    n-gram of ``tokens`` that ends at ``end``, n) for the longest n in ``ns`` that occurs."""
    for n in sorted(ns, reverse=True):
        if end < n:
            continue
        gram = tokens[end - n:end]
        for e in range(end - 1, n - 1, -1):
            if tokens[e - n:e] == gram:
                return e, n
    return None


def brute_map(tokens: list[int], upto: int, ns: tuple[int, ...]) -> dict[int, int]:
    out: dict[int, int] = {}
    for e in range(1, upto + 1):
        for n in ns:
            if e >= n:
                out[_key(tokens[e - n:e])] = e
    return out


tokens_st = st.lists(st.one_of(st.integers(0, 4), st.sampled_from([BIG, BIG - 1, 1 << 19])),
                     min_size=0, max_size=60)
ns_st = st.sampled_from([(3, 2), (3, 2, 1), (1,), (2,), (3,), (2, 1)])


@settings(max_examples=150)
@given(tokens_st, ns_st, st.lists(st.integers(1, 20), max_size=12))
def test_ngram_index_equals_brute_force_in_steps_and_in_bulk(tokens, ns, cuts):
    """The index extended one token at a time, in random chunks (small ones loop, long ones go
    through numpy) and at once holds every n-gram's latest occurrence; a lookup at every end
    (with the index up to the token before it, as the drafter keeps it) finds the brute-force
    answer, never the suffix itself."""
    one, chunks, bulk = NgramIndex(ns), NgramIndex(ns), NgramIndex(ns)
    bulk.extend(tokens, len(tokens))
    at = 0
    for c in cuts:
        at = min(len(tokens), at + c)
        chunks.extend(tokens, at)
    chunks.extend(tokens, len(tokens))
    for end in range(len(tokens) + 1):
        one.extend(tokens, end - 1)
        hit = one.lookup(tokens, end)
        assert hit == latest(tokens, end, ns), (end, hit)
        if hit is not None:
            assert hit[0] < end and tokens[hit[0] - hit[1]:hit[0]] == tokens[end - hit[1]:end]
    one.extend(tokens, len(tokens))
    want = brute_map(tokens, len(tokens), ns)
    assert one.map == chunks.map == bulk.map == want
    assert one.upto == bulk.upto == len(tokens)


@given(tokens_st, ns_st)
def test_a_lookup_never_returns_the_suffix_itself_even_when_it_is_indexed(tokens, ns):
    idx = NgramIndex(ns)
    idx.extend(tokens, len(tokens))
    for end in range(len(tokens) + 1):
        hit = idx.lookup(tokens, end)
        assert hit is None or hit[0] < end
        # over another list (own=False) the position is the other list's, whatever it is
        other = idx.lookup(tokens, end, own=False)
        if other is not None:
            assert tokens[other[0] - other[1]:other[0]] == tokens[end - other[1]:end]


def test_ngram_index_prefers_the_longest_n_and_the_latest_occurrence():
    t = [7, 1, 2, 3, 9, 5, 2, 3, 8, 6, 1, 2, 3]
    idx = NgramIndex((3, 2))
    idx.extend(t, len(t) - 1)
    assert idx.lookup(t, len(t)) == (4, 3)  # "1 2 3" after position 4, not "2 3" at 8
    idx = NgramIndex((2,))
    idx.extend(t, len(t) - 1)
    assert idx.lookup(t, len(t)) == (8, 2)  # the latest "2 3"
    idx.extend(t, len(t) - 1)  # extending to where it is already is a no-op
    assert idx.upto == len(t) - 1


# -- SharedIndex --------------------------------------------------------------------------------


def test_shared_index_drafts_the_continuation_of_a_saved_sequence():
    s = SharedIndex()
    s.add(list(range(100, 120)))
    ctx = [5, 102, 103, 104, 105, 106]
    assert s.draft(ctx, len(ctx), 4) == [107, 108, 109, 110]
    assert s.draft(ctx, len(ctx), 40) == list(range(107, 120))  # up to the source's end
    assert s.draft(ctx, 5, 2) == [106, 107]  # at another end of the context
    assert s.draft(ctx, 3, 4) == []  # fewer than four tokens: no lookup
    s.add([1, 2, 3])  # fewer than 8 tokens: not a source
    assert len(s.sources) == 1


def test_shared_index_checks_the_fourth_token():
    s = SharedIndex()
    s.add([50, 51, 1, 2, 3, 60, 61, 62, 63, 64])
    assert s.draft([51, 1, 2, 3], 4, 3) == [60, 61, 62]
    assert s.draft([99, 1, 2, 3], 4, 3) == []  # same 3-gram, another token before it


def test_shared_index_has_no_fourth_token_before_a_source_start():
    """A 3-gram at the very start of a source has no token before it: no draft (not a
    comparison with the source's last token, which ``src[-1]`` would be)."""
    s = SharedIndex()
    s.add([1, 2, 3, 60, 61, 62, 63, 64, 65, 9])
    assert s.draft([9, 1, 2, 3], 4, 3) == []


def test_shared_index_drops_the_oldest_sources_and_their_keys():
    s = SharedIndex(max_tokens=30)
    a = list(range(1000, 1012))  # 12 tokens each
    b = list(range(2000, 2012))
    c = list(range(3000, 3009)) + [1000, 1001, 1002]  # ends with a's first 3-gram
    s.add(a)
    s.add(b)
    assert s.tokens == 24 and len(s.sources) == 2
    s.add(c)  # 36 > 30: a goes
    assert list(s.sources) == [1, 2] and s.tokens == 24
    assert all(v >> 32 in s.sources for v in s.map.values())  # no key of a is left
    assert len(s.map) == 2 * 10  # each source's 3-grams
    assert s.draft([7, 1003, 1004, 1005], 4, 3) == []  # a's continuation is gone
    assert s.draft([2002, 2003, 2004, 2005], 4, 2) == [2006, 2007]
    s.add(list(range(4000, 4040)))  # longer than the bound: its last 30, alone
    assert list(s.sources) == [3] and s.sources[3] == list(range(4010, 4040))
    assert s.tokens == 30 and len(s.map) == 28


def test_shared_index_keeps_a_newer_sources_key_when_an_older_one_goes():
    s = SharedIndex(max_tokens=20)
    s.add([1, 2, 3, 4, 10, 11, 12, 13, 14, 15])
    s.add([0, 1, 2, 3, 4, 20, 21, 22, 23, 24])  # "2 3 4" now points here
    s.add(list(range(500, 510)))  # the first source goes
    assert 0 not in s.sources
    assert s.draft([1, 2, 3, 4], 4, 2) == [20, 21]


# -- Drafter ------------------------------------------------------------------------------------

PROMPT = [90, 91, 92, 93, 94]


def test_a_prediction_is_followed_from_its_start():
    pred = list(range(10, 30))
    ctx = list(PROMPT)
    d = Drafter(ctx, 8, pred)
    assert d.propose(100) == pred[:4] and d.source == "prediction"
    ctx += pred[:4]
    d.taken(4, 4)
    assert d.propose(100) == pred[4:12]  # the length doubled, to max_len
    ctx += pred[4:12]
    assert d.propose(3) == pred[12:15]  # never more than the room


def test_a_prediction_is_found_again_after_the_answer_leaves_it():
    pred = list(range(10, 30))
    ctx = list(PROMPT) + [10, 11, 12, 77, 14, 15]  # one token differs
    d = Drafter(ctx, 8, pred, start=len(PROMPT))
    assert d.propose(100) == [16, 17, 18, 19] and d.source == "prediction"
    ctx += [40, 41]  # somewhere the prediction never was: nothing from it
    assert d.propose(100) == []
    ctx += [23]  # one token of it: no evidence enough
    assert d.propose(100) == []
    ctx += [24]  # two: back on it
    assert d.propose(100) == [25, 26, 27, 28] and d.source == "prediction"


def test_own_context_then_the_shared_index_when_nothing_else_matches():
    shared = SharedIndex()
    shared.add([60, 61, 62, 63, 64, 65, 66, 67, 68])
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4]
    d = Drafter(ctx, 8, shared=shared)
    assert d.propose(100) == [5, 6, 7, 8] and d.source == "context"
    assert d.propose(2) == [5, 6]
    ctx += [61, 62, 63, 64]  # only the shared source has it
    assert d.propose(100) == [65, 66, 67, 68] and d.source == "cache"
    ctx += [70, 71, 72]  # no source
    assert d.propose(100) == []
    both = Drafter([60, 61, 62, 63, 1, 2, 3, 4, 9, 60, 61, 62, 63], 8, shared=shared)
    assert both.propose(100) == [1, 2, 3, 4] and both.source == "context"  # own context first


def test_a_predictions_start_comes_before_a_shorter_match_in_the_context():
    ctx = [1, 2, 3, 4, 5, 1, 2, 3]
    d = Drafter(ctx, 8, prediction=[50, 51, 52], start=len(ctx))
    assert d.propose(100) == [50, 51, 52] and d.source == "prediction"
    d2 = Drafter([1, 2, 3, 4, 5, 1, 2, 3], 8, prediction=[50, 51, 52])
    d2.context.append(99)  # off the prediction, no n-gram of it: the context's lookup
    d2.context += [1, 2]
    assert d2.propose(100) == [3, 99, 1, 2] and d2.source == "context"  # latest "1 2"


def test_a_saved_sequence_that_agrees_with_more_drafts_before_the_prediction():
    """A regenerated answer: the cache holds the same prompt and the answer's exact token ids,
    which agree with everything before the answer; the prediction (the answer's text, here
    tokenized otherwise from its third token) only with where the answer starts."""
    prompt = list(range(60, 80))
    answer = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    shared = SharedIndex()
    shared.add(prompt + answer)
    pred = [10, 11, 99, 13, 14, 15, 16, 17, 18, 19]
    ctx = list(prompt)
    d = Drafter(ctx, 8, pred, shared=shared)
    d.length = 8
    assert d.propose(100) == answer[:8] and d.source == "cache"
    alone = Drafter(list(prompt), 8, pred)  # no saved sequence: the prediction's start
    assert alone.propose(4) == pred[:4] and alone.source == "prediction"


def test_a_copy_the_answer_follows_is_not_left_for_the_prediction():
    """The answer copies a line of its prompt; the prediction holds that line's last tokens too
    (elsewhere): the copy goes on while the answer follows it."""
    line = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]
    ctx = [1, 2] + line + [3, 4]
    pred = [40, 41, 21, 22, 42, 43, 44, 45]
    d = Drafter(ctx, 8, pred, start=len(ctx))
    ctx += [20, 21]  # the prediction's start was not the answer's; the line's was
    assert d.propose(100) == line[2:6] and d.source == "context"
    ctx += [22]  # "21 22": the prediction's tokens too, where it would go on with 42
    d.taken(4, 1)
    assert d.propose(100) == line[3:5] and d.source == "context"
    assert d.prediction.in_step and d.prediction.draft(2) == [42, 43]  # (not taken)


def test_after_a_change_the_source_that_agrees_with_more_drafts():
    """The answer leaves the copy it followed; the prediction and the context both have its
    last tokens: the one whose tokens before them agree with more of the answer drafts."""
    pred = [10, 11, 12, 13, 14, 15, 16, 17, 18, 19]
    ctx = [5, 6, 14, 15, 70, 71, 72]  # "14 15" in the context, after other tokens
    d = Drafter(ctx, 8, pred, start=len(ctx))
    ctx += [10, 11, 12, 13, 77, 14, 15]  # a token changed, then the prediction again
    assert d.propose(100) == [16, 17, 18, 19] and d.source == "prediction"
    ctx2 = [5, 13, 77, 14, 15, 70, 71, 72]  # the context agrees with "13 77 14 15"
    d2 = Drafter(ctx2, 8, pred, start=len(ctx2))
    ctx2 += [10, 11, 12, 13, 77, 14, 15]
    assert d2.propose(100) == [70, 71, 72, 10] and d2.source == "context"


def test_the_draft_length_grows_shrinks_and_pauses_with_a_growing_backoff():
    ctx = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 1, 2, 3]
    d = Drafter(ctx, 8)
    assert d.length == 4
    d.taken(4, 4)
    assert d.length == 8
    d.taken(8, 8)
    assert d.length == 8  # capped at max_len
    d.taken(8, 3)
    assert d.length == 4  # what was taken, and one more
    d.taken(4, 0)
    assert d.length == 2
    d.taken(0, 0)  # no draft: nothing changes
    assert d.length == 2 and d.misses == 1
    d.taken(2, 0)
    assert d.length == 1 and d.pause == 0
    d.taken(1, 0)  # the third miss in a row: pause 4 steps
    assert d.pause == 4 and d.backoff == 8
    assert [d.propose(100) for _ in range(4)] == [[]] * 4
    assert d.propose(100) == [4]  # drafting again, one token
    for _ in range(3):
        d.taken(1, 0)
    assert d.pause == 8 and d.backoff == 16  # longer each time
    for _ in range(8):
        assert d.propose(100) == []
    assert d.propose(100) == [4]
    d.taken(1, 1)  # a success resets the count and the backoff
    assert d.misses == 0 and d.backoff == 4 and d.length == 2
    for _ in range(2):
        d.taken(2, 0)
    d.taken(1, 1)
    assert d.misses == 0 and d.pause == 0
    for _ in range(40):
        d.taken(1, 0)
    assert d.backoff == 256  # capped


@given(st.integers(0, 12), st.integers(1, 16), st.lists(st.integers(0, 3), min_size=4,
                                                         max_size=40))
def test_a_draft_is_never_longer_than_the_room_or_max_len(room, max_len, tokens):
    pred = tokens[::-1]
    for d in (Drafter(list(tokens), max_len), Drafter(list(tokens), max_len, pred),
              Drafter(list(tokens), max_len, pred, start=len(tokens) // 2)):
        d.length = max_len
        assert len(d.propose(room)) <= min(room, max_len)


def test_a_copy_that_reaches_the_end_of_the_answer_repeats_its_period():
    ctx = [7, 1, 0, 0, 0, 0]  # a run of one token: "0 0 0" last ended one token back
    d = Drafter(ctx, 8, start=2)
    assert d.propose(100) == [0, 0, 0, 0] and d.source == "context"
    ctx += [0, 0, 0, 0, 0]
    d.taken(4, 4)
    assert d.propose(100) == [0] * 8  # the whole length, not one token
    assert d.propose(3) == [0] * 3
    loop = [5, 6, 7, 8, 9, 5, 6, 7]  # a phrase of five the answer loops on
    d2 = Drafter(list(loop), 8)
    d2.length = 8
    assert d2.propose(100) == [8, 9, 5, 6, 7, 8, 9, 5]
    far = [5, 6, 7, 8, 9, 1, 2, 3, 4, 10, 11, 12, 13, 5, 6, 7]  # the period is longer than k
    d3 = Drafter(far, 4)
    assert d3.propose(100) == [8, 9, 1, 2]
