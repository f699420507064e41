"""A prompt's image spans through the cache: the same tokens with another image never reuse
past the image's start (by message id, by content, from disk, after an export and import), the
same image reuses all of it, and a reuse never ends inside an image."""

from __future__ import annotations

import mlx.core as mx
import pytest

from kv_cache.manager import CacheManager
from kv_cache.pages.hashing import chain_hashes
from kv_cache.pages.spans import as_spans
from kv_cache.transfer import export_entry, import_entry
from tests.kv_cache.test_manager import pool_for, store_for
from harness.tiny_model import make_tiny_model

IMAGE = 7  # the image's placeholder id: the same whatever the image
START, LENGTH = 9, 8  # the image's tokens: positions 9..16 (pages of 4: it begins in page 2)
PROMPT = list(range(20, 29)) + [IMAGE] * LENGTH + list(range(40, 53))  # 30 tokens
NEXT = PROMPT + [60, 61, 62, 63, 64]  # the next turn's prompt
SA = as_spans([(START, LENGTH, "a" * 64)])
SB = as_spans([(START, LENGTH, "b" * 64)])


@pytest.fixture(scope="module")
def model():
    return make_tiny_model(seed=3)


def turn(model, m: CacheManager, tokens, spans, key: str | None = None, keys=(), keep=False):
    """Run ``tokens`` with ``spans`` from what the cache reuses; saved under ``key``."""
    seq, match = m.start(tokens, keys, spans=spans)
    model(mx.array(tokens[match.tokens:])[None], cache=seq.prepare())
    seq.append_tokens(tokens[match.tokens:])
    if key is not None:
        m.save(key, seq)
    if keep:
        m.keep(seq)
    else:
        seq.close()
    return match


def reuse(m: CacheManager, tokens, spans, keys=()) -> tuple[int, str]:
    """How many tokens a start of ``tokens`` reuses, and from where (the sequence closed)."""
    seq, match = m.start(tokens, keys, spans=spans)
    assert seq.spans == spans
    seq.close()
    return match.tokens, match.source


def test_another_image_never_hits_past_its_start_in_memory(model):
    m = CacheManager(pool_for(model))
    turn(model, m, PROMPT, SA, key="k")
    assert m.get("k").spans == SA
    n, source = reuse(m, NEXT, SB, ["k"])  # by message id
    assert n <= START and source in ("entry:k", "prefix")
    assert reuse(m, NEXT, SB)[0] <= START  # by content (the prefix index), no ids
    assert reuse(m, NEXT, ())[0] <= START  # the same ids as text
    assert reuse(m, NEXT, SA, ["k"]) == (len(PROMPT), "entry:k")  # the same image: all of it
    assert reuse(m, NEXT, SA)[0] == len(PROMPT) // 4 * 4


def test_a_resident_sequence_is_continued_only_with_the_same_image(model):
    m = CacheManager(pool_for(model))
    turn(model, m, PROMPT, SA, keep=True)
    assert reuse(m, NEXT, SB)[0] <= START
    assert reuse(m, NEXT, SA) == (len(PROMPT), "resident")


def test_a_hit_is_cut_back_to_the_start_of_the_image_it_would_end_inside(model):
    m = CacheManager(pool_for(model))
    seq, _ = m.start(PROMPT, spans=SA)
    model(mx.array(PROMPT)[None], cache=seq.prepare())
    seq.append_tokens(PROMPT)
    m.save("part", seq, n_tokens=START + 4)  # an entry that ends inside the image
    seq.close()
    m.pool.evict_all_cached()  # only the entry's pages are left: 0..3, to position 16
    assert reuse(m, NEXT, SA, ["part"]) == (START, "entry:part")
    # by content, pages 0..2 only: the third holds the image's first three tokens
    m2 = CacheManager(pool_for(model))
    seq, _ = m2.start(PROMPT[:12], spans=SA)
    model(mx.array(PROMPT[:12])[None], cache=seq.prepare())
    seq.append_tokens(PROMPT[:12])
    seq.commit()
    seq.close()
    assert reuse(m2, NEXT, SA) == (START, "prefix")


def test_another_image_never_hits_past_its_start_from_disk(model, tmp_path):
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    turn(model, m, PROMPT, SA, key="k")
    m.close()
    for spans, by_id, by_content in [(SB, START, START), (SA, len(PROMPT), len(PROMPT))]:
        pool = pool_for(model)
        m = CacheManager(pool, store_for(pool, tmp_path))  # a restart: nothing in memory
        assert m.store.get("k").spans == SA  # the spans survive a restart
        n, source = reuse(m, NEXT, spans, ["k"])
        assert n <= by_id and (n == by_id or spans is SB)
        m.close()
        pool = pool_for(model)
        m = CacheManager(pool, store_for(pool, tmp_path))
        n, source = reuse(m, NEXT, spans)  # no ids: the disk's files by content
        assert n <= by_content and (n == by_content or spans is SB)
        assert source == ("disk-prefix" if n else "none")
        m.close()


def test_spans_survive_a_restore_from_disk(model, tmp_path):
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    turn(model, m, PROMPT, SA, key="k")
    m.close()
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    seq, match = m.start(NEXT, ["k"], spans=SA)
    assert (match.tokens, match.source) == (len(PROMPT), "disk:k")
    assert seq.spans == SA
    # the pages read back are the image's: their hashes chain over its spans
    chain = chain_hashes(pool.roots[0], PROMPT, pool.page_size, spans=SA)
    assert [pool.hash_of(b) for b in seq.table.blocks[: len(chain)]] == chain
    model(mx.array(NEXT[match.tokens:])[None], cache=seq.prepare())
    seq.append_tokens(NEXT[match.tokens:])
    m.save("k2", seq)
    seq.close()
    m.close()
    pool = pool_for(model)
    m = CacheManager(pool, store_for(pool, tmp_path))
    assert m.store.get("k2").spans == SA
    assert reuse(m, NEXT + [1], SA, ["k2"]) == (len(NEXT), "disk:k2")
    assert reuse(m, NEXT + [1], SB, ["k2"])[0] <= START
    m.close()


def test_an_export_carries_its_images(model, tmp_path):
    m = CacheManager(pool_for(model))
    turn(model, m, PROMPT, SA, key="k")
    path = tmp_path / "k.safetensors"
    path.write_bytes(export_entry(m, "k"))
    for spans, want in [(SB, START), (SA, len(PROMPT))]:
        m2 = CacheManager(pool_for(model))
        assert import_entry(m2, path).spans == SA
        n, _ = reuse(m2, NEXT, spans, ["k"])
        assert n <= want and (n == want or spans is SB)
