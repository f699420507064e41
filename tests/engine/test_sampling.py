"""Stop strings and the streaming hold-back; sampling filters and log-probabilities."""

import mlx.core as mx

from mlx_kvserver.chat.conversation import Sampling
from mlx_kvserver.engine.sampling import Sampler, StopMatcher, token_logprob


def test_stop_matcher_finds_earliest_stop():
    m = StopMatcher(["END", "##"])
    assert m.find("abc ## def END", 0) == 4
    assert m.find("no stops here", 0) == -1
    assert m.find("xxEND", 3) == 2  # searches back far enough to catch a stop across chunks


def test_stop_matcher_holds_back_possible_prefix():
    m = StopMatcher(["END"])
    assert m.safe_end("hello EN") == len("hello ")
    assert m.safe_end("hello E") == len("hello ")
    assert m.safe_end("hello") == len("hello")
    assert StopMatcher([]).safe_end("abc") == 3


def test_stop_matcher_says_which_stop_matched():
    assert StopMatcher(["END", "##"]).match("abc ## END", 0) == (4, "##")
    assert StopMatcher(["END"]).match("nothing", 0) is None


def test_top_k_at_or_past_the_vocabulary_keeps_every_token():
    logits = mx.array([0.0, 1.0, 2.0, 3.0])
    for k in (4, 5, 10**6):  # mlx-lm's filter refuses k >= vocabulary; that means "all"
        s = Sampler(Sampling(temperature=1.0, top_k=k, seed=1))
        assert 0 <= s(logits).item() < 4


def test_top_k_one_is_greedy_whatever_the_temperature():
    logits = mx.array([0.0, 5.0, 1.0, 4.9])
    s = Sampler(Sampling(temperature=2.0, top_k=1, seed=3))
    assert {s(logits).item() for _ in range(20)} == {1}


def test_token_logprob_matches_log_softmax_and_sorts_alternatives():
    logits = mx.array([1.0, 3.0, 2.0, 0.5])
    lp = token_logprob(logits, 2, 3, lambda ids: f"<{ids[0]}>")
    want = (logits - mx.logsumexp(logits)).tolist()
    assert lp.token == "<2>" and lp.id == 2 and abs(lp.logprob - want[2]) < 1e-6
    assert [a[1] for a in lp.top] == [1, 2, 0]
    assert all(abs(a[2] - want[a[1]]) < 1e-6 for a in lp.top)
