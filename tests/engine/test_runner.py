"""The model runner's prompt pass: positions whose logits nobody reads have only the caches'
state evaluated, and a long last piece runs its last token alone; the caches and the logits are
those of the plain pass."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache import open_cache
from mlx_kvserver.engine.runner import SPLIT_LAST, Runner
from mlx_kvserver.engine.scheduler import Scheduler

PROMPT = [(i * 37) % 250 + 3 for i in range(3 * SPLIT_LAST + 5)]


def _runner(lm):
    manager = open_cache(lm.cache_spec, lm.fingerprint, page_size=8, max_ram_bytes=64 << 20,
                         policy="lru", disk_dir=None, max_disk_bytes=0, max_resident=0)
    return manager, Runner(lm.model, manager, lm.name)


def _plain(lm, seq, tokens) -> mx.array:
    """The pass as it was: the model over the whole piece, its last logits evaluated."""
    from kv_cache.hooks import forward

    with forward():
        out = lm.model(mx.array(tokens)[None], cache=seq.prepare())[0, -1]
        mx.eval(out)
    seq.append_tokens(tokens)
    return out


def _kv(seq) -> list[mx.array]:
    return [a for c in seq.prepare() for a in c.state]


def test_a_piece_without_logits_leaves_the_caches_of_the_plain_pass(tiny_lm):
    manager, runner = _runner(tiny_lm)
    a, b = manager.new_sequence(), manager.new_sequence()
    try:
        assert runner.prefill(a, PROMPT[:20], logits=False) is None
        _plain(tiny_lm, b, PROMPT[:20])
        assert a.tokens == b.tokens == PROMPT[:20]
        for x, y in zip(_kv(a), _kv(b), strict=True):
            assert mx.array_equal(x, y).item()
        # and the next piece, with its logits, on top of it
        la = runner.prefill(a, PROMPT[20:])
        lb = _plain(tiny_lm, b, PROMPT[20:])
        assert len(PROMPT[20:]) > SPLIT_LAST  # its last token ran alone
        assert mx.allclose(la, lb, atol=1e-4).item()
        assert mx.argmax(la).item() == mx.argmax(lb).item()
        for x, y in zip(_kv(a), _kv(b), strict=True):
            assert mx.allclose(x, y, atol=1e-5).item()
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("n", [1, SPLIT_LAST, SPLIT_LAST + 1])
def test_short_and_long_last_pieces_give_the_plain_logits(tiny_lm, n):
    manager, runner = _runner(tiny_lm)
    a, b = manager.new_sequence(), manager.new_sequence()
    try:
        got, want = runner.prefill(a, PROMPT[:n]), _plain(tiny_lm, b, PROMPT[:n])
        assert got.shape == want.shape and mx.allclose(got, want, atol=1e-4).item()
        assert len(a.tokens) == n
    finally:
        a.close()
        b.close()


def test_the_scheduler_asks_for_logits_only_at_a_prompts_end(tiny_lm):
    from tests.engine.test_scheduler import Collect, step

    manager, runner = _runner(tiny_lm)
    asked: list[tuple[int, bool]] = []
    original = runner.prefill_many

    def spy(seqs, pieces, logits=None, images=None):
        asked.extend(zip([len(p) for p in pieces], logits))
        return original(seqs, pieces, logits, images)

    runner.prefill_many = spy
    s = Scheduler(manager, runner, prefill_chunk=16)
    job = Collect({"messages": [{"role": "user", "content": "word " * 40}], "max_tokens": 3,
                   "temperature": 0}, tiny_lm)
    s.add(job)
    while s.busy:
        step(s)
    assert job.finished and not job.errors()
    assert len(asked) >= 3, asked  # the prompt ran in several pieces
    assert [flag for _, flag in asked] == [False] * (len(asked) - 1) + [True]


def _prefilled(manager, runner, prompts):
    seqs = [manager.new_sequence() for _ in prompts]
    for s, p in zip(seqs, prompts):
        runner.prefill(s, p)
    return seqs


def test_a_ragged_verify_pass_gives_each_piece_the_padded_pass_logits(tiny_lm):
    """Pieces of 1, 5 and 3 tokens in one verify pass: ragged (one row per token, 9 rows, no
    padding) as the runner does it, and right-padded to 5 (15 rows) as it did; each piece's
    logits and each sequence's keys and values agree, and trimming a rejected tail leaves the
    same sequence either way."""
    manager, runner = _runner(tiny_lm)
    assert runner.ragged  # attention layers only, no pages in bits
    prompts = [PROMPT[:9], PROMPT[3:20], PROMPT[7:12]]
    pieces = [[5], [6, 7, 8, 9, 10], [11, 12, 13]]
    shapes = []
    model = runner.model
    runner.model = lambda x, cache: shapes.append(x.shape) or model(x, cache=cache)
    ragged = _prefilled(manager, runner, prompts)
    padded = _prefilled(manager, runner, prompts)
    try:
        shapes.clear()
        got = runner.verify(ragged, pieces)
        mx.eval(got)
        runner.ragged = False
        want = runner.verify(padded, pieces)
        assert shapes == [(9, 1), (3, 5)]
        for g, w, p in zip(got, want, pieces):
            assert g.shape == w.shape == (len(p), w.shape[-1])
            assert mx.allclose(g, w, atol=1e-4).item()
            assert mx.array_equal(mx.argmax(g, axis=-1), mx.argmax(w, axis=-1)).item()
        for s in (ragged[1], padded[1]):  # two of its four draft tokens rejected
            s.trim(2)
        for a, b in zip(ragged, padded):
            assert a.tokens == b.tokens
            for x, y in zip(_kv(a), _kv(b), strict=True):
                assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5).item()
    finally:
        for s in ragged + padded:
            s.close()


def test_prompt_pieces_of_several_sequences_go_ragged_and_give_each_alones_logits(tiny_lm):
    """The next turns of three cached conversations, 1, 12 and 3 new tokens, in one prompt
    pass: ragged (16 rows, not 3 x 12 = 36 padded), and each one's last logits, keys and values
    are those of its piece run alone."""
    manager, runner = _runner(tiny_lm)
    prompts = [PROMPT[:9], PROMPT[3:20], PROMPT[7:12]]
    pieces = [[5], list(range(20, 32)), [11, 12, 13]]
    together = _prefilled(manager, runner, prompts)
    alone = _prefilled(manager, runner, prompts)
    shapes = []
    model = runner.model
    runner.model = lambda x, cache: shapes.append(x.shape) or model(x, cache=cache)
    try:
        got = runner.prefill_many(together, pieces, [True] * 3)
        assert shapes == [(16, 1)]
        for s, p, g in zip(alone, pieces, got, strict=True):
            want = runner.prefill(s, p)
            assert g.shape == want.shape and mx.allclose(g, want, atol=1e-4).item()
            assert mx.argmax(g).item() == mx.argmax(want).item()
        for a, b in zip(together, alone):
            assert a.tokens == b.tokens
            for x, y in zip(_kv(a), _kv(b), strict=True):
                assert x.shape == y.shape and mx.allclose(x, y, atol=1e-5).item()
        shapes.clear()
        runner.ragged = False  # pages in bits, or a model whose ragged probe disagreed: padded
        more = runner.prefill_many(together[:2], [[1], [2, 3, 4, 5]], [True] * 2)
        assert shapes == [(2, 4)] and len(more) == 2
    finally:
        for s in together + alone:
            s.close()


def test_a_model_whose_ragged_pass_disagrees_verifies_padded(tiny_lm, monkeypatch):
    """The start-up probe verifies pieces of 3 and 1 tokens alone and in one ragged pass: where
    they disagree (here every row of a sequence given its first position, as a model that
    reads positions some other way would), verify passes stay padded and the model still
    batches."""
    from kv_cache.model.batch import BatchLayer

    def first_positions(self):
        lengths = self.ragged or [1] * len(self.members)
        return mx.array([m.offset for m, n in zip(self.members, lengths) for _ in range(n)])

    monkeypatch.setattr(BatchLayer, "offset", property(first_positions))
    manager, runner = _runner(tiny_lm)
    assert runner.batched and not runner.ragged
    monkeypatch.undo()
    manager, runner = _runner(tiny_lm)
    assert runner.batched and runner.ragged


def test_a_verify_pass_is_ragged_where_that_saves_a_quarter_of_its_rows(tiny_lm):
    manager, runner = _runner(tiny_lm)
    assert runner.pass_rows([8, 1, 1, 1]) == 11  # ragged: 11 rows, not 32
    assert runner.pass_rows([4, 4, 3, 4]) == 16  # padding one row: padded (its layout is faster)
    assert runner.pass_rows([1, 1, 1]) == 3 and runner.pass_rows([6]) == 6
    runner.ragged = False  # pages in bits, or a model whose ragged probe disagreed
    assert runner.pass_rows([8, 1, 1, 1]) == 32
