"""The engine through the real server: cache reuse is exact, verified and cancellable."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

from mlx_kvserver.config import ServerConfig
from harness.server_utils import make_engine, running_server

TURNS = ["Tell me about the sea.", "And the mountains?", "Which is older?", "Say it shorter."]
SYSTEM = {"role": "system", "content": "You are terse.", "message_id": "sys"}


@pytest.fixture(scope="module")
def served(tiny_lm):
    config = ServerConfig(max_tokens=12, page_size=8)
    engine = make_engine([tiny_lm], config)
    with running_server([tiny_lm], config, engine) as url:
        yield url, engine


def converse(client, model, tag, use_cache, turns=TURNS, max_tokens=12):
    messages, out = [dict(SYSTEM, message_id=f"sys-{tag}")], []
    for i, text in enumerate(turns):
        messages.append({"role": "user", "content": text, "message_id": f"{tag}-u{i}"})
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                           temperature=0, extra_body={"use_kv_cache": use_cache})
        msg = r.choices[0].message
        messages.append({"role": "assistant", "content": msg.content,
                         "message_id": msg.model_extra["message_id"]})
        out.append((msg.content, r.usage.prompt_tokens, r.usage.completion_tokens,
                    r.usage.prompt_tokens_details.cached_tokens))
    return out, messages


def test_four_turns_same_answers_with_and_without_cache(served, tiny_lm):
    url, engine = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    cold, _ = converse(client, tiny_lm.name, "cold", use_cache=False)
    warm, _ = converse(client, tiny_lm.name, "warm", use_cache=True)
    assert [c[0] for c in warm] == [c[0] for c in cold]
    assert all(c[3] == 0 for c in cold)
    assert warm[0][3] == 0
    for prev, cur in zip(warm, warm[1:]):
        # Everything up to the previous answer comes from the cache (at least its prompt).
        assert cur[3] >= prev[1], (prev, cur)
        assert cur[3] < cur[1]


def test_edited_message_reuses_only_the_common_prefix(served, tiny_lm):
    url, engine = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    _, messages = converse(client, tiny_lm.name, "edit", use_cache=True, turns=TURNS[:2])
    edited = [dict(m) for m in messages]
    edited[1]["content"] = "Tell me about the desert."  # same message_id, new text
    edited.append({"role": "user", "content": "Go on.", "message_id": "edit-u2b"})
    warm = client.chat.completions.create(model=tiny_lm.name, messages=edited, max_tokens=10,
                                          temperature=0)
    cold = client.chat.completions.create(model=tiny_lm.name, messages=edited, max_tokens=10,
                                          temperature=0, extra_body={"use_kv_cache": False})
    assert warm.choices[0].message.content == cold.choices[0].message.content
    cached = warm.usage.prompt_tokens_details.cached_tokens
    # Only the system prompt and the unchanged start of the first user message can be reused.
    first_user = tiny_lm.tokenizer.encode(tiny_lm.tokenizer.render(
        [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Tell me about the "}], add_generation_prompt=False))
    assert 0 < cached <= len(first_user)


def test_n_greedy_choices_equal_single_answer(served, tiny_lm):
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "count with me", "message_id": "n-u0"}]
    one = client.chat.completions.create(model=tiny_lm.name, messages=msgs, max_tokens=8,
                                         extra_body={"use_kv_cache": False})
    many = client.chat.completions.create(model=tiny_lm.name, messages=msgs, max_tokens=8, n=3)
    assert [c.message.content for c in many.choices] == [one.choices[0].message.content] * 3


def test_stop_string_cuts_the_answer(served, tiny_lm):
    url, _ = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    msgs = [{"role": "user", "content": "stop test"}]
    full = client.chat.completions.create(model=tiny_lm.name, messages=msgs, max_tokens=12)
    text = full.choices[0].message.content
    assert len(text) >= 4, text
    stop = text[2:4]
    cut = client.chat.completions.create(model=tiny_lm.name, messages=msgs, max_tokens=12,
                                         stop=[stop])
    assert cut.choices[0].message.content == text[: text.find(stop)]
    assert cut.choices[0].finish_reason == "stop"


def wait_idle(engine, timeout=30.0):
    deadline = time.monotonic() + timeout
    while engine.busy or engine.queued:
        assert time.monotonic() < deadline, "the worker did not go idle"
        time.sleep(0.05)


def test_disconnect_cancels_generation_and_releases_pages(served, tiny_lm):
    url, engine = served
    manager = engine.managers[tiny_lm.name]
    body = {"messages": [{"role": "user", "content": "a long answer please"}],
            "max_tokens": 100_000, "stream": True}
    with httpx.stream("POST", f"{url}/chat/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 3:
                break  # leave mid-answer
    wait_idle(engine)
    held_by_entries = {b for k in manager.keys() for b in manager.get(k).blocks}
    held = {b for b, n in manager.pool.ref_counts().items() if n > 0}
    assert held <= held_by_entries  # no sequence holds pages after the cancel
    r = httpx.post(f"{url}/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "still there?"}],
                         "max_tokens": 3})
    assert r.status_code == 200


def test_batch_flags_reach_the_scheduler_and_bad_values_are_refused(tiny_lm):
    from mlx_kvserver import flags

    args = flags.build_parser().parse_args(["--max-batch", "2", "--prefill-chunk", "64",
                                            "--no-disk-cache"])
    engine = make_engine([tiny_lm], flags.config_from_args(args))
    scheduler = engine.schedulers[tiny_lm.name]
    assert (scheduler.max_batch, scheduler.prefill_chunk) == (2, 64)
    engine.stop()
    for flag in ("--max-batch", "--prefill-chunk"):
        with pytest.raises(SystemExit, match="must be 1 or more"):
            flags.config_from_args(flags.build_parser().parse_args([flag, "0"]))


def test_the_first_token_goes_out_before_the_next_decode_step(tiny_lm):
    """A streamed answer's first token reaches the client while the engine has not yet run the
    decode step that computes its second (that step is held here until the first token came, or
    for 10 s): time to first token never includes a decode step."""
    import json
    import threading

    config = ServerConfig(max_tokens=4, page_size=8)
    engine = make_engine([tiny_lm], config)
    runner = engine.schedulers[tiny_lm.name].runner
    first_token, decoded = threading.Event(), threading.Event()
    original = runner.decode

    def held_decode(seqs, tokens):
        first_token.wait(timeout=10)
        decoded.set()
        return original(seqs, tokens)

    runner.decode = held_decode
    with running_server([tiny_lm], config, engine) as url:
        body = {"model": tiny_lm.name, "messages": [{"role": "user", "content": "Hello there"}],
                "max_tokens": 4, "temperature": 0, "stream": True, "use_kv_cache": False}
        decoded_before_first = None
        with httpx.stream("POST", url + "/chat/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                delta = json.loads(line[6:])["choices"][0]["delta"]
                if delta.get("content") and decoded_before_first is None:
                    decoded_before_first = decoded.is_set()
                    first_token.set()
        assert decoded_before_first is False, "the first token waited for a decode step"
        assert decoded.is_set()  # the answer went on after it


def test_an_idle_engine_gives_mlx_buffer_cache_back(served, tiny_lm):
    """While answers run, MLX's buffer cache may grow into the budget's free room (freed arrays
    kept for reuse); once nothing runs it goes back to the system (at rest it kept growing:
    1.6 GB of a tiny model's buffers after 200 mixed requests)."""
    import mlx.core as mx

    url, engine = served
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    r = client.chat.completions.create(model=tiny_lm.name, max_tokens=12, temperature=0,
                                       messages=[{"role": "user", "content": "Hello " * 40}])
    assert r.choices[0].message.content is not None
    assert engine.memory.cache_limit > 64 << 20  # it had room to cache: the budget's free part
    deadline = time.monotonic() + 10
    while mx.get_cache_memory() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mx.get_cache_memory() == 0


def test_an_idle_engine_gives_the_c_allocators_free_pages_back(served, tiny_lm, monkeypatch):
    """What the passes and requests freed through the C allocator goes back to the system once
    nothing runs (``platform/heap.py``): kept, such free chunks were most of what a server's
    resident memory grew by over 1,000 mixed requests (earlier runs of
    benchmarks/memory_growth.py, in docs/BENCHMARKS.md's git history)."""
    from mlx_kvserver.platform import heap

    url, engine = served
    calls = []
    monkeypatch.setattr(heap, "give_back", lambda: calls.append(engine.busy) or True)
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
    client.chat.completions.create(model=tiny_lm.name, max_tokens=8, temperature=0,
                                   messages=[{"role": "user", "content": "Hi " * 30}])
    deadline = time.monotonic() + 10
    while not calls and time.monotonic() < deadline:
        time.sleep(0.05)
    assert calls and not any(calls)  # given back, and only while nothing ran


def test_a_prompt_is_made_ready_where_it_is_submitted(tiny_lm):
    """Rendering and tokenizing happen on the submitting thread (``Job.prepare`` in
    ``Engine.submit``), so the engine thread runs passes only: a job reaches the engine's queue
    with its prompt's tokens, and a prompt that cannot run gets its error and ``Done`` with no
    engine thread running (none is started here) and leaves no place taken in the backlog."""
    import asyncio

    from mlx_kvserver.api.openai_chat import parse
    from mlx_kvserver.chat.output import Done, Error
    from mlx_kvserver.chat.render import encode
    from mlx_kvserver.chat.support import chat_support
    from mlx_kvserver.engine.request import Job

    engine = make_engine([tiny_lm], ServerConfig())
    loop = asyncio.new_event_loop()

    def job(content: str) -> Job:
        conv = parse({"messages": [{"role": "user", "content": content}]}, ServerConfig())
        return Job(conv, tiny_lm, loop)
    try:
        ok = job("Tell me about the sea.")
        engine.submit(ok)
        want, _ = encode(tiny_lm.tokenizer, chat_support(tiny_lm).format, ok.conversation)
        assert ok.prompt is not None and ok.prompt.tokens == want
        assert engine.queued == 1
        too_long = job(" ".join(["sea"] * tiny_lm.context_length))
        engine.submit(too_long)
        events = [loop.run_until_complete(too_long.events.get()) for _ in range(2)]
        assert isinstance(events[0], Error), events
        assert events[0].error.code == "context_length_exceeded"
        assert isinstance(events[1], Done) and engine.queued == 1
    finally:
        loop.close()
        engine.stop()
