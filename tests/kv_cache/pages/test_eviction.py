"""Eviction policies on their own: exact victim order on scripted sequences."""

import pytest

from kv_cache.pages.eviction import FIFOPolicy, LRUPolicy, S3FIFOPolicy, make_policy


def any_block(_b: int) -> bool:
    return True


def drain(policy, can_evict=any_block) -> list[int]:
    out = []
    while (v := policy.victim(can_evict)) is not None:
        out.append(v)
    return out


# -- make_policy ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, cls", [("lru", LRUPolicy), ("fifo", FIFOPolicy), ("s3fifo", S3FIFOPolicy),
                  ("LRU", LRUPolicy), ("S3FIFO", S3FIFOPolicy)]
)
def test_make_policy_by_name(name, cls):
    p = make_policy(name)
    assert type(p) is cls
    assert p.name == name.lower()
    assert len(p) == 0
    assert make_policy(name) is not p  # a fresh object each time


@pytest.mark.parametrize("name", ["", "lfu", "s3-fifo", "random"])
def test_make_policy_unknown_name(name):
    with pytest.raises(ValueError, match="unknown eviction policy") as e:
        make_policy(name)
    assert "fifo" in str(e.value) and "lru" in str(e.value) and "s3fifo" in str(e.value)


# -- LRU and FIFO ---------------------------------------------------------------------------------


def test_lru_order_follows_accesses():
    p = LRUPolicy()
    for b in (1, 2, 3, 4):
        p.insert(b)
    p.access(1)
    p.access(3)
    p.access(99)  # unknown: ignored
    assert len(p) == 4 and 99 not in p
    assert drain(p) == [2, 4, 1, 3]
    assert len(p) == 0 and p.victim(any_block) is None


def test_fifo_ignores_accesses():
    p = FIFOPolicy()
    for b in (1, 2, 3, 4):
        p.insert(b)
    p.access(1)
    p.access(3)
    assert drain(p) == [1, 2, 3, 4]


@pytest.mark.parametrize("cls", [LRUPolicy, FIFOPolicy])
def test_victim_skips_what_may_not_go_and_keeps_it(cls):
    p = cls()
    for b in (1, 2, 3):
        p.insert(b)
    assert p.victim(lambda b: b != 1) == 2
    assert 1 in p and 2 not in p and len(p) == 2
    assert p.victim(lambda b: False) is None
    assert len(p) == 2
    assert drain(p) == [1, 3]


@pytest.mark.parametrize("cls", [LRUPolicy, FIFOPolicy])
def test_remove_and_reinsert(cls):
    p = cls()
    for b in (1, 2, 3):
        p.insert(b)
    p.remove(2)
    p.remove(42)  # unknown: no error
    assert 2 not in p and len(p) == 2
    p.insert(1)  # re-insert moves to the back for both
    assert drain(p) == [3, 1]


# -- S3-FIFO --------------------------------------------------------------------------------------


def test_s3fifo_unused_pages_go_in_insertion_order():
    p = S3FIFOPolicy()
    for b in (1, 2, 3):
        p.insert(b, ident=f"h{b}")
    assert drain(p) == [1, 2, 3]


def test_s3fifo_reused_page_is_promoted_from_small_to_main():
    p = S3FIFOPolicy()
    for b in (1, 2, 3):
        p.insert(b, ident=f"h{b}")
    p.access(2)
    assert p.victim(any_block) == 1
    assert list(p._small) == [2, 3] and list(p._main) == []
    # 2 was reused: it moves to main (its count reset) and 3, not reused, goes.
    assert p.victim(any_block) == 3
    assert list(p._small) == [] and list(p._main) == [2] and p._freq[2] == 0
    assert p.victim(any_block) == 2
    assert len(p) == 0


def test_s3fifo_ghost_hit_goes_straight_to_main():
    p = S3FIFOPolicy()
    p.insert(1, ident="a")
    p.insert(2, ident="b")
    assert p.victim(any_block) == 1  # "a" remembered in the ghost queue
    assert list(p._ghost) == ["a"]
    p.insert(3, ident="a")  # same content back (another block id): a ghost hit
    p.insert(4, ident="c")
    assert list(p._main) == [3] and list(p._small) == [2, 4]
    assert list(p._ghost) == []
    # Small pages go first; had 3 entered small, the order would be 2, 3, 4.
    assert drain(p) == [2, 4, 3]


def test_s3fifo_ghost_uses_the_block_id_without_ident():
    p = S3FIFOPolicy()
    p.insert(1)
    p.insert(2)
    assert p.victim(any_block) == 1
    p.insert(1)  # the same block id again: a ghost hit
    assert list(p._main) == [1] and list(p._small) == [2]


def test_s3fifo_main_queue_gives_reused_pages_a_second_chance():
    p = S3FIFOPolicy()
    for b in (1, 2, 3, 4):
        p.insert(b, ident=b)
    p.access(1)
    p.access(2)
    assert p.victim(any_block) == 3  # 1 and 2 promoted, 3 evicted from small
    assert list(p._main) == [1, 2] and list(p._small) == [4]
    p.access(1)  # reused again while in main
    assert p.victim(any_block) == 4  # small still holds its share
    # Main: 1 (count 1) gets another round, 2 (count 0) goes although it is younger.
    assert p.victim(any_block) == 2
    assert p.victim(any_block) == 1
    assert p.victim(any_block) is None


def test_s3fifo_counts_saturate_at_max_freq():
    p = S3FIFOPolicy()
    p.insert(1, ident="x")
    assert p.victim(any_block) == 1  # x -> ghost
    p.insert(5, ident="x")  # ghost hit: main
    p.insert(9, ident="w")
    assert p.victim(any_block) == 9  # w -> ghost
    p.insert(8, ident="w")  # ghost hit: main
    assert list(p._main) == [5, 8] and not p._small
    for _ in range(5):
        p.access(5)  # 5 would be 5 without the cap
    for _ in range(4):
        p.access(8)  # 4 would be 4 without the cap
    assert p._freq == {5: 3, 8: 3}
    # Both capped at 3: 5, older, runs out first. Uncapped, 8 (count 4 < 5) would go first.
    assert drain(p) == [5, 8]


def test_s3fifo_page_that_may_not_go_moves_from_small_to_main():
    p = S3FIFOPolicy()
    for b in (1, 2, 3):
        p.insert(b, ident=b)
    assert p.victim(lambda b: b != 1) == 2
    assert list(p._main) == [1] and list(p._small) == [3]
    assert p.victim(lambda b: b != 1) == 3
    assert p.victim(lambda b: b != 1) is None  # main goes round, nothing may go
    assert len(p) == 1 and 1 in p
    assert p.victim(any_block) == 1


def test_s3fifo_finds_a_small_page_when_main_is_all_held():
    """Regression: a small queue below its share was never looked at when every main page was
    passed over, so a pool with a cached page asserted 'none is evictable'."""
    p = S3FIFOPolicy()
    held = set(range(10))
    for b in range(10):
        p.insert(b, ident=b)
    p.insert(10, ident=10)
    # Everything held but 10: the held pages all move to main; 10 stays small (1 of 11 < 10%).
    assert p.victim(lambda b: b not in held) == 10
    assert list(p._main) == list(range(10)) and not p._small
    p.insert(11, ident=11)
    assert p.victim(lambda b: b not in held) == 11
    assert list(p._main) == list(range(10))


def test_s3fifo_remove_and_membership():
    p = S3FIFOPolicy()
    p.insert(1, ident="a")
    p.insert(2, ident="b")
    p.access(1)
    p.victim(lambda b: b == 2)  # 1 promoted to main, 2 evicted
    assert 1 in p and 2 not in p and len(p) == 1
    p.remove(1)
    assert 1 not in p and len(p) == 0 and p._freq == {} and p._ident == {}
    assert p.victim(any_block) is None


def test_s3fifo_reinsert_of_a_resident_block_resets_it():
    p = S3FIFOPolicy()
    p.insert(1, ident="a")
    p.insert(2, ident="b")
    p.access(1)
    p.insert(1, ident="c")  # new content in the same block: counted afresh, at the back
    assert list(p._small) == [2, 1] and p._freq[1] == 0
    assert drain(p) == [2, 1]


def test_s3fifo_ghost_queue_is_bounded_by_main_capacity():
    p = S3FIFOPolicy()
    for b in range(10):
        p.insert(b, ident=b)
    assert drain(p) == list(range(10))
    # 10 pages were resident at most: the main queue's share is 9, and so is the ghost queue's.
    assert list(p._ghost) == list(range(1, 10))


@pytest.mark.parametrize("name", ["lru", "fifo", "s3fifo"])
def test_victim_never_returns_a_refused_page(name):
    p = make_policy(name)
    for b in range(8):
        p.insert(b, ident=("h", b))
        if b % 3 == 0:
            p.access(b)
    allowed = {1, 4, 6}
    got = []
    while (v := p.victim(lambda b: b in allowed)) is not None:
        got.append(v)
        allowed.discard(v)
    assert sorted(got) == [1, 4, 6]
    assert len(p) == 5 and all(b in p for b in (0, 2, 3, 5, 7))
