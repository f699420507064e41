"""State points: a model with recurrent state resumes from the last message boundary before a
change, not only where an entry ends (``kv_cache/model/state_points.py``).

Driven through the scheduler (no HTTP) on the tiny qwen3_5 model (gated-delta layers beside
attention layers): a 4-message history is answered, then the same history with one message
edited reuses up to the end of the message before it, in memory and after a restart from disk,
and answers as it does without the cache. A full-attention model (llama) is unaffected.
"""

from __future__ import annotations

import pytest

from kv_cache.model import state_points
from kv_cache.tiers.disk.store import DiskStore
from kv_cache.manager import CacheManager
from kv_cache.pages.pool import PagePool
from kv_cache.tokens import common_prefix
from mlx_kvserver.chat.output import Accepted
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from mlx_kvserver.engine.request import Request
from mlx_kvserver.engine.runner import Runner
from mlx_kvserver.engine.scheduler import Scheduler
from tests.engine.test_scheduler import Collect, run, text
from harness.tiny_families import make_tiny_family_dir

PAGE = 8


@pytest.fixture(scope="module")
def qwen(tmp_path_factory) -> LoadedModel:
    return resolve_and_load(str(make_tiny_family_dir(tmp_path_factory.mktemp("q"), "qwen3_5")))


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> LoadedModel:
    return resolve_and_load(str(make_tiny_family_dir(tmp_path_factory.mktemp("l"), "llama")))


def sched(lm: LoadedModel, root=None, prefill_chunk: int = 256) -> Scheduler:
    pool = PagePool(spec=lm.cache_spec, page_size=PAGE, max_bytes=64 << 20,
                    fingerprint=lm.fingerprint)
    store = None if root is None else DiskStore(root, fingerprint=lm.fingerprint,
                                                spec=lm.cache_spec, page_size=PAGE,
                                                max_bytes=1 << 28)
    manager = CacheManager(pool, store)
    s = Scheduler(manager, Runner(lm.model, manager, lm.name), prefill_chunk=prefill_chunk)
    s.lm = lm  # for ask()
    return s


def history(n: int = 4, edit: int | None = None, ids: bool = True) -> list[dict]:
    roles = ["system"] + ["user", "assistant"] * n
    msgs = []
    for i in range(n):
        content = text(300 + i, 12 + 3 * i) if i != edit else "something else entirely"
        msgs.append({"role": roles[i], "content": content})
        if ids:
            msgs[-1]["message_id"] = f"m{i}" if i != edit else f"m{i}-edited"
    return msgs


def ask(s: Scheduler, msgs: list[dict], use_cache: bool = True) -> tuple[str, Accepted]:
    """The greedy answer to ``msgs`` and what the cache gave its prompt."""
    job = Collect({"messages": msgs, "max_tokens": 12, "temperature": 0,
                   "use_kv_cache": use_cache}, s.lm)
    run(s, {0: [job]})
    assert not job.errors()
    (accepted,) = [e for e in job.log if isinstance(e, Accepted)]
    return job.answers()[0][0], accepted


def prompt_of(lm: LoadedModel, msgs: list[dict]) -> list[int]:
    job = Collect({"messages": msgs, "max_tokens": 12, "temperature": 0}, lm)
    return Request(job, 0).prompt


def points_held(s: Scheduler) -> dict[int, str]:
    held = filter(state_points.is_point, s.manager.keys())
    return {len(s.manager.get(k).tokens): k for k in held}


@pytest.mark.parametrize("edit", [1, 2, 3])
def test_an_edited_message_resumes_from_the_boundary_before_it(qwen, edit):
    s = sched(qwen)
    first = history()
    ask(s, first)
    bounds = state_points.boundaries(prompt_of(qwen, first), qwen.tokenizer.eos_token_ids)
    assert len(bounds) == 4  # where each message ends (the generation prompt follows the last)
    assert sorted(points_held(s)) == bounds
    edited = history(edit=edit)
    warm, accepted = ask(s, edited)
    # Message ``edit`` (0-based) changed: the state after message ``edit - 1`` is reused; no
    # entry ends before the change, so without state points this was 0.
    assert accepted.cached_tokens == bounds[edit - 1] > 0
    assert accepted.source.startswith("entry:\x00state:")
    cold, none = ask(sched(qwen), edited, use_cache=False)
    assert none.cached_tokens == 0
    assert warm == cold  # invariant 4


def test_without_message_ids_too(qwen):
    s = sched(qwen)
    ask(s, history(ids=False))
    warm, accepted = ask(s, history(edit=2, ids=False))
    bounds = state_points.boundaries(prompt_of(qwen, history(ids=False)),
                                     qwen.tokenizer.eos_token_ids)
    assert accepted.cached_tokens == bounds[1]
    assert warm == ask(sched(qwen), history(edit=2, ids=False), use_cache=False)[0]


def test_after_a_restart_from_disk(qwen, tmp_path):
    s = sched(qwen, tmp_path)
    ask(s, history())
    s.manager.close()
    s = sched(qwen, tmp_path)  # a new pool, manager and scheduler over the same directory
    bounds = state_points.boundaries(prompt_of(qwen, history()), qwen.tokenizer.eos_token_ids)
    warm, accepted = ask(s, history(edit=2))
    assert accepted.cached_tokens == bounds[1]
    assert accepted.source.startswith("disk:\x00state:")
    assert warm == ask(sched(qwen), history(edit=2), use_cache=False)[0]
    # By content too: a prompt with no message ids finds the state point on disk by where it
    # ends (the store's index; no key names it).
    s.manager.close()
    s = sched(qwen, tmp_path)
    warm, accepted = ask(s, history(edit=3, ids=False))
    assert accepted.cached_tokens == bounds[2]
    assert warm == ask(sched(qwen), history(edit=3, ids=False), use_cache=False)[0]
    s.manager.close()


def test_a_prompt_snapshots_its_first_and_last_boundaries_only(qwen):
    assert state_points.choose(list(range(1, 20)), 0, 30, k=4) == [1, 17, 18, 19]
    assert state_points.choose([5, 10, 15], 10, 30) == [15]  # after the reused prefix only
    assert state_points.choose([5, 10, 30], 0, 30) == [5, 10]  # the prompt's end is an entry
    s = sched(qwen, prefill_chunk=64)
    long = history(n=12)
    ask(s, long)
    bounds = state_points.boundaries(prompt_of(qwen, long), qwen.tokenizer.eos_token_ids)
    assert len(bounds) == 12 > state_points.K
    assert sorted(points_held(s)) == bounds[:1] + bounds[-(state_points.K - 1):]
    # The next turn of the same chat keeps its earlier points and adds its new boundaries'.
    nxt = long + [{"role": "assistant", "content": "fine", "message_id": "a"},
                  {"role": "user", "content": "and then?", "message_id": "u"}]
    _, accepted = ask(s, nxt)
    assert accepted.cached_tokens == len(prompt_of(qwen, long))
    assert len(points_held(s)) == state_points.K + 2  # where "fine" and the question end


def test_memory_of_a_snapshot(qwen):
    s = sched(qwen)
    ask(s, history())
    per = state_points.snapshot_bytes(qwen.cache_spec)
    held = [s.manager.get(k).state for k in filter(state_points.is_point, s.manager.keys())]
    assert held and all(sum(a.nbytes for arrays in st for a in arrays) == per for st in held)
    layers = len(qwen.cache_spec.states)
    print(f"\nqwen3_5 tiny: one state snapshot {per} bytes ({layers} recurrent layers, "
          f"{per // layers} bytes each); a prompt's points at most {state_points.K} x {per} = "
          f"{state_points.K * per} bytes")


def test_full_attention_is_unaffected(llama):
    s = sched(llama)
    first = history()
    ask(s, first)
    assert not points_held(s)
    warm, accepted = ask(s, history(edit=2))
    # The stored prompt's tokens up to where they differ, as before (no state to restore).
    common = common_prefix(prompt_of(llama, first), prompt_of(llama, history(edit=2)))
    assert accepted.cached_tokens == common
    assert not points_held(s)
    assert warm == ask(sched(llama), history(edit=2), use_cache=False)[0]
