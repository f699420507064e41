"""benchmarks/draft_replay.py: recorded answers replayed through the drafter alone."""

from __future__ import annotations

import pytest

from benchmarks.draft_replay import plain_costs, plain_ms, prompt_ids, replay, time_bound
from benchmarks.speculation import source

PASSAGE = list(range(1000, 1060))


def test_an_answer_that_copies_its_context_needs_few_passes():
    context = [1, 2, 3, *PASSAGE, 4, 5]
    r = replay(context, PASSAGE[:48], max_len=8)
    assert r["tokens"] == 48 and r["passes"] <= 12  # lengths 4, 8, 8...: at most 9 a pass
    assert r["draft_taken"] == 48 - r["passes"]  # each pass gives its taken drafts and one
    assert r["draft_rows"] >= r["draft_taken"] and len(r["trace"].split()) == r["passes"]


def test_an_answer_not_in_its_context_takes_a_pass_a_token():
    r = replay([1, 2, 3, *PASSAGE], list(range(5000, 5040)), max_len=8)
    assert r["passes"] == r["tokens"] == 40 and r["draft_taken"] == 0


def test_an_answer_that_leaves_its_copy_is_still_written_whole():
    answer = PASSAGE[:20] + list(range(7000, 7010)) + PASSAGE[30:40]
    r = replay([*PASSAGE], answer, max_len=8)
    assert r["tokens"] == 40 and r["draft_taken"] + r["passes"] == 40
    assert r["passes"] > 10 + 20 // 9  # the ten tokens of its own cost a pass each


def test_plain_step_costs_read_from_log_lines_and_filled_in_between(tmp_path):
    log = tmp_path / "server.log"
    log.write_text("x DEBUG engine: plain step: 8 sequences, 220 ms\n"
                   "x DEBUG engine: plain step: 8 sequences, 240 ms\n"
                   "x DEBUG engine: verify pass: 8 sequences, drafts [1], 300 ms, 9 tokens\n"
                   "x DEBUG engine: plain step: 1 sequences, 80 ms\n")
    costs = plain_costs([log])
    assert costs == {1: 80, 8: 230}
    assert plain_ms(costs, 8) == 230 and plain_ms(costs, 1) == 80
    assert plain_ms(costs, 4) == pytest.approx(80 + 150 * 3 / 7)
    assert plain_ms(costs, 12) == 230 and plain_ms({2: 50}, 1) == 50  # past the ends: nearest


def test_the_time_bound_costs_each_pass_as_a_plain_step_of_the_answers_still_written():
    # two answers of 4 tokens: one needs 2 passes, the other 4; plain steps 10 ms (1), 20 ms (2)
    got = time_bound([2, 4], 4, {1: 10, 2: 20})
    assert got == {"plain_ms": 80, "least_ms": 20 + 20 + 10 + 10, "speedup_at_most": 1.333}


@pytest.fixture(scope="module")
def default_lm():
    from mlx_kvserver.models.loading import resolve_and_load

    return resolve_and_load("default")


def test_a_rewrite_prompt_holds_its_file_and_ends_with_the_answers_first_lines(default_lm):
    tok = default_lm.tokenizer
    ids = prompt_ids(default_lm, "rewrite", 0, 64)
    text = tok.decode(ids)
    name, src = source(0)
    assert f"Here is {name}" in text and src.splitlines()[40] in text
    head = "\n".join(src.splitlines()[:3])
    assert text.rstrip().endswith(head.rstrip())  # the assistant's prefill, continued
