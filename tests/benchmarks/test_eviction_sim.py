"""The eviction simulator's pure functions and benchmarks/memory.py's accounting, at tiny sizes."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from benchmarks import eviction_sim as es
from benchmarks import memory as bm

GiB = 1 << 30
TINY = es.Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=8, page_size=4, block_size=16,
                   context=128)


# -- the back of the envelope -------------------------------------------------------------------


def test_envelope_bytes():
    g = es.Geometry()
    assert g.context_bytes == 28 * 2 * 8 * 1024 * 4096 * 2 == 3_758_096_384
    assert g.context_bytes == 3.5 * GiB  # "3.5 GB" is GiB: 3.76 GB in powers of ten
    assert g.page_bytes == 1 << 20  # 32 tokens x 2 x 8 heads x 1024 x 2 B
    assert g.head_block_bytes == 2 << 20  # 512 tokens x 2 x 1024 x 2 B
    assert g.n_blocks * g.layers * g.kv_heads * g.head_block_bytes == g.context_bytes
    assert g.n_pages * g.layers * g.page_bytes == g.context_bytes
    env = es.envelope(g)
    assert env["union_fraction"] == pytest.approx(0.64)
    assert env["per_head_GiB"] == pytest.approx(2.24)


def test_selection_reads_first_and_last_and_top_k():
    s = es.Selection(steps=6, top_k=2)
    sel = es.select_blocks(TINY, s)
    assert sel.shape == (6, 2, 4, 8)
    assert sel[..., 0].all() and sel[..., -1].all()
    assert (sel.sum(axis=-1) == 4).all()  # first, last, top-2
    paged = es.bytes_per_step(es.units(sel, TINY, "paged"), TINY.page_bytes)
    per_head = es.bytes_per_step(es.units(sel, TINY, "per-head"), TINY.head_block_bytes)
    assert (per_head <= paged).all() and (paged <= TINY.context_bytes).all()


def test_default_selection_reproduces_the_per_head_figure():
    g = es.Geometry()
    sel = es.select_blocks(g, es.Selection(steps=20))
    per_head = es.bytes_per_step(es.units(sel, g, "per-head"), g.head_block_bytes).mean() / GiB
    paged = es.bytes_per_step(es.units(sel, g, "paged"), g.page_bytes)
    assert per_head == pytest.approx(2.24, abs=0.05)
    assert paged.max() == g.context_bytes  # "up to 3.5 GB"
    assert paged.mean() / GiB > 3.4


def test_trace_order_and_keys():
    u = np.zeros((2, 2, 3), dtype=bool)
    u[0, 1, 2] = u[0, 0, 1] = u[1, 0, 0] = True
    keys, step = es.trace(u)
    assert keys.tolist() == [1, 5, 0] and step.tolist() == [0, 0, 1]


# -- the cache ----------------------------------------------------------------------------------


LOOP = list(range(100)) * 10  # a cycle of 100 units, larger than the caches below


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_cyclic_pattern_larger_than_cache_misses_everything(policy):
    acc, miss = es.simulate(LOOP, 80, policy, count_from=100)
    assert (acc, miss) == (900, 900)


def test_s3fifo_paper_and_optimum_beat_lru_on_a_cycle():
    _, paper = es.simulate(LOOP, 80, "s3fifo-paper", count_from=100)
    _, opt = es.simulate(LOOP, 80, "opt", count_from=100)
    assert opt < paper < 900
    # Belady on a cycle of n through a cache of c: (n - c) misses per c - 1 hits
    assert opt / 900 == pytest.approx((100 - 80) / (100 - 1), abs=0.02)


def test_kv_cache_s3fifo_beats_lru_on_a_cycle():
    _, miss = es.simulate(LOOP, 80, "s3fifo", count_from=100)
    assert miss < 900


@pytest.mark.parametrize("policy", es.POLICIES)
def test_no_misses_after_warm_up_when_the_cache_holds_everything(policy):
    s = es.Selection(steps=12, warmup=1, drift=0.0)
    sel = es.select_blocks(TINY, s)
    for layout in es.LAYOUTS:
        u = es.units(sel, TINY, layout)
        keys, step = es.trace(u)
        # every unit that is ever read has been read once in step 0: first and last always, the
        # rest after warm-up may be new, so warm up on the set of all keys first
        warm = np.unique(keys)
        full = np.concatenate([warm, keys])
        acc, miss = es.simulate(full, int(np.prod(u.shape[1:])), policy, count_from=len(warm))
        assert acc == len(keys) and miss == 0


def test_optimum_is_a_lower_bound():
    rng = np.random.default_rng(1)
    keys = rng.zipf(1.3, 3000) % 200
    for cap in (5, 20, 60):
        _, opt = es.simulate(keys, cap, "opt")
        for p in ("lru", "fifo", "s3fifo", "s3fifo-paper"):
            assert opt <= es.simulate(keys, cap, p)[1]


def test_next_use():
    assert es.next_use(np.array([3, 1, 3, 3, 1])).tolist() == [2, 4, 3, 5, 5]


def test_zero_capacity_misses_everything():
    assert es.simulate([1, 1, 1], 0, "lru") == (3, 3)
    assert es.simulate([1, 1, 1], 0, "opt") == (3, 3)


# -- memory ---------------------------------------------------------------------------------------


MEM = bm.Geometry(layers=2, kv_heads=1, head_dim=8, page_size=4)


def test_mlx_lm_grows_in_steps_of_256():
    bpt = MEM.bytes_per_token
    assert bpt == 2 * 2 * 1 * 8 * 4
    assert bm.mlx_lm_bytes(MEM, 40, 5, decode=False) == 256 * bpt
    assert bm.mlx_lm_bytes(MEM, 250, 10, decode=True) == 512 * bpt  # 257th token adds a step


@pytest.mark.parametrize("n", [1, 2, 4])
def test_paged_sharing_holds_the_prefix_once(n):
    used, data, pages = bm.paged_bytes(MEM, prefix=42, own=5, n=n)
    # 10 full shared pages + the 2-token tail copied (last fork writes in place) + 5 own: 2 pages
    assert pages == 10 + 2 * n
    assert used == pages * MEM.page_bytes
    assert data == (42 + n * 5 + (n - 1) * 2) * MEM.bytes_per_token  # tail copies: n - 1
    copies = n * bm.exact_bytes(MEM, 47)
    if n > 1:
        assert used < copies
    assert data >= bm.exact_bytes(MEM, 42 + n * 5)


def test_run_rows():
    rows = bm.run(MEM, prefix=42, own=5, ns=(1, 4), decode=False)
    assert [r.n for r in rows] == [1, 4]
    four = rows[1]
    assert four.mlx_lm == 4 * rows[0].mlx_lm and four.exact == 4 * 47 * MEM.bytes_per_token
    assert four.paged < four.exact < four.mlx_lm
    assert math.isclose(four.ideal, (42 + 20) * MEM.bytes_per_token)
    assert "| 4 |" in bm.table(rows, "N")


def test_raw_result_keeps_every_row_in_bytes():
    shared = bm.run(MEM, prefix=42, own=5, ns=(1, 4), decode=False)
    out = json.loads(json.dumps(bm.raw(MEM, 42, {"shared_prefix": (5, shared)})))
    assert out["geometry"]["bytes_per_token"] == MEM.bytes_per_token
    assert out["geometry"]["page_bytes"] == MEM.page_bytes
    assert out["prefix"] == 42 and out["shared_prefix"]["own"] == 5
    assert out["shared_prefix"]["rows"] == [
        {"n": r.n, "tokens": r.tokens, "exact": r.exact, "mlx_lm": r.mlx_lm, "paged": r.paged,
         "paged_data": r.paged_data, "ideal": r.ideal, "pages": r.pages} for r in shared]
