"""How wide a verify pass is (engine/speculation/speculate.py ``Speculation._width``,
engine/speculation/pass_cost.py ``PassCost``): the width that gives the most tokens per second, by
each answer's recent acceptance and what wider passes cost on this machine against a plain step; 1
(a plain decode step) where drafts would not pay, with a wide pass tried again now and then."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from mlx_kvserver.engine.speculation.drafts import Drafter
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.engine.runner import Runner
from mlx_kvserver.engine.speculation.speculate import Speculation


def choice(rate: float, source: str = "context"):
    d = Drafter([1, 2, 3], max_len=8)
    d.hits, d.fails = rate * 10, (1 - rate) * 10
    return SimpleNamespace(drafter=d, draft_source=source)


def on_a_line(ratio: float):
    """A machine where a pass costs ``fixed * (1 + ratio * rows)`` whatever its width."""
    return lambda seqs, rows: (1 + ratio * rows) / (1 + ratio * seqs)


def spec(ratio: float) -> Speculation:
    s = Speculation(runner=None, mode="ngram", max_draft=8)
    s.cost.relative = on_a_line(ratio)
    s.cost.probe_due = lambda seqs, declined: False
    return s


def prior(seqs: int, rows: int) -> float:
    return on_a_line(PassCost.PRIOR)(seqs, rows)


def test_the_fit_of_what_rows_cost():
    c = PassCost()
    assert c.relative(8, 32) == pytest.approx(prior(8, 32))  # nothing measured yet
    assert c.relative(8, 8) == 1.0
    for w in (1, 2, 3, 5, 9) * 2:  # the default model on this CPU, 8 x 2,500 tokens of context
        c.add(8, 8 * w, 0.510 + 0.021 * 8 * w)
        c.add(1, w, 0.115 + 0.021 * w)
    # the line recovered (within the little that the slope's prior still weighs: 2%)
    assert c.relative(8, 40) == pytest.approx(on_a_line(0.021 / 0.510)(8, 40), rel=0.03)
    assert c.relative(1, 5) == pytest.approx(on_a_line(0.021 / 0.115)(1, 5), rel=0.03)  # its own
    assert c.relative(4, 20) == pytest.approx(prior(4, 20))  # no passes of 4 yet
    c = PassCost()
    for _ in range(10):
        c.add(8, 8, 0.1)
    assert c.relative(8, 24) == pytest.approx(prior(8, 24))  # plain steps only: the prior
    c = PassCost()
    for rows in (1, 2, 3, 4) * 3:
        c.add(1, rows, 0.01 * rows)  # no fixed part at all
    assert c.relative(1, 4) > 3.5  # rows are nearly all a pass costs


def test_passes_whose_rows_spread_little_do_not_set_a_steep_slope():
    """Eight answers' first verify passes, all of 16 or 18 rows, measured with the spread of a
    real machine (an 8-client ``rewrite`` row: a line through them alone says 32 ms a row,
    three times the ~10 of passes 8-32 rows wide). Fitted alone, such a line priced a pass of
    48 rows at 6.6 plain steps, and five answers whose drafts were taken 99% of the time were
    declined for the rest of their answers; the slope drawn toward the prior, they verify."""
    c = PassCost()
    for s in (0.243, 0.234, 0.315, 0.284, 0.239, 0.228, 0.232, 0.223, 0.224, 0.237):
        c.add(8, 8, s)
    for rows, s in ((16, 0.301), (16, 0.311), (18, 0.370), (18, 0.352), (16, 0.281)):
        c.add(8, rows, s)
    assert c.relative(8, 48) < 4.0
    sp = Speculation(runner=None, mode="ngram", max_draft=8)
    sp.cost = c
    group = [choice(r) for r in (0.99, 0.44, 0.16, 0.87, 0.84, 0.99, 0.89, 0.05)]
    assert sp._width(group, [[1] * n for n in (8, 0, 0, 8, 8, 8, 8, 0)]) > 2


# An 8-client `rewrite` row's passes of all eight answers (rows, seconds), from its server's log
EIGHT = [(14, .310), (8, .215), (8, .183), (8, .179), (8, .186), (8, .189), (8, .209), (27, .404),
         (25, .415), (31, .461), (8, .220), (20, .354), (23, .408), (26, .369), (22, .316),
         (26, .350), (27, .351), (32, .366), (32, .370), (29, .361), (33, .379), (32, .397)]


def test_one_slow_pass_of_a_batch_seldom_run_wide_does_not_price_out_its_drafts():
    """Later in that row, three answers left: plain steps of three ~105 ms and four verify
    passes, one of them 434 ms (the machine busy for a moment) among three of ~130. A line
    through those four alone said 33 ms a row, and the three answers, drafts taken 69-98% of
    the time, verified one token a pass or none for 34 passes. The slope is every batch size's
    (~3 ms a row here, the eight answers' passes) and robust to the one slow pass."""
    c = PassCost()
    for rows, s in EIGHT:
        c.add(8, rows, s)
    for s in (.104, .105, .107, .106):
        c.add(3, 3, s)
    for rows, s in ((5, .135), (9, .434), (4, .117), (8, .136)):
        c.add(3, rows, s)
    assert c.relative(3, 27) < 4.0
    sp = Speculation(runner=None, mode="ngram", max_draft=8)
    sp.cost = c
    sp.cost.probe_due = lambda seqs, declined: False
    assert sp._width([choice(r) for r in (0.69, 0.77, 0.98)], [[1] * 8] * 3) >= 5


def test_one_slow_pass_among_many_does_not_move_the_slope():
    c = PassCost()
    for rows, s in EIGHT:
        c.add(8, rows, s)
    before = c.relative(8, 48)
    c.add(8, 40, 1.6)  # four times what a pass of 40 rows costs
    assert c.relative(8, 48) == pytest.approx(before, rel=0.05)


def test_a_wide_pass_that_costs_several_plain_steps_whatever_its_rows():
    """A GPU: a plain step ~5.5 ms, any pass of two rows or more ~43 ms (the default model alone
    on an H100: runs of benchmarks/speculation.py, in docs/BENCHMARKS.md's git history). The old
    single line through all passes saw verify passes of one width only and kept the prior: every
    draft was verified, at 0.26x."""
    c = PassCost()
    for _ in range(20):
        c.add(1, 1, 0.0055)
    for _ in range(5):
        c.add(1, 9, 0.043)
    assert c.relative(1, 9) == pytest.approx(0.043 / 0.0055, rel=0.02)
    assert c.relative(1, 2) > 5  # the fixed part of a wide pass is most of it
    s = Speculation(runner=None, mode="ngram", max_draft=8)
    s.cost = c
    assert s._width([choice(0.84)], [[1] * 8]) == 1  # ~4.4 tokens a pass do not pay 7.8 steps
    cheap = PassCost()
    for rows in (1, 1, 1, 1, 5, 9, 5, 9):
        cheap.add(1, rows, 0.0055 + 0.0002 * rows)  # a wide pass costing about a step
    s.cost = cheap
    assert s._width([choice(0.84)], [[1] * 8]) > 4


# What passes cost, measured (seconds): per batch size, a plain step and wide passes by rows.
# H100 (runs of benchmarks/speculation.py there, in docs/BENCHMARKS.md's git history): one answer's
# plain step ~4-5.5 ms and a verify pass ~40-45 ms however few its rows (~8x); eight answers'
# plain step ~105 ms and a verify pass ~220 ms. CPU: an earlier run of benchmarks/pass_width.py
# (the same history), a document each
# (one sequence: 176.8 ms plain, 216.7 / 287.7 / 428.9 ms 2 / 4 / 9 wide; eight: 1004.6 ms
# plain, 1224.7 / 1495.4 / 2481.5 ms)
PROFILES = {
    "H100": {1: (0.0055, {2: 0.041, 5: 0.043, 9: 0.045}),
             8: (0.105, {16: 0.215, 32: 0.220, 48: 0.222, 72: 0.226})},
    "CPU": {1: (0.1768, {2: 0.2167, 4: 0.2877, 9: 0.4289}),
            8: (1.0046, {16: 1.2247, 32: 1.4954, 72: 2.4815})},
}


@pytest.mark.parametrize("profile,answers,verifies", [
    ("H100", 1, False),  # ~4.4 tokens a pass do not pay ~8 steps: plain steps
    ("H100", 8, True),  # eight drafts' ~35 tokens for ~2 steps
    ("CPU", 1, True),
    ("CPU", 8, True)])
def test_the_width_on_a_gpus_and_a_cpus_measured_costs(profile, answers, verifies):
    """The chooser fed what a GPU's and a CPU's passes cost, as ``verify`` and ``decoded`` feed
    it (``PassCost.add``), with drafts taken 84% of the time (the H100's `edit` rows): one
    answer alone decodes plainly where every wide pass costs ~8 plain steps and verifies where
    wide passes cost about what their rows do; eight answers verify on both. A draft that is
    seldom right (free text) is not verified anywhere."""
    plain, wide = PROFILES[profile][answers]
    cost = PassCost()
    for _ in range(4):
        cost.add(answers, answers, plain)
        for rows, seconds in wide.items():
            cost.add(answers, rows, seconds)
    cost.probe_due = lambda seqs, declined: False
    assert cost.relative(answers, max(wide)) == pytest.approx(wide[max(wide)] / plain, rel=0.1)
    s = Speculation(runner=None, mode="ngram", max_draft=8)
    s.cost = cost
    width = s._width([choice(0.84) for _ in range(answers)], [[1] * 8] * answers)
    assert (width > 1) == verifies, width
    assert s._width([choice(0.05) for _ in range(answers)], [[1] * 8] * answers) == 1


def test_plain_steps_do_not_push_the_wide_passes_out():
    c = PassCost()
    for rows in (9, 5, 9, 5):
        c.add(1, rows, 0.04)
    assert c.relative(1, 9) < 2  # no plain step yet: the line's own one-row cost
    for _ in range(10 * PassCost.WINDOW):
        c.add(1, 1, 0.005)
    assert c.relative(1, 9) == pytest.approx(8.0, rel=0.05)  # not the prior (~1.4)


def test_a_declined_width_is_tried_again_ever_more_rarely():
    """Where no width pays, a probe after 16 declined steps, then after 32, 64, ...; a step that
    chooses a wide pass on its merit starts the count again."""
    s = Speculation(runner=None, mode="ngram", max_draft=8)
    for _ in range(8):
        s.cost.add(1, 1, 0.005)
        s.cost.add(1, 9, 0.04)
    widths = [s._width([choice(0.84)], [[1] * 8]) for _ in range(200)]
    probes = [i + 1 for i, w in enumerate(widths) if w > 1]
    assert probes == [16, 48, 112]
    assert s.cost.probe_due(1, declined=False) is False  # a wide pass chosen on merit
    assert [s.cost.probe_due(1, declined=True) for _ in range(16)][-1] is True


def test_a_pass_is_costed_at_the_rows_it_will_have():
    """Half the answers without a draft: a ragged pass gives each of them one row, not the
    width's (seen: eight `rewrite` clients where a width of 2 was costed at 16 rows for a pass
    of 12, and 9 passes were verified in 117 steps, 0.84x; an earlier run of
    benchmarks/speculation.py, in docs/BENCHMARKS.md's git history).
    Passes that cannot go ragged are costed padded, as they run."""
    c = PassCost()
    for _ in range(8):
        c.add(8, 8, 0.3)
    for rows in (12, 16, 20, 24) * 2:
        c.add(8, rows, 0.1 + 0.025 * rows)  # a row costs a twelfth of a plain step of eight
    group = [choice(0.9) for _ in range(4)] + [choice(0.5) for _ in range(4)]
    drafts = [[1] * 6] * 4 + [[]] * 4
    for ragged, want in ((True, 3), (False, 1)):
        runner = SimpleNamespace(ragged=ragged)
        runner.pass_rows = lambda lengths, r=runner: Runner.pass_rows(r, lengths)
        s = Speculation(runner=runner, mode="ngram", max_draft=8)
        s.cost = c
        c.probe_due = lambda seqs, declined: False
        assert s._width(group, drafts) == want


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


def test_a_draft_declined_by_cost_is_scored_by_the_plain_steps_token():
    """A draft that does not pay gets no verify pass, so it would learn nothing until the next
    probe (seen: 16 steps on a one-token draft while the answer copied its context). Its first
    token is checked against the plain step's token instead: a drafter that is right grows its
    draft and rate until a wide pass pays; one that is wrong pauses (free text costs nothing)."""
    def run(step_token):
        s = spec(0.25)  # a pass costs (1 + 0.25 * rows) / 1.25 plain steps
        c = choice(0.2)
        c.drafter.length, c.steps = 1, 0
        s._draft = lambda c: (list(range(100, 100 + c.drafter.length)), 10)
        for step in range(12):
            drafts = s.drafts([c])
            if drafts[0]:
                return step, c
            s.decoded([c], 0.1, [step_token])
        return None, c

    step, c = run(100)  # the plain step's token is the draft's first: taken
    assert step is not None and step <= 2 and c.drafter.rate > 0.2  # long before a probe (16)
    step, c = run(7)  # never the draft's token: declined throughout, and drafting pauses
    assert step is None and c.drafter.rate < 0.2 and c.drafter.pause > 0


class _Copying:
    """A choice whose answer copies ``source`` (greedy): what a verify pass needs of it."""

    def __init__(self, source: list[int], rate: float):
        self.tokens, self.done, self.next_token = [], False, source[0]
        self.drafter, self.draft_source = choice(rate).drafter, "context"
        self.sampler = SimpleNamespace(temperature=0, matcher=None)
        self.seq = SimpleNamespace(trim=lambda n: None)
        self.steps = self.drafted = self.accepted = 0

    def accept(self, t, logits):
        self.tokens.append(t)
        return []


def _verify_runner(model_next):
    """A runner whose logits' argmax at each fed token is ``model_next(token)``."""
    def verify(seqs, pieces):
        return [mx.array([[10.0 if v == model_next(t) else 0.0 for v in range(64)]
                          for t in piece]) for piece in pieces]
    return SimpleNamespace(verify=verify, pass_rows=lambda lengths: sum(lengths))


def test_draft_tokens_cut_by_cost_are_scored_by_the_token_after_the_verified_ones():
    """An answer copying its file whose width is cut by cost (8 offered, 1 verified) learns of
    the first token it did not verify from the token the pass gives after the one it did: its
    rate climbs twice as fast where the draft was right (seen: a tail answer verifying 1, 1, 1,
    2, 3, 5 of 8 offered, all taken, while its rate climbed back), and falls where it was not.
    The same where the scheduler's memory bound cuts the draft after the chooser (the token
    compared is the one at the position the pass reached, not the chooser's), also where the
    chooser verified the whole draft."""
    source = list(range(1, 40))

    def run(model_next, width=2, bound=None):
        s = spec(0.25)
        s.runner = _verify_runner(model_next)
        c = _Copying(source, 0.5)
        c.drafter.length = 8
        s._draft = lambda c: (source[len(c.tokens) + 1:len(c.tokens) + 9], 20)
        s._width = lambda group, drafts: width
        rates = []
        for _ in range(3):
            drafts = [d[:bound] for d in s.drafts([c])]  # the scheduler's memory bound
            assert [len(d) for d in drafts] == [1]
            s.verify([c], drafts)
            c.next_token = c.tokens[-1]
            rates.append(c.drafter.rate)
        return c, rates

    for width, bound in ((2, None), (5, 1), (9, 1)):  # (9, 1): verified whole, then cut
        c, rates = run(lambda t: t + 1, width, bound)  # the model copies: every token right
        assert c.tokens == source[1:7] and c.accepted == 3
        # each pass counts two tokens taken (the verified one and the one after it), none cut
        assert rates[0] == pytest.approx((5 * 0.8 + 2) / (5 * 0.8 + 2 + 5 * 0.8))
        h, f = 5.0, 5.0
        for _ in range(3):  # what counting the verified token alone would give: 0.66
            h, f = h * 0.8 + 1, f * 0.8
        assert rates[-1] == pytest.approx(0.744) and h / (h + f) < 0.67
        _, wrong_after = run(lambda t: t + 1 if t % 2 else t + 2, width, bound)  # every other
        assert wrong_after[-1] < 0.5  # token not the copy's


@pytest.mark.parametrize("width", [4, 5])
def test_a_draft_the_memory_bound_turns_into_a_plain_step_is_scored_by_its_first_token(width):
    """Verified length 3 (or the whole draft) by the chooser, none by the scheduler's memory
    bound: the plain step's token is the draft's first position, so it is compared with the
    draft's first token."""
    s = spec(0.25)
    c = choice(0.5)
    c.steps = 0
    s._draft = lambda c: ([7, 8, 9, 10], 10)
    s._width = lambda group, drafts: width
    assert s.drafts([c]) == [[7, 8, 9, 10][:width - 1]]
    s.decoded([c], 0.1, [7])  # the scheduler ran a plain step: the token is the first's
    assert c.drafter.hits == pytest.approx(5 * 0.8 + 1) and c.drafter.fails == pytest.approx(4)
    s.drafts([c])
    s.decoded([c], 0.1, [8])  # not the draft's first token (8 is its second)
    assert c.drafter.hits == pytest.approx(5 * 0.8) and c.drafter.fails == pytest.approx(4.2)


def test_a_forced_draft_is_offered_no_longer_than_the_most_a_step_verifies():
    """What a grammar forces can run past ``--num-draft-tokens`` (a schema's long fixed key);
    the chooser then costed passes of up to 18 rows a sequence that the scheduler cut to 8."""
    s = Speculation(runner=None, mode="ngram", max_draft=4)
    matcher = SimpleNamespace(forced_tokens=lambda: list(range(10, 20)))
    c = SimpleNamespace(
        request=SimpleNamespace(speculate=True, max_tokens=100,
                                lm=SimpleNamespace(context_length=1000)),
        next_token=1, tokens=[], seq=SimpleNamespace(tokens=[1, 2, 3]),
        sampler=SimpleNamespace(matcher=matcher), draft_source="")
    assert s._draft(c) == ([10, 11, 12, 13], 99) and c.draft_source == "grammar"
