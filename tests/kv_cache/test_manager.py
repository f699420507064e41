"""CacheManager: verified reuse from entries, the prefix index and the resident sequence."""

from __future__ import annotations

import os
from collections import Counter

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache

from kv_cache.tiers.disk.store import DiskStore
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from harness.tiny_model import make_tiny_model


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def pool_for(model, max_bytes=1 << 24):
    a = model.args
    return PagePool(a.num_hidden_layers, a.num_key_value_heads, a.hidden_size // a.num_attention_heads,
                    page_size=4, dtype=mx.float32, max_bytes=max_bytes, fingerprint="tiny")


def run(model, seq, tokens):
    logits = model(mx.array(tokens)[None], cache=seq.prepare())[0, -1]
    seq.append_tokens(tokens)
    return logits


def reference(model, tokens):
    cache = [KVCache() for _ in model.layers]
    return model(mx.array(tokens)[None], cache=cache)[0, -1]


def test_entry_reuse_is_verified_by_tokens_and_exact(model):
    m = CacheManager(pool_for(model))
    first = list(range(10, 31))
    seq, match = m.start(first, ["a"])
    assert match.tokens == 0 and match.source == "none"
    run(model, seq, first)
    m.save("a", seq)
    seq.close()
    edited = first[:9] + [99] + first[10:] + [5, 6]  # an edit at position 9
    seq, match = m.start(edited, ["a"])
    assert (match.tokens, match.source) == (9, "entry:a")
    logits = run(model, seq, edited[9:])
    assert mx.allclose(logits, reference(model, edited), atol=1e-4).item()
    seq.close()
    assert m.stats.hits == 1 and m.stats.misses == 1 and m.stats.tokens_served == 9


def test_resident_sequence_is_continued_in_place(model):
    m = CacheManager(pool_for(model))
    turn1 = list(range(40, 63))
    seq, _ = m.start(turn1, [])
    run(model, seq, turn1)
    m.save("t1", seq)
    m.keep(seq)
    assert m.resident_tokens() == len(turn1) and m.resident_blocks() == seq.table.blocks
    turn2 = turn1 + [7, 8, 9]
    again, match = m.start(turn2, ["t1"])
    assert again is seq and match.source == "resident" and match.tokens == len(turn1)
    assert m.resident_tokens() == 0  # handed out: not resident while it runs
    logits = run(model, again, turn2[len(turn1):])
    assert mx.allclose(logits, reference(model, turn2), atol=1e-4).item()
    again.close()


def test_resident_sequence_is_trimmed_to_what_the_tokens_verify(model):
    m = CacheManager(pool_for(model))
    turn1 = list(range(70, 90))
    seq, _ = m.start(turn1, [])
    run(model, seq, turn1)
    m.keep(seq)
    other = turn1[:13] + [1, 2, 3]
    again, match = m.start(other, [])
    assert again is seq and match.tokens == 13 and len(again.tokens) == 13
    logits = run(model, again, other[13:])
    assert mx.allclose(logits, reference(model, other), atol=1e-4).item()
    again.close()


def test_a_longer_verified_entry_wins_over_the_resident_sequence(model):
    m = CacheManager(pool_for(model))
    long = list(range(100, 130))
    seq, _ = m.start(long, [])
    run(model, seq, long)
    m.save("long", seq)
    seq.close()
    short = list(range(100, 110))
    seq2, found = m.start(short, [])
    assert (found.source, found.tokens) == ("prefix", 8)  # two sealed pages of "long"
    run(model, seq2, short[found.tokens:])
    m.keep(seq2)
    got, match = m.start(long + [1], ["long"])
    assert got is not seq2 and match.source == "entry:long" and match.tokens == len(long)
    assert not seq2.closed and m.resident_tokens() == len(short)  # still resident
    got.close()
    held = {b: n for b, n in m.pool.ref_counts().items() if n}
    assert held == Counter(m.get("long").blocks) + Counter(m.resident_blocks())


def test_alternating_conversations_each_continue_their_resident_sequence(model):
    m = CacheManager(pool_for(model), max_resident=2)
    a, b = list(range(10, 25)), list(range(50, 63))
    seqs = {}
    for name, toks in (("a", a), ("b", b)):
        seq, _ = m.start(toks, [])
        run(model, seq, toks)
        m.keep(seq)
        seqs[name] = seq
    for name, toks in (("a", a + [1, 2]), ("b", b + [3]), ("a", a + [1, 2, 4])):
        got, match = m.start(toks, [])
        assert got is seqs[name] and match.source == "resident"
        logits = run(model, got, toks[match.tokens:])
        assert mx.allclose(logits, reference(model, toks), atol=1e-4).item()
        m.keep(got)
    c = list(range(80, 90))
    seq, _ = m.start(c, [])
    run(model, seq, c)
    m.keep(seq)  # a third one: the least recently used ("b") is closed
    assert seqs["b"].closed and not seqs["a"].closed and m.resident_tokens() == len(a) + 3 + 10


def test_eight_conversations_stay_resident_by_default(model):
    """Eight agents, each on its own files: each one's finished turn keeps its buffers, so each
    next turn goes on from them (a ninth conversation closes the least recently used)."""
    m = CacheManager(pool_for(model))
    convs = [list(range(10 + 20 * i, 22 + 20 * i)) for i in range(9)]
    kept = []
    for toks in convs[:8]:
        seq, _ = m.start(toks, [])
        run(model, seq, toks)
        m.keep(seq)
        kept.append(seq)
    for seq, toks in zip(kept, convs):
        got, match = m.start(toks + [1], [])
        assert got is seq and match.source == "resident"
        run(model, got, [1])
        m.keep(got)
    seq, _ = m.start(convs[8], [])
    run(model, seq, convs[8])
    m.keep(seq)
    assert kept[0].closed and not any(s.closed for s in kept[1:])


def test_pressure_closes_the_resident_sequence_first(model):
    pool = pool_for(model)
    pool = PagePool(pool.num_layers, pool.num_kv_heads, pool.head_dim, page_size=4,
                    dtype=mx.float32, max_bytes=pool.page_bytes * 8, fingerprint="tiny")
    m = CacheManager(pool)
    tokens = list(range(200, 224))  # 6 pages
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens)
    m.keep(seq)
    other = list(range(300, 320))  # 5 pages: only fits once the resident sequence lets go
    seq2, _ = m.start(other, [])
    run(model, seq2, other)
    m.with_room(seq2.commit)  # the caller asks the manager for room (the pool never calls up)
    assert seq.closed and m.resident_tokens() == 0
    seq2.close()


def test_a_sequence_that_does_not_fit_the_pool_is_not_kept(model):
    pool = pool_for(model)
    pool = PagePool(pool.num_layers, pool.num_kv_heads, pool.head_dim, page_size=4,
                    dtype=mx.float32, max_bytes=pool.page_bytes * 2, fingerprint="tiny")
    m = CacheManager(pool)
    tokens = list(range(200, 215))  # 4 pages: more than the pool has
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens)
    m.keep(seq)
    assert seq.closed and m.resident_tokens() == 0
    assert not any(pool.ref_counts().values())


def test_no_resident_sequences_when_disabled(model):
    m = CacheManager(pool_for(model), max_resident=0)
    tokens = list(range(20))
    seq, _ = m.start(tokens, [])
    run(model, seq, tokens)
    m.keep(seq)
    assert seq.closed and m.resident_tokens() == 0


def store_for(pool, root):
    return DiskStore(root, fingerprint=pool.fingerprint, spec=pool.spec,
                     page_size=pool.page_size, max_bytes=1 << 26)


def test_lookup_reads_no_file_for_keys_the_store_does_not_hold(model, tmp_path, monkeypatch):
    tokens = list(range(5, 28))
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, _ = m.start(tokens[:-3], [])
    run(model, seq, tokens[:-3])
    m.save("stored", seq)
    seq.close()
    m.close()
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))  # a restart
    keys = [f"new-{i}" for i in range(250)] + ["stored"] + [f"old-{i}" for i in range(249)]
    reads = []
    for name in ("open", "pread", "preadv", "read", "readv", "stat"):
        real = getattr(os, name)
        monkeypatch.setattr(os, name, lambda *a, _f=real, _n=name, **k: reads.append((_n, a[0]))
                            or _f(*a, **k))
    match = m.find(tokens, keys)
    assert (match.tokens, match.source) == (20, "disk:stored") and reads == []
    seq, match = m.start(tokens, keys)  # the restore reads the one entry: manifest and pages
    files = [f for op, f in reads if op == "open" and f.endswith(".safetensors")]
    assert match.tokens == 20 and len(files) == 1 + 20 // 4  # 1 manifest, 5 pages
    monkeypatch.undo()
    logits = run(model, seq, tokens[20:])
    assert mx.allclose(logits, reference(model, tokens), atol=1e-4).item()
    seq.close()
    m.close()


def test_a_turns_prompt_and_answer_share_pages_on_disk_and_restore_exactly(model, tmp_path):
    """The prompt's entry ends inside a page that the answer's entry continues: that page is
    on disk once (no tail file for the prompt), and both entries restore exactly."""
    tokens = list(range(30, 57))
    prompt, answer = tokens[:22], tokens[:25]  # 5 pages + 2 tokens; 6 pages + 1 token
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, _ = m.start(prompt, [])
    run(model, seq, prompt)
    m.save("u1", seq)
    run(model, seq, answer[22:])
    m.save("a1", seq)
    seq.close()
    m.close()
    tails = sorted(p.name for p in (tmp_path / "tails").rglob("*.safetensors"))
    pages = sorted(p.name for p in (tmp_path / "pages").rglob("*.safetensors"))
    assert len(tails) == 1 and len(pages) == 6  # the answer's one-token tail; 6 pages, once
    for key, n in (("u1", 22), ("a1", 25)):
        m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))  # a restart
        seq, match = m.start(tokens, [key])
        assert (match.tokens, match.source) == (n, f"disk:{key}")
        assert tuple(seq.tokens) == tuple(tokens[:n])
        logits = run(model, seq, tokens[n:])
        assert mx.allclose(logits, reference(model, tokens), atol=1e-4).item()
        seq.close()
        if key == "a1":
            assert m.drop("a1")  # the prompt's entry stays whole without it
        m.close()
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, match = m.start(tokens, ["a1", "u1"])
    assert (match.tokens, match.source) == (22, "disk:u1")
    assert mx.allclose(run(model, seq, tokens[22:]), reference(model, tokens), atol=1e-4).item()
    seq.close()
    m.close()


def restored_with_views(model, root, tokens, key):
    """A restart: a new pool (with prefix views and the attention that reads them, as the
    engine sets up) restoring ``key``."""
    from kv_cache.model.attention import install
    from kv_cache.model.views import PrefixViews

    assert install(model)
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, root))
    m.views = PrefixViews(pool)
    seq, match = m.start(tokens, [key])
    return m, pool, seq, match


# A run's array comes from mx.zeros when small, else unfilled (``kv_cache.pages.memory.empty``):
# tiny runs take both ways when the size from which it is unfilled is set to 0.
RUN_ALLOCATION = pytest.mark.parametrize("empty_from", [None, 0], ids=["zeros", "unfilled"])


@RUN_ALLOCATION
def test_pages_restored_together_are_one_array_that_the_view_reads_without_a_copy(
        model, tmp_path, monkeypatch, empty_from):
    if empty_from is not None:
        monkeypatch.setattr("kv_cache.pages.memory.EMPTY_MIN_BYTES", empty_from)
    tokens = list(range(40, 70))  # 7 full pages of 4 and 2 tokens
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, _ = m.start(tokens[:26], [])
    run(model, seq, tokens[:26])
    m.save("k", seq)
    seq.close()
    m.close()
    m, pool, seq, match = restored_with_views(model, tmp_path, tokens, "k")
    assert match.tokens == 26 and m.stats.pages_read_from_disk == 6
    blocks = list(seq.tables[0].blocks[:6])
    run_array = pool.run_array(blocks, 24)
    assert run_array is not None and run_array.shape[3] == 24
    assert seq.view is not None and seq.view.length == 24 and seq.view.nbytes == 0
    for i, b in enumerate(blocks):  # each page's data is its slice of the run
        assert mx.array_equal(pool.data(b), run_array[:, :, :, 4 * i : 4 * i + 4, :]).item()
    logits = run(model, seq, tokens[26:])
    assert mx.allclose(logits, reference(model, tokens), atol=1e-4).item()
    seq.close()
    m.close()


@pytest.mark.parametrize("copy", [True, False], ids=["copied", "split"])
def test_a_restored_turn_with_a_long_prompt_piece_is_what_a_warm_one_computes(
        model, tmp_path, monkeypatch, copy):
    """A restored turn reading its history through a view, with 30 new tokens: in float32 on
    the CPU the view is copied in front of the new positions and the fused kernel runs, and the
    logits are bit for bit the warm sequence's; through the split path they agree within
    rounding. Greedy picks the same token either way."""
    from kv_cache.model import attention

    tokens = list(range(40, 96))  # 26 tokens of history (6 full pages of 4), then 30 new
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, _ = m.start(tokens[:26], [])
    run(model, seq, tokens[:26])
    m.save("k", seq)
    warm = run(model, seq, tokens[26:])  # the warm turn: the whole context in its own buffers
    seq.close()
    m.close()
    chosen = []
    real = attention._copy_pays
    monkeypatch.setattr(attention, "_copy_pays",
                        lambda *a: chosen.append(real(*a) and copy) or chosen[-1])
    m, pool, seq, match = restored_with_views(model, tmp_path, tokens, "k")
    assert match.tokens == 26 and seq.view is not None and seq.view.length == 24
    logits = run(model, seq, tokens[26:])
    assert chosen and all(c == copy for c in chosen)  # every layer took the same path
    if copy:
        assert mx.array_equal(logits, warm).item()
    else:
        assert mx.allclose(logits, warm, atol=1e-4).item()
    assert mx.argmax(logits).item() == mx.argmax(warm).item() == mx.argmax(
        reference(model, tokens)).item()
    seq.close()
    m.close()


@RUN_ALLOCATION
def test_a_bad_page_in_a_run_keeps_the_pages_before_it(model, tmp_path, monkeypatch, empty_from):
    if empty_from is not None:
        monkeypatch.setattr("kv_cache.pages.memory.EMPTY_MIN_BYTES", empty_from)
    tokens = list(range(40, 70))
    m = CacheManager(pool_for(model), store_for(pool_for(model), tmp_path))
    seq, _ = m.start(tokens[:26], [])
    run(model, seq, tokens[:26])
    m.save("k", seq)
    fourth = m.pool.hash_of(seq.tables[0].blocks[3])
    seq.close()
    m.close()
    path = tmp_path / "pages" / fourth.hex()[:2] / (fourth.hex() + ".safetensors")
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    m, pool, seq, match = restored_with_views(model, tmp_path, tokens, "k")
    assert match.tokens == 12  # the pages before the damaged one
    blocks = list(seq.tables[0].blocks)
    assert len(blocks) == 3 and pool.run_array(blocks, 12) is None  # each in its own storage
    assert not path.exists()
    logits = run(model, seq, tokens[12:])
    assert mx.allclose(logits, reference(model, tokens), atol=1e-4).item()
    seq.close()
    m.close()


def test_a_conversation_sharing_only_a_beginning_leaves_the_resident_one_alone(model):
    """A new conversation whose prompt shares only the first tokens of a resident sequence
    (agents' common system prompt) does not take it (it would be trimmed by more than half, and
    its own conversation's next turn would read its whole history from the pages again); that
    conversation's next turn still goes on from it in place."""
    m = CacheManager(pool_for(model))
    system, doc_a = list(range(10, 18)), list(range(100, 124))
    seq, _ = m.start(system + doc_a, [])
    run(model, seq, system + doc_a)
    m.keep(seq)
    other = system + list(range(200, 220))
    got, match = m.start(other, [])
    assert got is not seq and match.source != "resident" and not seq.closed
    assert m.resident_tokens() == len(system + doc_a)
    logits = run(model, got, other[match.tokens:])
    assert mx.allclose(logits, reference(model, other), atol=1e-4).item()
    got.close()
    again, match = m.start(system + doc_a + [5], [])
    assert again is seq and match.source == "resident" and match.tokens == len(system + doc_a)
    again.close()
