"""Stop strings and the streaming hold-back; sampling filters and log-probabilities."""

import mlx.core as mx
import numpy as np
import pytest

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


# -- Sampler.verify: speculation leaves the distribution that of plain sampling -----------------

Z_1E4 = 3.719  # the standard normal's upper 1e-4 quantile


def chi2_limit(df: int, z: float = Z_1E4) -> float:
    """The chi-square quantile at ``z`` (Wilson-Hilferty; close to exact from a few df on)."""
    a = 2 / (9 * df)
    return df * (1 - a + z * a ** 0.5) ** 3


def plain_p(s: Sampler, logits: mx.array) -> np.ndarray:
    """The distribution plain sampling draws from (``Sampler.__call__``: the filtered
    log-probabilities at the temperature)."""
    return np.asarray(mx.softmax(s._logprobs(logits) / s.temperature), np.float64)


def chi2(counts: np.ndarray, p: np.ndarray, n: int) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 20 times each, the rest pooled."""
    expected = p * n
    order = np.argsort(-expected)
    big = [i for i in order if expected[i] >= 20]
    rest = [i for i in order if expected[i] < 20 and p[i] > 0]
    e = [expected[i] for i in big] + ([expected[rest].sum()] if rest else [])
    o = [counts[i] for i in big] + ([counts[rest].sum()] if rest else [])
    if e[-1] < 20 and len(e) > 1:  # a small pooled bin joins the last one
        e[-2:], o[-2:] = [e[-2] + e[-1]], [o[-2] + o[-1]]
    e, o = np.array(e), np.array(o, np.float64)
    return float(((o - e) ** 2 / e).sum()), len(e) - 1


def tiny_model_logits() -> mx.array:
    from harness.tiny_model import make_tiny_model, make_tiny_tokenizer

    ids = make_tiny_tokenizer().encode("Tell me about the sea and the mountains").ids
    return make_tiny_model(0)(mx.array(ids)[None])[0, -1]


ROWS = {"tiny model": tiny_model_logits, "skewed": lambda: mx.arange(64) * -0.35}
FILTERS = {"no filters": {}, "top_p 0.85 top_k 8": {"top_p": 0.85, "top_k": 8}}


@pytest.mark.parametrize("row", ROWS)
def test_verify_draws_from_the_plain_sampling_distribution(row):
    """A draft token ``x`` kept with probability ``p(x)``, else a token drawn from ``p`` without
    ``x``: the token that comes out is distributed as plain sampling's ``p`` (temperature,
    top-p and top-k applied), for a likely draft, an unlikely one and one the filters remove
    (never returned). Chi-square at 1e-4 over fixed seeds: deterministic, and a broken rule
    (``x`` left in the rest, ``p`` without temperature or filters) fails it by far."""
    logits = ROWS[row]()
    failures = []
    for t in (0.7, 1.0):
        for name, kw in FILTERS.items():
            probe = Sampler(Sampling(temperature=t, seed=0, **kw))
            p = plain_p(probe, logits)
            support = np.flatnonzero(p > 0)
            drafts = {"likely": int(np.argmax(p)),
                      "unlikely": int(support[np.argmin(np.abs(p[support] - 0.02))])}
            if kw:
                drafts["filtered out"] = int(np.flatnonzero(p == 0)[0])
            for kind, x in drafts.items():
                n = 400 if kind == "filtered out" else 1200
                s = Sampler(Sampling(temperature=t, seed=1000 + x, **kw))
                counts = np.bincount([s.verify(logits, x) for _ in range(n)],
                                     minlength=p.size)
                stat, df = chi2(counts, p, n)
                where = f"{row}, T={t}, {name}, {kind} draft (p={p[x]:.3f})"
                if counts[p == 0].any():
                    failures.append(f"{where}: drew tokens plain sampling never draws")
                if stat > chi2_limit(df):
                    failures.append(f"{where}: chi2 {stat:.1f} > {chi2_limit(df):.1f} (df {df})")
    assert not failures, "\n".join(failures)


def test_verify_is_greedy_at_temperature_zero():
    logits = mx.array([0.0, 5.0, 1.0, 4.9])
    s = Sampler(Sampling(temperature=0.0))
    assert s.verify(logits, 1) == 1 and s.verify(logits, 3) == 1


# -- seeded requests with speculation on --------------------------------------------------------

SEEDED = {"messages": [{"role": "user", "content": "Tell me about the sea and the sea."}],
          "max_tokens": 30, "temperature": 0.7, "seed": 9}


def seeded_answer(lm, s, prediction: list[int] = ()) -> tuple[str, int, list[int]]:
    """(answer, draft tokens verified, token ids) of the seeded request on scheduler ``s``, with
    ``prediction`` as its prediction's token ids."""
    from mlx_kvserver.chat.output import Usage
    from tests.engine.test_scheduler import Collect, step

    job = Collect(SEEDED, lm)
    s.add(job)
    r = s.requests[-1]
    r.prediction = list(prediction)
    while s.busy:
        step(s)
    u = next(e for e in job.log if isinstance(e, Usage))
    return job.answers()[0][0], u.draft_accepted + u.draft_rejected, r.choices[0].tokens


def test_a_seeded_request_repeats_its_answer_on_a_fresh_server(tiny_lm):
    """Its prediction is its answer without speculation: the first token (sampled after the
    prompt) agrees, so drafts are verified from the first decode step."""
    from tests.engine.test_scheduler import scheduler

    _, _, ids = seeded_answer(tiny_lm, scheduler(tiny_lm, speculate="off"))
    runs = [seeded_answer(tiny_lm, scheduler(tiny_lm, speculate="ngram"), ids)
            for _ in range(2)]
    # the answer and its tokens repeat; how many drafts were verified follows the width the
    # pass costs measured under the machine's load chose, so it may differ between the runs
    assert runs[0][0] == runs[1][0] and runs[0][2] == runs[1][2]
    assert all(verified > 0 for _, verified, _ in runs)


def test_a_seeded_request_repeats_its_answer_on_a_server_that_saw_it(tiny_lm):
    """Which positions come with a draft depends on what the server holds (the shared index of
    saved answers); a seeded answer must not: verification draws each token with the key plain
    sampling would use."""
    from tests.engine.test_scheduler import scheduler

    off, _, ids = seeded_answer(tiny_lm, scheduler(tiny_lm, speculate="off"))
    s = scheduler(tiny_lm, speculate="ngram")
    runs = [seeded_answer(tiny_lm, s, ids) for _ in range(3)]
    assert all(verified > 0 for _, verified, _ in runs)
    assert runs[0][0] == runs[1][0] == runs[2][0] == off  # the answer without drafts, too
