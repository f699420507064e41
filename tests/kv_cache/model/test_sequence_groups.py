"""Sequences over several cache groups (kv_cache/model/sequence.py, layer_cache.py,
kv_cache/manager.py): sliding windows that release the pages they no longer read, and recurrent
state snapshotted where an entry ends — each equal, token for token, to mlx-lm's own caches."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from kv_cache.model.sequence import PagedSequence
from kv_cache.model.spec_reader import spec_of_model
from harness.tiny_families import SLIDING_WINDOW, make_tiny_family_model

P = 8  # pages are half a window
W = SLIDING_WINDOW
PROMPT = [int(t) for t in np.random.default_rng(0).integers(3, 300, 100)]


@pytest.fixture(scope="module")
def gemma3():
    model = make_tiny_family_model("gemma3_text")
    return model, spec_of_model(model, "gemma3_text")


@pytest.fixture(scope="module")
def qwen35():
    model = make_tiny_family_model("qwen3_5")
    return model, spec_of_model(model, "qwen3_5")


def pool_for(spec, max_bytes=64 << 20) -> PagePool:
    return PagePool(spec=spec, page_size=P, max_bytes=max_bytes, fingerprint="m")


def run(model, cache, tokens, chunk=37, seq=None):
    """Logits after each chunk of ``tokens`` (the last position's), run in chunks."""
    out = []
    for i in range(0, len(tokens), chunk):
        piece = tokens[i : i + chunk]
        out.append(model(mx.array([piece]), cache=seq.prepare() if seq else cache)[0, -1])
        mx.eval(out[-1])
        if seq is not None:
            seq.append_tokens(piece)
    return out


def greedy(model, cache, logits, n, seq=None):
    tokens = []
    for _ in range(n):
        t = int(mx.argmax(logits).item())
        tokens.append(t)
        logits = model(mx.array([[t]]), cache=seq.prepare() if seq else cache)[0, -1]
        if seq is not None:
            seq.append_tokens([t])
    return tokens, logits


@pytest.mark.parametrize("family", ["gemma3", "qwen35"])
def test_paged_equals_mlx_lm_caches(family, request):
    model, spec = request.getfixturevalue(family)
    ref = make_prompt_cache(model)
    want = run(model, ref, PROMPT)
    seq = PagedSequence(pool_for(spec))
    got = run(model, seq.layers, PROMPT, seq=seq)
    for g, w in zip(got, want):
        np.testing.assert_allclose(np.array(g), np.array(w), rtol=1e-4, atol=1e-4)
    assert greedy(model, seq.layers, got[-1], 30, seq)[0] == greedy(model, ref, want[-1], 30)[0]


def test_window_pages_outside_the_window_are_released(gemma3):
    model, spec = gemma3
    pool = pool_for(spec)
    seq = PagedSequence(pool)
    run(model, seq.layers, PROMPT, seq=seq)
    seq.commit()
    window, full = seq.tables
    # A query after 100 positions reads 85..100: pages 10.. (80-87, ...); pages 0-9 are gone.
    assert window.blocks[:10] == [None] * 10 and None not in window.blocks[10:]
    assert len(window.blocks) == len(full.blocks) == 13 and None not in full.blocks
    used = {}
    for b in pool.ref_counts():
        used[pool.group_of(b)] = used.get(pool.group_of(b), 0) + 1
    assert used == {0: 3, 1: 13}
    # The working buffer of a window layer stays O(window) too, however long the sequence.
    run(model, seq.layers, PROMPT * 4, seq=seq)
    seq.commit()
    layer = seq.group_layers[0][0]
    assert layer.keys.shape[2] <= 2 * max(W, layer.step) + P
    assert sum(b is not None for b in seq.tables[0].blocks) == 3
    assert pool.stats().used_bytes == sum(pool.block_bytes(b) for b in pool.ref_counts())


def test_window_reuse_from_an_entry_is_exact(gemma3):
    model, spec = gemma3
    pool = pool_for(spec)
    manager = CacheManager(pool)
    seq = PagedSequence(pool)
    logits = run(model, seq.layers, PROMPT, seq=seq)[-1]
    answer, _ = greedy(model, seq.layers, logits, 12, seq)
    manager.save("a", seq)
    seq.close()
    entry = manager.get("a")
    assert entry.tables[0][0] is None  # the entry holds only what its window reads
    nxt = PROMPT + answer[:-1] + [5, 6, 7]
    resumed, match = manager.start(nxt, ["a"])
    assert match.tokens == len(PROMPT) + 11 and match.source == "entry:a"
    got = run(model, resumed.layers, nxt[match.tokens:], seq=resumed)[-1]
    ref = make_prompt_cache(model)
    want = run(model, ref, nxt)[-1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert greedy(model, resumed.layers, got, 20, resumed)[0] == greedy(model, ref, want, 20)[0]
    # A prompt that leaves the entry long before its end cannot use its window pages.
    early = PROMPT[:40] + [9, 9, 9]
    seq2, match2 = manager.start(early, ["a"])
    assert match2.tokens == 0
    seq2.close()
    resumed.close()


def test_window_trim_only_as_far_as_the_buffer_reaches(gemma3):
    model, spec = gemma3
    seq = PagedSequence(pool_for(spec))
    run(model, seq.layers, PROMPT * 4, seq=seq)
    assert seq.can_trim_to(len(seq.tokens) - 3)
    assert not seq.can_trim_to(10)
    with pytest.raises(ValueError):
        seq.trim(len(seq.tokens) - 10)
    seq.trim(3)
    assert len(seq.tokens) == 4 * len(PROMPT) - 3


def test_state_snapshot_resumes_exactly_at_an_entry_and_only_there(qwen35):
    model, spec = qwen35
    pool = pool_for(spec)
    manager = CacheManager(pool)
    seq = PagedSequence(pool)
    logits = run(model, seq.layers, PROMPT, seq=seq)[-1]
    manager.save("prompt", seq)
    answer, _ = greedy(model, seq.layers, logits, 10, seq)
    manager.save("answer", seq)
    assert not seq.can_trim_to(len(PROMPT))  # a recurrent state cannot go back
    with pytest.raises(ValueError):
        seq.trim(1)
    seq.close()
    nxt = PROMPT + answer + [11, 12]  # every answer token went through the model here
    resumed, match = manager.start(nxt, ["answer", "prompt"])
    assert (match.tokens, match.source) == (len(PROMPT) + 10, "entry:answer")
    ref = make_prompt_cache(model)
    want = run(model, ref, nxt)[-1]
    got = run(model, resumed.layers, nxt[match.tokens:], seq=resumed)[-1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    assert greedy(model, resumed.layers, got, 15, resumed)[0] == greedy(model, ref, want, 15)[0]
    resumed.close()
    # An edit inside the answer: its state is no use; the prompt's entry (fully inside) is.
    edited = PROMPT + [answer[0] + 1, 7, 7]
    seq2, match2 = manager.start(edited, ["answer", "prompt"])
    assert (match2.tokens, match2.source) == (len(PROMPT), "entry:prompt")
    got = run(model, seq2.layers, edited[match2.tokens:], seq=seq2)[-1]
    want = run(model, make_prompt_cache(model), edited)[-1]
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)
    seq2.close()
    # No entry ends inside this prompt, and a token prefix alone has no state: nothing reused.
    seq3, match3 = manager.start(PROMPT[:50] + [1, 2], ["answer", "prompt"])
    assert match3.tokens == 0
    seq3.close()


def test_fork_shares_pages_and_copies_state(qwen35):
    model, spec = qwen35
    pool = pool_for(spec)
    seq = PagedSequence(pool)
    logits = run(model, seq.layers, PROMPT, seq=seq)[-1]
    branch = seq.fork()
    assert branch.tables[0].blocks == seq.tables[0].blocks
    assert all(pool.ref_count(b) == 2 for b in seq.tables[0].blocks)
    a, _ = greedy(model, seq.layers, logits, 10, seq)
    b, _ = greedy(model, branch.layers, logits, 10, branch)
    assert a == b  # the branch's state is its own copy: the first branch's steps do not show
    seq.close()
    branch.close()
    assert all(n == 0 for n in pool.ref_counts().values())
