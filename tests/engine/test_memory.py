"""The memory budget (engine/memory.py): the default limit from the machine's memory facts (a
Mac's and Linux's figures on any machine: platform/memory_facts.py), MLX's limits set from it,
admission on those figures, the weights counted per model, and a forward pass's peak estimated
from its shape against what MLX measures (``mx.get_peak_memory``)."""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from kv_cache import open_cache
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.engine import Engine
from mlx_kvserver.engine.memory import (DEFAULT_FRACTION, GB, MARGIN, PASS_ROOM,
                                        MemoryBudget, Shape, default_limit, weights_bytes)
from mlx_kvserver.engine.pressure import Pressure
from mlx_kvserver.engine.runner import Runner
from mlx_kvserver.errors import RequestError
from mlx_kvserver.platform.memory_facts import MemoryFacts, current
from tests.platform.test_memory_facts import MAC_32GB

WORKING_SET = MAC_32GB["max_recommended_working_set_size"]  # 21.3 GB of a 32 GB Mac


def facts(system: str, outside: dict, working_set: int | None = None, total: int = 32 * GB):
    """A machine's memory facts: the process holds MLX's bytes and ``outside["bytes"]`` more
    (a Mac's footprint and Linux's resident set both count MLX's buffers)."""
    return MemoryFacts(system, total, working_set, lambda: int(
        mx.get_active_memory() + mx.get_cache_memory() + outside["bytes"]),
        "phys_footprint" if system == "Darwin" else "rss")


def test_the_default_limit_is_a_fraction_of_the_machine_or_of_metals_working_set():
    here = current()
    assert default_limit() == int(here.budget_base * DEFAULT_FRACTION) == MemoryBudget().limit
    mac = MemoryBudget(facts=facts("Darwin", {"bytes": 0}, WORKING_SET))
    assert mac.limit == int(WORKING_SET * DEFAULT_FRACTION)
    assert round(mac.limit / GB, 2) == 16.0  # of the working set, not 24 GB of the machine
    linux = MemoryBudget(facts=facts("Linux", {"bytes": 0}))
    assert linux.limit == int(32 * GB * DEFAULT_FRACTION) == 24 * GB
    report = mac.report()
    assert report["machine_bytes"] == 32 * GB and report["metal_working_set_bytes"] == WORKING_SET
    assert linux.report()["metal_working_set_bytes"] is None
    assert MemoryBudget(8 * GB, facts=mac.facts).limit == 8 * GB  # --memory-limit


@pytest.fixture
def mlx_limits(monkeypatch):
    """MLX's limits as the budget sets them, recorded instead of set."""
    calls: list[tuple[str, int]] = []
    for name in ("set_memory_limit", "set_wired_limit", "set_cache_limit"):
        monkeypatch.setattr(mx, name, lambda n, name=name: calls.append((name, int(n))) or 0)
    return calls


def test_the_limits_mlx_is_given_on_a_mac(mlx_limits):
    """On a Mac's figures: MLX's memory limit is the budget (16 GB of the 21.3 GB working set)
    less what the process holds outside MLX and the margin, and follows that as it grows; the
    wired limit is the budget, and never above the system's (MLX refuses more). On Linux's
    figures nothing is wired."""
    outside = {"bytes": 600 << 20}
    budget = MemoryBudget(facts=facts("Darwin", outside, WORKING_SET))
    budget.apply()
    limit = int(WORKING_SET * DEFAULT_FRACTION)
    assert budget.outside == 600 << 20
    assert mlx_limits == [("set_memory_limit", limit - (600 << 20) - MARGIN),
                          ("set_wired_limit", limit)]
    mlx_limits.clear()
    outside["bytes"] += 64 << 20  # the process grows outside MLX (Python, the tokenizers)
    assert budget.in_use() >= mx.get_active_memory() + (664 << 20) + MARGIN
    assert ("set_memory_limit", limit - (664 << 20) - MARGIN) in mlx_limits
    mlx_limits.clear()
    MemoryBudget(28 * GB, facts=facts("Darwin", outside, WORKING_SET)).apply()
    assert ("set_wired_limit", WORKING_SET) in mlx_limits  # --memory-limit above the system's
    mlx_limits.clear()
    MemoryBudget(facts=facts("Linux", outside)).apply()
    assert [name for name, _ in mlx_limits] == ["set_memory_limit"]


def test_a_wired_limit_mlx_refuses_is_logged_not_raised(monkeypatch, caplog):
    def refuse(n):
        raise ValueError("[metal::set_wired_limit] Setting a wired limit larger than the "
                         "maximum working set size is not allowed.")
    monkeypatch.setattr(mx, "set_memory_limit", lambda n: 0)
    monkeypatch.setattr(mx, "set_wired_limit", refuse)
    with caplog.at_level("INFO", logger="mlx_kvserver.engine"):
        MemoryBudget(facts=facts("Darwin", {"bytes": 0}, WORKING_SET)).apply()
    assert "the wired limit was not set" in caplog.text


def test_a_process_whose_memory_cannot_be_read_counts_mlxs_bytes_alone(mlx_limits):
    unknown = MemoryFacts("Darwin", 32 * GB, WORKING_SET, lambda: None, "none")
    budget = MemoryBudget(GB, facts=unknown)
    assert budget.measure_outside() == 0
    assert budget.in_use() == mx.get_active_memory() + mx.get_cache_memory() + MARGIN
    assert not [c for c in mlx_limits if c[0] == "set_memory_limit"]  # nothing to follow


# an 8B model (Llama 3 8B's shape) in 4 bits beside a 12 GB one: 12 GB of weights in all, its
# keys and values 128 KiB a position in float16
EIGHT_B = Shape(hidden=4096, intermediate=14336, heads=32, layers=32, vocab=128256,
                kv_bytes=32 * 2 * 8 * 128 * 2, dtype_bytes=2)


@pytest.mark.parametrize("system,working_set,long_fits", [
    ("Darwin", WORKING_SET, False),  # 16 GB: 12 GB of weights leave ~3.4 GB for requests
    ("Linux", None, True)])  # 24 GB of the same 32 GB machine: ~11.4 GB
def test_admission_on_a_macs_figures(system, working_set, long_fits, mlx_limits):
    """Admission refuses (400, with the figures) a prompt that cannot fit even alone on a
    32 GB Mac's default limit (of its working set), which the same machine's memory would
    hold without Metal; a prompt that fits is admitted with what it asked for."""
    budget = MemoryBudget(facts=facts(system, {"bytes": 600 << 20}, working_set))
    budget.measure_outside()
    budget.weights["m"], budget.shapes["m"] = 12 * GB, EIGHT_B
    pressure = Pressure(budget, "m")

    def request(prompt: int, answer: int) -> SimpleNamespace:
        return SimpleNamespace(prompt=[1] * prompt, max_tokens=answer, prompt_param="messages",
                               id="r")
    short = request(8000, 512)  # ~2.2 GB: fits both
    assert pressure.admit(short) == 512
    long = request(16384, 256)  # ~4.2 GB for the prompt alone
    if long_fits:
        pressure.admit(long)
        assert budget.refused == 0
        return
    with pytest.raises(RequestError) as e:
        pressure.admit(long)
    assert e.value.status == 400 and e.value.code == "insufficient_memory"
    assert "16.00 GB" in e.value.message and budget.refused == 1


def test_mlx_limit_is_set_from_the_budget(tiny_lm):
    before = mx.get_memory_limit()
    try:
        engine = Engine([tiny_lm], ServerConfig(memory_limit_gb=1.5, kv_cache_dir=None))
        # what the process holds outside MLX (Python, libraries) is set aside from MLX's limit
        outside = engine.memory.outside
        assert 0 < outside < GB and engine.memory.reserve is None
        margin = engine.memory.margin  # and a margin for what grows between two checks
        assert margin == MARGIN > 0
        assert engine.memory.limit == int(1.5 * GB) == mx.get_memory_limit() + outside + margin
        assert engine.memory.weights[tiny_lm.name] == weights_bytes(tiny_lm.model) > 0
        rep = engine.memory_report()
        assert rep["limit_bytes"] == int(1.5 * GB)
        assert rep["weights_bytes"] == engine.memory.weights_total
        stats = engine.cache_stats()[tiny_lm.name]["memory"]
        assert stats["limit_bytes"] == rep["limit_bytes"]
    finally:
        mx.set_memory_limit(before)


def fill_mlx_cache() -> int:
    """~32 MB of freed arrays in MLX's buffer cache (it keeps arrays of up to ~1 MB); its size.
    The cache's limit is raised first (a budget of an earlier test may have bound it)."""
    mx.set_cache_limit(1 << 40)
    a = [mx.arange(1 << 18, dtype=mx.float32) + i for i in range(32)]
    mx.eval(a)
    del a
    cache = mx.get_cache_memory()
    assert cache >= 30 << 20
    return cache


def test_mlx_buffer_cache_is_counted_as_held():
    """Freed arrays MLX keeps for reuse are resident: the peak sweep went 1.6-2.7% over its
    limits by them (~33 MB) while the budget counted them free (an earlier run of
    benchmarks/memory_peak.py, in docs/BENCHMARKS.md's git history)."""
    budget = MemoryBudget(GB)
    budget.measure_outside()
    cache = fill_mlx_cache()
    assert budget.in_use() >= mx.get_active_memory() + cache + budget.outside
    mx.clear_cache()


def test_a_margin_is_kept_for_what_grows_between_checks():
    """The process grows outside MLX between two of the budget's checks (four long prompts at
    once under pressure went ~15 MiB past what the last check saw: earlier runs of
    benchmarks/memory_peak.py, in docs/BENCHMARKS.md's git history):
    the budget counts ``MARGIN`` as held, so a pass that would fill the limit to the byte does
    not fit. With ``--memory-reserve`` (the operator's own figure) no margin is added."""
    budget = MemoryBudget(GB)
    budget.measure_outside()
    floor = mx.get_active_memory() + mx.get_cache_memory() + budget.outside
    assert budget.in_use() >= floor + MARGIN
    assert budget.report()["margin_bytes"] == MARGIN
    fixed = MemoryBudget(GB, reserve=5 << 20)
    assert fixed.margin == 0
    assert fixed.in_use() == mx.get_active_memory() + mx.get_cache_memory() + (5 << 20)


def test_the_process_outside_mlx_is_counted_unless_a_reserve_is_given():
    measured = MemoryBudget(GB)
    outside = measured.measure_outside()
    rss = measured.facts.resident()  # the resident set here; a Mac's footprint
    assert 0 < outside <= rss - mx.get_active_memory() - mx.get_cache_memory() + (16 << 20)
    assert measured.in_use() >= mx.get_active_memory() + outside
    import numpy as np

    limit = mx.get_memory_limit()
    try:
        before = measured.in_use()
        mlx_before = mx.get_memory_limit()
        grown = np.ones(64 << 20, np.uint8)  # serving grows the process outside MLX: counted
        assert measured.in_use() >= before + (60 << 20)
        assert mx.get_memory_limit() <= mlx_before - (56 << 20)  # MLX's limit follows it
        del grown
    finally:
        mx.set_memory_limit(limit)
    fixed = MemoryBudget(GB, reserve=5 << 20)
    assert fixed.measure_outside() == 5 << 20 and fixed.report()["outside_mlx_bytes"] == 5 << 20
    assert MemoryBudget(GB, reserve=0).measure_outside() == 0


def test_mlx_peak_counts_from_the_start_loads_included(tiny_lm):
    """MLX's peak is never reset (issue 54: memory counted from the first byte): what a load
    held at its peak stays in ``mlx_peak_bytes`` once the model joins, and is
    ``load_peak_bytes`` (the load's own, measured as it ended: ``LoadedModel.load_peak``;
    MLX's peak when the model joins for one not measured); serving's own peak adds to it."""
    import dataclasses

    mx.reset_peak_memory()  # this test's start (other tests ran in this process before it)
    budget = MemoryBudget(1 * GB)
    big = mx.zeros((4 << 20,))  # 16 MB held while "loading"
    mx.eval(big)
    del big
    budget.add_model(dataclasses.replace(tiny_lm, load_peak=0))
    rep = budget.report()
    assert rep["load_peak_bytes"] >= 16 << 20
    assert rep["mlx_peak_bytes"] >= 16 << 20  # not started again after the load
    mx.eval(mx.zeros((8 << 20,)))  # 32 MB while serving
    assert budget.report()["mlx_peak_bytes"] >= 32 << 20
    assert budget.report()["load_peak_bytes"] == rep["load_peak_bytes"]


def test_a_load_that_would_not_fit_is_refused_with_its_figures():
    """``check_load``: a load's estimated peak against what the limit leaves beside what the
    process holds now and the margin; refused with the figures, allowed when it fits."""
    from mlx_kvserver.engine.memory import ModelTooLarge
    from mlx_kvserver.models.footprint import LoadEstimate

    budget = MemoryBudget(8 * GB, reserve=0)  # MLX's bytes alone: the figures are exact
    free = budget.limit - int(mx.get_active_memory())
    budget.check_load("small", LoadEstimate(free // 2, free - (1 << 20)))
    with pytest.raises(ModelTooLarge) as e:
        budget.check_load("big", LoadEstimate(free // 2, free + (64 << 20)))
    text = str(e.value)
    assert text.startswith("model big does not fit: its load would hold about ")
    assert f"{(free + (64 << 20)) / (1 << 20):.0f} MiB at its peak" in text
    assert f"memory limit's {8 * 1024} MiB" in text and "raise --memory-limit" in text


@pytest.mark.parametrize("context,chunk,rows", [(0, 256, 1), (512, 256, 1), (1024, 512, 1),
                                                (0, 1024, 1), (600, 5, 8), (1500, 1, 8)])
def test_a_pass_peak_estimate_bounds_what_mlx_measures(tiny_lm, context, chunk, rows):
    """The estimate is at least the measured peak (the budget is never short by it) and at
    most 3x it (it does not refuse what would fit)."""
    m = MemoryBudget(2 * GB)
    m.add_model(tiny_lm)
    manager = open_cache(tiny_lm.cache_spec, tiny_lm.fingerprint, page_size=16,
                         max_ram_bytes=256 << 20, policy="lru", disk_dir=None,
                         max_disk_bytes=0, max_resident=0)
    runner = Runner(tiny_lm.model, manager, tiny_lm.name)
    seqs = []
    for b in range(rows):
        s = manager.new_sequence()
        ids = [(i * 7 + b) % 200 + 3 for i in range(context)]
        for i in range(0, context, 256):
            runner.prefill(s, ids[i:i + 256], logits=False)
        seqs.append(s)
    mx.eval([a for s in seqs for c in s.prepare() for a in (c.state or [])])
    mx.clear_cache()
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    if rows == 1:
        runner.prefill(seqs[0], [5] * chunk)
    else:
        mx.eval(runner.verify(seqs, [[5] * chunk] * rows))
    measured = mx.get_peak_memory() - base
    estimate = m.pass_peak(tiny_lm.name, chunk, context, rows)
    assert measured <= estimate <= 3 * measured, (measured, estimate)
    for s in seqs:
        s.close()


def test_a_request_floor_grows_with_its_length(tiny_lm):
    m = MemoryBudget(GB)
    m.add_model(tiny_lm)
    small, large = m.request_floor(tiny_lm.name, 10, 10), m.request_floor(tiny_lm.name, 1500, 500)
    assert 0 < small < large
    assert large >= 2000 * m.shapes[tiny_lm.name].kv_bytes


def test_shed_gives_back_what_nothing_runs(tiny_lm, tmp_path):
    """A cache sheds its resident sequences, the entries its disk holds and the cached pages
    nothing holds; what has no copy on disk stays."""
    for disk in (tmp_path / "kv", None):
        manager = open_cache(tiny_lm.cache_spec, tiny_lm.fingerprint, page_size=8,
                             max_ram_bytes=64 << 20, policy="lru", disk_dir=disk,
                             max_disk_bytes=1 << 30, max_resident=4)
        runner = Runner(tiny_lm.model, manager, tiny_lm.name)
        seq = manager.new_sequence()
        runner.prefill(seq, list(range(3, 83)))
        manager.save("k", seq)
        manager.keep(seq)
        assert manager.resident_tokens() == 80
        freed = manager.shed()
        assert manager.resident_tokens() == 0
        if disk is not None:
            assert freed > 0 and "k" not in manager and manager.store.get("k") is not None
            assert manager.pool.stats().used_pages == 0
        else:
            assert "k" in manager  # nowhere else to find it: kept
        manager.close()


def test_mlx_buffer_cache_grows_only_into_room_the_budget_has_free():
    """On the CPU backend MLX's memory limit does not hold its buffer cache, which fills during a
    pass between two checks (the peak sweep went ~1.5% over its limits by it): with less free
    than ``PASS_ROOM`` the cache keeps what it holds and no more; with room it may fill."""
    mx.clear_cache()
    before = mx.set_cache_limit(1 << 40)
    try:
        tight = MemoryBudget(1 << 40)
        tight.measure_outside()
        assert tight.cache_limit == -1  # not set before the first check
        tight.limit = tight.in_use() + PASS_ROOM // 2  # less free than a pass's room
        tight.in_use()
        assert tight.cache_limit < 8 << 20  # what the cache holds, no room beyond
        a = [mx.arange(1 << 18, dtype=mx.float32) + i for i in range(32)]
        mx.eval(a)
        del a
        assert mx.get_cache_memory() < 8 << 20  # freed arrays went back, not into the cache
        roomy = MemoryBudget(1 << 40)
        roomy.measure_outside()
        roomy.in_use()
        assert roomy.cache_limit > 1 << 39  # the budget's free room
        fill_mlx_cache()  # asserts ~32 MB kept
    finally:
        mx.set_cache_limit(before)
        mx.clear_cache()
