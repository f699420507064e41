"""The memory budget at work (engine/pressure.py, engine/scheduler.py), on real server processes
where it matters: a request that cannot fit even alone is refused with the figures and the next
is answered; long prompts at once under a small limit all finish with the answers each gets
alone; a preempted answer goes on from its saved pages with the same answer; a cancelled answer
keeps what it computed."""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import mlx.core as mx
import pytest

from mlx_kvserver.engine.memory import MemoryBudget
from mlx_kvserver.engine.pressure import Pressure
from tests.engine.test_memory import fill_mlx_cache
from tests.engine.test_scheduler import Collect, run, scheduler
from harness.server_procs import HTTP, Server

WORDS = "the river runs past old stone walls and quiet gardens under a grey sky".split()


def long_text(n_words: int, seed: int) -> str:
    return " ".join(WORDS[(i * 7 + seed) % len(WORDS)] for i in range(n_words))


def chat(url: str, content: str, max_tokens: int, **kw) -> httpx.Response:
    return HTTP.post(f"{url}/v1/chat/completions", timeout=300, json={
        "model": "default", "max_tokens": max_tokens, "temperature": 0,
        "messages": [{"role": "user", "content": content}], **kw})


def stream_until(url: str, content: str, max_tokens: int, pieces: int,
                 timeout: float = 300) -> tuple[list[str], str]:
    """A streamed greedy answer the client leaves after ``pieces`` content pieces (an agent
    interrupted): the pieces and the answer's message id."""
    got: list[str] = []
    with HTTP.stream("POST", f"{url}/v1/chat/completions", timeout=timeout, json={
            "model": "default", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "messages": [{"role": "user", "content": content}]}) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                delta = json.loads(line[6:])["choices"]
                if delta and delta[0]["delta"].get("content"):
                    got.append(delta[0]["delta"]["content"])
            if len(got) >= pieces:
                break  # the client goes away mid-answer
    return got, json.loads(line[6:])["message_id"]


def memory(url: str) -> dict:
    stats = HTTP.get(f"{url}/v1/kv_cache/stats").json()["models"]
    return next(iter(stats.values()))["memory"]


@pytest.fixture
def serve(tiny_model_dir, tmp_path):
    servers = []

    def start(*extra: str) -> Server:
        s = Server(tiny_model_dir, tmp_path / f"kv{len(servers)}", tmp_path / f"s{len(servers)}.log",
                   *extra, warm=True).start()
        servers.append(s)
        return s
    yield start
    for s in servers:
        s.stop()


def test_a_request_too_large_is_refused_with_the_figures_and_the_next_is_answered(serve):
    s = serve("--memory-limit", "0.003", "--memory-reserve", "0")  # MLX's bytes alone
    big = chat(s.url, long_text(240, 1), 800)  # ~1,200 prompt tokens of the tiny tokenizer
    assert big.status_code == 400, big.text
    err = big.json()["error"]
    assert err["code"] == "insufficient_memory" and "GB" in err["message"]
    assert "--memory-limit" in err["message"]
    anthropic = HTTP.post(f"{s.url}/v1/messages", timeout=60, json={
        "model": "default", "max_tokens": 800,
        "messages": [{"role": "user", "content": long_text(240, 1)}]})
    assert anthropic.status_code == 400 and anthropic.json()["type"] == "error"
    ok = chat(s.url, "hello there", 8)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 8
    assert memory(s.url)["refused"] == 2


def test_long_prompts_at_once_under_a_small_limit_all_finish_as_alone(serve):
    prompts = [long_text(150, k) for k in range(4)]  # ~750 tokens each
    roomy = serve()
    alone = [chat(roomy.url, p, 24, use_kv_cache=False).json() for p in prompts]
    rest = memory(roomy.url)["mlx_active_bytes"]
    roomy.stop()
    # room for about one of them at a time beyond what the server holds at rest
    tight = serve("--memory-limit", f"{(rest + (3 << 20)) / (1 << 30):.6f}",
                  "--memory-reserve", "0")
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: chat(tight.url, p, 24), prompts))
    assert all(r.status_code == 200 for r in together), [r.text for r in together]
    assert [r.json()["choices"][0]["message"]["content"] for r in together] == \
        [a["choices"][0]["message"]["content"] for a in alone]
    assert memory(tight.url)["pressure_events"] > 0  # the budget was what decided


def test_a_preempted_answer_goes_on_from_its_saved_pages_with_the_same_answer(tiny_lm,
                                                                           monkeypatch):
    body = lambda k: {"model": tiny_lm.name, "max_tokens": 24, "temperature": 0,
                      "messages": [{"role": "user", "content": long_text(60, k)}]}
    free = scheduler(tiny_lm)
    want = [Collect(body(k), tiny_lm) for k in range(3)]
    run(free, {0: want})
    budget = MemoryBudget(1 << 30)
    budget.add_model(tiny_lm)
    s = scheduler(tiny_lm, memory=budget, name=tiny_lm.name)
    budget.shedders[tiny_lm.name] = s.shed
    short = {"on": False}
    real = budget.in_use
    monkeypatch.setattr(budget, "in_use", lambda: budget.limit + 1 if short["on"] else real())
    saved: list = []
    orig = s.preempt
    monkeypatch.setattr(s, "preempt", lambda c, save=False: (saved.append((c, save)),
                                                             orig(c, save)))
    jobs = [Collect(body(k), tiny_lm) for k in range(3)]
    for j in jobs:
        s.add(j)
    steps = 0
    while s.busy:
        short["on"] = 6 <= steps < 8  # memory runs short for two steps mid-answer
        for job, ev in s.step():
            job.send(ev)
        steps += 1
    assert [j.answers() for j in jobs] == [w.answers() for w in want]
    assert len(saved) >= 2 and all(save for _, save in saved)  # the newest answers went
    assert s.manager.report()["hits"] > 0


def test_a_cancelled_answer_keeps_what_it_computed(serve):
    s = serve()
    question = long_text(200, 3)
    _, mid = stream_until(s.url, question, 200, 40, timeout=120)
    HTTP.get(f"{s.url}/health")  # the server saw the client go and ended the answer
    for _ in range(100):
        entry = HTTP.get(f"{s.url}/v1/kv_cache/{mid}")
        if entry.status_code == 200:
            break
        time.sleep(0.05)
    assert entry.status_code == 200, entry.text  # the partial answer, saved as a finished one
    prompt = chat(s.url, question, 1).json()["usage"]["prompt_tokens"]
    assert entry.json()["tokens"] >= prompt + 40  # its prompt and at least what was streamed


def test_an_interrupted_answer_sent_back_is_read_from_the_cache(tmp_path):
    """What an agent does when its user presses Escape mid-answer (Claude Code, tried): the
    partial answer comes back as the assistant's turn of the next prompt. Its tokens are read
    from the cache, not computed again (the default model: its text round-trips to its tokens)."""
    s = Server("default", tmp_path / "kv", tmp_path / "s.log", warm=True).start()
    try:
        question = "Write a short story about a lighthouse keeper."
        got, _ = stream_until(s.url, question, 300, 60)
        HTTP.get(f"{s.url}/health")
        time.sleep(1.0)  # the server sees the client gone at its next step and saves
        first = chat(s.url, question, 1).json()["usage"]["prompt_tokens"]
        usage = HTTP.post(f"{s.url}/v1/chat/completions", timeout=300, json={
            "model": "default", "max_tokens": 1, "temperature": 0,
            "messages": [{"role": "user", "content": question},
                         {"role": "assistant", "content": "".join(got)},
                         {"role": "user", "content": "Go on."}]}).json()["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        assert cached >= first + 40, (cached, first, usage)  # the partial answer's tokens
    finally:
        s.stop()


def three_prompts(tiny_lm, max_tokens: int, limit: int, **kw):
    """Three long prompts: their answers alone, then a scheduler under a budget of ``limit``
    bytes (``kw``: its settings) and the three jobs to send it."""
    body = lambda k: {"model": tiny_lm.name, "max_tokens": max_tokens, "temperature": 0,
                      "messages": [{"role": "user", "content": long_text(60, k)}]}
    want = [Collect(body(k), tiny_lm) for k in range(3)]
    run(scheduler(tiny_lm), {0: want})
    budget = MemoryBudget(limit, reserve=0)
    budget.add_model(tiny_lm)
    s = scheduler(tiny_lm, memory=budget, name=tiny_lm.name, **kw)
    budget.shedders[tiny_lm.name] = s.shed
    return want, budget, s, [Collect(body(k), tiny_lm) for k in range(3)]


def test_prompts_go_on_one_at_a_time_when_memory_stays_short(tiny_lm, monkeypatch):
    """Memory short at every step (nothing to give back): the oldest prompt goes on in small
    chunks (admission said it fits alone; waiting would wait for nothing, a spin that never
    ends), the others start after it, and every answer is the one it gets alone."""
    want, budget, s, jobs = three_prompts(tiny_lm, 6, 1 << 30, prefill_chunk=64)
    monkeypatch.setattr(budget, "in_use", lambda: budget.limit + 1)  # always short
    started = []
    for j in jobs:
        s.add(j)
    for _ in range(2000):
        if not s.busy:
            break
        started.append(sum(r.seq is not None for r in s.requests))
        for job, ev in s.step():
            job.send(ev)
    assert not s.busy, "the scheduler spun without progress"
    assert [j.answers() for j in jobs] == [w.answers() for w in want]
    assert max(started) == 1  # one prompt read at a time under pressure


def room_once_the_cache_is_back() -> Pressure:
    """A budget whose limit leaves 8 MB beside ~32 MB of MLX's buffer cache: 16 MB more fits
    only once the cache is given back, which ``fits`` must do."""
    budget = MemoryBudget(1 << 40)
    budget.measure_outside()
    fill_mlx_cache()
    budget.limit = budget.in_use() + (8 << 20)
    p = Pressure(budget)
    assert p.fits(16 << 20) and mx.get_cache_memory() == 0
    return p


def test_mlx_buffer_cache_is_given_back_before_a_pass_is_refused_room():
    p = room_once_the_cache_is_back()
    assert not p.fits(p.memory.limit)  # nothing left to give back: no



def test_admission_keeps_the_margin(tiny_lm):
    """A request whose floor fits the limit only if the margin kept for what grows between two
    checks is spent is refused (400, the figures); a little less is admitted."""
    from types import SimpleNamespace

    from mlx_kvserver.errors import RequestError

    budget = MemoryBudget(1 << 40)
    budget.add_model(tiny_lm)
    budget.measure_outside()
    assert budget.margin > 0
    p = Pressure(budget, tiny_lm.name)
    r = SimpleNamespace(prompt=[5] * 400, max_tokens=1, prompt_param="messages", id="r")
    need = budget.request_floor(tiny_lm.name, 400, 1)
    budget.limit = budget.weights_total + budget.outside + need  # fits without the margin only
    with pytest.raises(RequestError) as e:
        p.admit(r)
    assert e.value.status == 400 and e.value.code == "insufficient_memory"
    assert e.value.param == "messages"  # the prompt is the cause: it names the prompt
    budget.limit += budget.margin
    assert p.admit(r) == 1


def test_an_answer_that_cannot_fit_whole_is_capped_not_refused(tiny_lm):
    """``max_tokens`` is a cap, not a reservation: a prompt that fits with a shorter answer is
    admitted with the answer capped where memory ends (it finishes with ``length``, as at the
    context's end); only a prompt that cannot fit even with one answer token is refused."""
    from types import SimpleNamespace

    budget = MemoryBudget(1 << 40)
    budget.add_model(tiny_lm)
    budget.measure_outside()
    p = Pressure(budget, tiny_lm.name)
    floor = lambda answer: budget.request_floor(tiny_lm.name, 400, answer)
    budget.limit = budget.weights_total + budget.outside + budget.margin + floor(300)
    r = SimpleNamespace(prompt=[5] * 400, max_tokens=5000, prompt_param="messages", id="r")
    assert p.admit(r) == 300  # the most that fits: one more would not
    assert budget.refused == 0
    roomy = SimpleNamespace(prompt=[5] * 400, max_tokens=200, prompt_param="messages", id="q")
    assert p.admit(roomy) == 200  # what fits whole is left as asked


def test_prompts_waiting_for_memory_wait_without_a_time_limit(tiny_lm, monkeypatch, caplog):
    """Three long prompts at once where one fits at a time: the others wait for the answers
    running ahead of them, however long the clock says that takes (a queue has no time limit:
    a 503 after a minute failed a request that could be answered), each is logged once as
    waiting for memory, and every answer is the one it gets alone."""
    import logging
    import time as time_module

    want, budget, s, jobs = three_prompts(tiny_lm, 12, 1 << 40)
    floor = 64 << 20  # each request's floor: one fits beside what is held, two do not
    monkeypatch.setattr(budget, "request_floor", lambda *a: floor)
    budget.limit = budget.in_use() + floor + floor // 2
    now = [time_module.monotonic()]

    def clock() -> float:  # every look at the clock: ten more minutes went by
        now[0] += 600.0
        return now[0]
    monkeypatch.setattr(time_module, "monotonic", clock)
    for j in jobs:
        s.add(j)
    started, waits = [], []
    with caplog.at_level(logging.INFO, logger="mlx_kvserver.engine"):
        for _ in range(2000):
            if not s.busy:
                break
            started.append(sum(r.seq is not None for r in s.requests))  # prompts reading
            waits.append(s.waiting()["memory"])
            for job, ev in s.step():
                job.send(ev)
    assert not s.busy
    assert all(not j.errors() for j in jobs), [j.errors() for j in jobs]
    assert [j.answers() for j in jobs] == [w.answers() for w in want]
    assert max(waits) == 2 and max(started) == 1  # one prompt at a time; the others waited
    logged = [m for m in caplog.messages if "waits for memory" in m]
    assert len(logged) == 2, logged  # once each, not every step
    assert len([m for m in caplog.messages if "starts after" in m]) == 2


def test_mlx_buffer_cache_given_back_lowers_resident_memory_also_from_a_trimmed_heap():
    """After a trim (the engine's at rest) the C heap keeps free chunks whose pages went back
    to the system; MLX's next buffers are carved from them, and freeing those buffers leaves
    their pages resident until the heap is trimmed again. Giving the cache back under pressure
    trims too, so the resident memory the budget reads falls (before, a pass that fitted once
    the cache was back was refused room)."""
    from mlx_kvserver.platform import heap

    if not heap.available():
        pytest.skip("this allocator cannot hand free pages back (not glibc or macOS)")
    chunks = [bytes(600) for _ in range(120_000)]  # ~70 MB of heap in small chunks, then free
    del chunks
    heap.give_back()  # their pages go back; the chunks stay in the heap, free
    room_once_the_cache_is_back()
