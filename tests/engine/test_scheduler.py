"""Continuous batching: every request's answer is the one it gets alone, whatever runs beside it.

The scheduler is driven step by step here (no threads, no HTTP) over tiny random-weight models
of several cache layouts: full attention (llama), sliding windows with full layers (gemma3),
KV-shared layers (gemma4) and recurrent state beside attention (qwen3_5).
"""

from __future__ import annotations

import logging
import random

import pytest

from kv_cache import open_cache
from kv_cache.pages.pool import PagePool
from mlx_kvserver.api.openai_chat import parse
from mlx_kvserver.chat.output import Done, Error, Finish, Start
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from mlx_kvserver.engine.request import Job
from mlx_kvserver.engine.runner import Runner
from mlx_kvserver.engine.scheduler import Scheduler
from harness.tiny_families import make_tiny_family_dir

FAMILIES = ("llama", "gemma3_text", "gemma4_text", "qwen3_5")
WORDS = "the sea and mountains are old but rivers run fast over stones in winter light".split()


class Collect(Job):
    """A job whose events are kept in a list (the engine thread is the test itself: ``step``
    hands them over)."""

    def __init__(self, body: dict, lm: LoadedModel):
        super().__init__(parse(body, ServerConfig(max_tokens=16, temperature=0.0)), lm,
                         loop=None)
        self.log: list = []

    def send(self, event) -> None:
        self.log.append(event)

    def answers(self) -> dict[int, tuple[str, str]]:
        return {e.index: (e.text, e.reason) for e in self.log if isinstance(e, Finish)}

    @property
    def finished(self) -> bool:
        return any(isinstance(e, Done) for e in self.log)

    @property
    def started(self) -> bool:
        return any(isinstance(e, Start) for e in self.log)

    def errors(self) -> list:
        return [e.error for e in self.log if isinstance(e, Error)]


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request, tmp_path_factory) -> LoadedModel:
    path = make_tiny_family_dir(tmp_path_factory.mktemp(request.param), request.param)
    return resolve_and_load(str(path))


def scheduler(lm: LoadedModel, max_bytes: int = 64 << 20, **kw) -> Scheduler:
    manager = open_cache(lm.cache_spec, lm.fingerprint, page_size=8, max_ram_bytes=max_bytes,
                         policy="lru", disk_dir=None, max_disk_bytes=0, max_resident=4)
    return Scheduler(manager, Runner(lm.model, manager, lm.name), **kw)


def step(s: Scheduler) -> None:
    """One step, its events handed to their jobs (the engine's part)."""
    for job, event in s.step():
        job.send(event)


def text(seed: int, n: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


DOC = text(0, 60)


def body(i: int, shared: bool, max_tokens: int, **extra) -> dict:
    msgs = [{"role": "system", "content": DOC if shared else text(100 + i, 60),
             "message_id": f"sys-{i}"},
            {"role": "user", "content": text(200 + i, 3 + i), "message_id": f"u-{i}"}]
    return {"messages": msgs, "max_tokens": max_tokens, "temperature": 0, **extra}


def run(s: Scheduler, joins: dict[int, list[Collect]], cancel: dict[int, Collect] = {},
        limit: int = 2000) -> dict:
    """Step until every job is done; ``joins[k]`` arrive before step ``k``. Returns the largest
    batch seen and whether shared views were in use while decoding."""
    seen = {"batch": 0, "views": 0}
    jobs = [j for js in joins.values() for j in js]
    for i in range(limit):
        for job in joins.get(i, []):
            s.add(job)
        if i in cancel:
            cancel[i].cancel()
        if not s.busy and i > max(joins):
            break
        step(s)
        seen["batch"] = max(seen["batch"], s.batch_size)
        if s.manager.views is not None:
            seen["views"] = max(seen["views"], len(s.manager.views.views))
    assert all(j.finished for j in jobs), "the scheduler stopped with work left"
    return seen


def alone(lm: LoadedModel, b: dict) -> dict:
    job = Collect(b, lm)
    run(scheduler(lm), {0: [job]})
    return job.answers()


def test_batches_of_one_to_eight_answer_as_each_request_alone(lm):
    """Eight requests (five on a shared document, three not; different lengths) arrive over
    several steps and leave when done: batches grow from 1 to 8 and shrink, mixing prompt chunks
    and decode steps, and every answer equals the request's answer alone, token for token."""
    bodies = [body(i, shared=i % 3 != 2, max_tokens=48 + 2 * i) for i in range(8)]
    want = [alone(lm, b) for b in bodies]
    s = scheduler(lm, prefill_chunk=64)
    jobs = [Collect(b, lm) for b in bodies]
    seen = run(s, {0: jobs[:2], 1: jobs[2:3], 3: jobs[3:6], 6: jobs[6:]})
    assert [j.answers() for j in jobs] == want
    assert seen["batch"] == 8, ([j.answers() for j in jobs], seen)
    # (a model with recurrent state reuses only whole entries, with their state snapshot)
    if any(g.kind.reads_all for g in lm.cache_spec.groups) and not lm.cache_spec.has_state:
        assert seen["views"] >= 1, "the shared document was never read through a view"


def test_shared_prefix_is_read_once_while_sequences_decode(lm):
    """While eight conversations on one document decode together, their full-attention layers
    hold only their own positions: the document is one view, not eight buffers."""
    s = scheduler(lm)
    jobs = [Collect(body(i, shared=True, max_tokens=60), lm) for i in range(8)]
    for j in jobs:
        s.add(j)
    for _ in range(100):
        step(s)
        if all(r.choices for r in s.requests):
            break
    assert len(s.decoding) >= 6  # (a random-weight model may end an answer early)
    views = s.manager.views.views
    # (recurrent state too: the state after the document's message is kept, state_points.py)
    assert len(views) == 1
    doc_len = views[0].length
    for c in s.decoding:
        assert c.seq.view is views[0] and c.seq.view_len == doc_len
        for layer in c.seq.paged_layers:
            if not layer.window:
                assert layer.base == doc_len
                own = layer.offset - layer.base
                assert 0 < own < doc_len
                assert layer.keys.shape[2] - own <= layer.step  # own positions and room
    while s.busy:
        step(s)


def test_cancelled_request_leaves_the_others_exact_and_frees_its_sequences(lm):
    bodies = [body(i, shared=True, max_tokens=14) for i in range(4)]
    want = [alone(lm, b) for b in bodies]
    s = scheduler(lm)
    jobs = [Collect(b, lm) for b in bodies]
    run(s, {0: jobs}, cancel={12: jobs[1]})
    for i in (0, 2, 3):
        assert jobs[i].answers() == want[i]
    assert jobs[1].answers() == {} and jobs[1].finished
    assert s.decoding == [] and s.requests == []


def test_n_choices_are_siblings_decoded_together(lm):
    """``n = 3`` greedy: three siblings forked from the prompt, in one batch, each the answer
    the request gets with n = 1."""
    want = alone(lm, body(1, shared=True, max_tokens=10))[0]
    s = scheduler(lm)
    job = Collect(body(1, shared=True, max_tokens=10, n=3), lm)
    seen = run(s, {0: [job]})
    assert job.answers() == {0: want, 1: want, 2: want}
    assert seen["batch"] == 3


def test_seeded_sampling_is_the_same_alone_and_in_a_batch(lm):
    sampled = body(5, shared=True, max_tokens=12, temperature=0.9, seed=1234)
    want = alone(lm, sampled)
    s = scheduler(lm)
    jobs = [Collect(body(i, shared=True, max_tokens=12), lm) for i in range(3)]
    job = Collect(sampled, lm)
    run(s, {0: jobs, 2: [job]})
    assert job.answers() == want


def test_long_prompt_runs_in_chunks_between_decode_steps(lm):
    """A long prompt arriving mid-stream is read one chunk per step: the running stream gets a
    token at every step meanwhile."""
    s = scheduler(lm, prefill_chunk=8)
    first = Collect(body(0, shared=False, max_tokens=40), lm)
    s.add(first)
    while not s.decoding:
        step(s)
    running = s.decoding[0]
    long = Collect(body(1, shared=False, max_tokens=4), lm)
    s.add(long)
    chunks = 0
    while not long.started:
        before = len(running.tokens)
        step(s)
        chunks += 1
        assert len(running.tokens) == before + 1 or running.done
    assert chunks >= 4  # the long prompt took several steps
    while s.busy:
        step(s)


def test_out_of_pages_preempts_the_youngest_and_every_answer_stays_exact(lm, caplog):
    """A page budget that holds about one conversation: the scheduler preempts the youngest
    running choice (recomputed later), and every answer is still the one it gets alone."""
    bodies = [body(i, shared=False, max_tokens=10) for i in range(3)]
    want = [alone(lm, b) for b in bodies]
    pool = PagePool(spec=lm.cache_spec, page_size=8, max_bytes=1 << 30)
    one = sum(pool.group_page_bytes) * 24  # ~24 pages per group: one prompt and its answer
    s = scheduler(lm, max_bytes=one, prefill_chunk=16)
    jobs = [Collect(b, lm) for b in bodies]
    caplog.set_level(logging.INFO, logger="mlx_kvserver.engine")
    run(s, {0: jobs})
    assert [j.answers() for j in jobs] == want
    assert all(not j.errors() for j in jobs)
    assert "preempted" in caplog.text


def test_short_prompts_are_read_together_and_answer_as_alone(lm):
    """Four short prompts arriving at once (a chunk holds them all) are read in one forward
    pass, right-padded, when the model has no recurrent state (its state would take in the
    padding); every answer is still its answer alone."""
    bodies = [{"messages": [{"role": "user", "content": text(300 + i, 2 + 3 * i)}],
               "max_tokens": 8, "temperature": 0} for i in range(4)]
    want = [alone(lm, b) for b in bodies]
    s = scheduler(lm, prefill_chunk=512)
    jobs = [Collect(b, lm) for b in bodies]
    for j in jobs:
        s.add(j)
    step(s)
    started = sum(1 for j in jobs if j.started)
    # (with recurrent state, one at a time; its piece also stops where its message ends, at
    # a state point: kv_cache/model/state_points.py)
    assert started <= 1 if lm.cache_spec.has_state else started == 4
    run(s, {0: []})
    assert [j.answers() for j in jobs] == want


def test_max_batch_caps_the_running_answers_and_the_rest_wait(lm):
    bodies = [body(i, shared=True, max_tokens=10) for i in range(4)]
    want = [alone(lm, b) for b in bodies]
    s = scheduler(lm, max_batch=2)
    jobs = [Collect(b, lm) for b in bodies]
    seen = run(s, {0: jobs})
    assert seen["batch"] == 2
    assert [j.answers() for j in jobs] == want


def test_a_constrained_answer_decodes_in_the_batch_beside_free_ones(lm):
    """A JSON-schema request (its own grammar mask) and free requests decode together: the free
    answers equal their answers alone, the constrained one equals its own alone and is valid."""
    import json

    schema = {"type": "object", "properties": {"mood": {"enum": ["calm", "wild"]},
                                               "tag": {"type": "string", "maxLength": 6}},
              "required": ["mood", "tag"], "additionalProperties": False}
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    bodies = [body(0, shared=True, max_tokens=40, response_format=fmt),
              body(1, shared=True, max_tokens=40), body(2, shared=False, max_tokens=40)]
    want = [alone(lm, b) for b in bodies]
    jobs = [Collect(b, lm) for b in bodies]
    seen = run(scheduler(lm), {0: jobs})
    assert [j.answers() for j in jobs] == want
    assert seen["batch"] == 3
    text, reason = jobs[0].answers()[0]
    assert reason == "stop" and json.loads(text)["mood"] in ("calm", "wild")
