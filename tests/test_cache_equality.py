"""Invariant 4 through Anthropic's Messages API and OpenAI's Responses API: a greedy answer with
the KV cache equals the answer without it, token for token, on every cache path.

Each test runs a multi-turn conversation (a system prompt, a tool call and its result) with the
cache on: turns served warm from memory, then a turn on a new server over the same cache folder
(its history restored from disk) and, for Responses, turns continued by ``previous_response_id``.
Each turn's usage must show the cache was read. Then every turn is asked again, with the same
history, of a second server with ``use_kv_cache: false`` and an empty cache folder: the answers
(every output block or item, text and tool calls) and the output token counts must be the same,
and so must the prompt's token count (what was read from the cache plus what was computed).

At 2,048+ keys (the last test, driven through the scheduler): several sequences batched on one
shared document and one on its own, speculation off and on, with and without the cache, every
answer the one each prompt gets alone without the cache, token for token. A verify pass there
reads the long prefix with several queries a sequence, a plain step with one, and each form of
attention they take may round differently: equal greedy answers are what must hold (floating-
point near-ties aside, which these answers do not come near).
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kv_cache.model import prefix_part
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.models.loading import resolve_and_load
from tests.engine.test_scheduler import Collect, text
from tests.engine.speculation.test_speculate import (ask, bent, make_scheduler, reference, serve,
                                                     usage, watch)
from harness.server_utils import running_server
from harness.tiny_model import make_tiny_model, tiny_config, write_model_dir

SYSTEM = "You are a helpful assistant."
LONG = "Tell me about the sea and the mountains, and which is older. " * 3
CALL = {"city": "Paris"}
MAX = 10


def config(folder) -> ServerConfig:
    return ServerConfig(max_tokens=MAX, page_size=8, kv_cache_dir=folder)


def post(url: str, path: str, body: dict) -> dict:
    r = httpx.post(url.removesuffix("/v1") + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def off_answers(tiny_lm, folder, path: str, bodies: list[dict]) -> list[dict]:
    """Each body asked again of a fresh server, without the cache."""
    with running_server([tiny_lm], config(folder)) as url:
        return [post(url, path, {**b, "use_kv_cache": False}) for b in bodies]


# -- Anthropic's Messages API -------------------------------------------------------------------

TOOL = {"name": "get_weather", "description": "The weather in a city.",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def messages_body(tiny_lm, history: list[dict]) -> dict:
    return {"model": tiny_lm.name, "max_tokens": MAX, "temperature": 0, "system": SYSTEM,
            "tools": [TOOL], "messages": list(history)}


def blocks(r: dict) -> list[tuple]:
    return [(b["type"], b.get("text"), b.get("name"), b.get("input")) for b in r["content"]]


def prompt_of(r: dict) -> int:
    u = r["usage"]
    return u["input_tokens"] + u["cache_read_input_tokens"] + u["cache_creation_input_tokens"]


def test_messages_answers_equal_the_uncached_ones_warm_and_after_a_restart(tiny_lm, tmp_path):
    turns = [
        [{"role": "user", "content": LONG}],
        [{"role": "user", "content": "What is the weather in Paris?"}],
        [{"role": "user", "content": [{"type": "text", "text": "Use the tool."}]},
         {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1",
                                            "name": "get_weather", "input": CALL}]},
         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                       "content": "sunny, 21 C"}]}],
        [{"role": "user", "content": "Say it shorter."}],  # after the restart
    ]
    history, bodies, answers = [], [], []

    def turn(url: str, new: list[dict]) -> dict:
        if answers:  # the last answer, under its id (the key its cache was saved under)
            history.append({"role": "assistant", "message_id": answers[-1]["id"],
                            "content": answers[-1]["content"]})
        history.extend(new)
        bodies.append(messages_body(tiny_lm, history))
        answers.append(post(url, "/v1/messages", bodies[-1]))
        return answers[-1]

    with running_server([tiny_lm], config(tmp_path / "on")) as url:
        for new in turns[:3]:
            turn(url, new)
    with running_server([tiny_lm], config(tmp_path / "on")) as url:  # memory empty, same folder
        turn(url, turns[3])
    reads = [a["usage"]["cache_read_input_tokens"] for a in answers]
    assert reads[0] == 0 and all(n > 0 for n in reads[1:]), reads
    assert reads[3] >= prompt_of(answers[2]), reads  # turn 3's whole prompt, from the disk
    assert all(a["usage"]["output_tokens"] > 0 for a in answers)

    off = off_answers(tiny_lm, tmp_path / "off", "/v1/messages", bodies)
    assert [o["usage"]["cache_read_input_tokens"] for o in off] == [0] * 4
    assert [blocks(o) for o in off] == [blocks(a) for a in answers]
    assert [o["usage"]["output_tokens"] for o in off] == \
        [a["usage"]["output_tokens"] for a in answers]
    assert [o["stop_reason"] for o in off] == [a["stop_reason"] for a in answers]
    assert [prompt_of(o) for o in off] == [prompt_of(a) for a in answers]


# -- OpenAI's Responses API ---------------------------------------------------------------------

FUNCTION = {"type": "function", "name": "get_weather", "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
TOOL_ITEMS = [{"type": "message", "role": "user", "content": "What is the weather in Paris?"},
              {"type": "function_call", "call_id": "call_1", "name": "get_weather",
               "arguments": '{"city": "Paris"}'},
              {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"}]


def responses_body(tiny_lm, items, previous: str | None = None) -> dict:
    body = {"model": tiny_lm.name, "max_output_tokens": MAX, "temperature": 0,
            "instructions": SYSTEM, "tools": [FUNCTION], "input": items}
    return {**body, "previous_response_id": previous} if previous else body


def items(r: dict) -> list[tuple]:
    """The output items as the model made them (without their ids)."""
    return [(o["type"], [c.get("text") for c in o.get("content", [])], o.get("name"),
             o.get("arguments")) for o in r["output"]]


def as_input(r: dict) -> list[dict]:
    """A response's output items as input items of the next turn."""
    out = []
    for o in r["output"]:
        if o["type"] == "message":
            out.append({"type": "message", "role": "assistant", "content": [
                {"type": "output_text", "text": c["text"]} for c in o["content"]]})
        elif o["type"] == "function_call":
            out.append({k: o[k] for k in ("type", "call_id", "name", "arguments")})
    return out


def test_responses_answers_equal_the_uncached_ones_by_id_and_after_a_restart(tiny_lm, tmp_path):
    """Turn 2 sends the whole history as input items; turns 3 and 4 continue by
    ``previous_response_id`` (turn 4 on a new server). Without the cache, every turn sends the
    whole history as items: the history that ``previous_response_id`` stands for."""
    turn_inputs = [[{"type": "message", "role": "user", "content": LONG}],
                   [{"type": "message", "role": "user", "content": "And the mountains?"}],
                   TOOL_ITEMS,
                   [{"type": "message", "role": "user", "content": "Say it shorter."}]]
    full, answers = [], []  # the whole history so far, as input items; the cached answers
    with running_server([tiny_lm], config(tmp_path / "on")) as url:
        full += turn_inputs[0]
        answers.append(post(url, "/v1/responses", responses_body(tiny_lm, full)))
        full += as_input(answers[0]) + turn_inputs[1]
        answers.append(post(url, "/v1/responses", responses_body(tiny_lm, full)))
        answers.append(post(url, "/v1/responses", responses_body(
            tiny_lm, turn_inputs[2], previous=answers[1]["id"])))
    with running_server([tiny_lm], config(tmp_path / "on")) as url:  # memory empty, same folder
        answers.append(post(url, "/v1/responses", responses_body(
            tiny_lm, turn_inputs[3], previous=answers[2]["id"])))
    cached = [a["usage"]["input_tokens_details"]["cached_tokens"] for a in answers]
    assert cached[0] == 0 and all(n > 0 for n in cached[1:]), cached
    assert cached[3] >= answers[2]["usage"]["input_tokens"], cached  # restored from the disk
    assert all(a["usage"]["output_tokens"] > 0 for a in answers)

    histories = [list(turn_inputs[0])]
    for answer, new in zip(answers, turn_inputs[1:]):
        histories.append(histories[-1] + as_input(answer) + new)
    assert histories[1] == full
    off = off_answers(tiny_lm, tmp_path / "off", "/v1/responses",
                      [responses_body(tiny_lm, h) for h in histories])
    assert [o["usage"]["input_tokens_details"]["cached_tokens"] for o in off] == [0] * 4
    assert [items(o) for o in off] == [items(a) for a in answers]
    for key in ("output_tokens", "input_tokens"):
        assert [o["usage"][key] for o in off] == [a["usage"][key] for a in answers], key
    assert [o["status"] for o in off] == [a["status"] for a in answers]


# -- 2,048+ keys, batched, speculation off and on -----------------------------------------------

LONG_CONTEXT = 8192


@pytest.fixture(scope="module")
def long_lm(tmp_path_factory):
    """The tiny model with room for prompts of thousands of tokens."""
    cfg = {**tiny_config(), "max_position_embeddings": LONG_CONTEXT}
    path = Path(tmp_path_factory.mktemp("tiny-long"))
    write_model_dir(path, make_tiny_model(0), cfg, max_length=LONG_CONTEXT)
    return resolve_and_load(str(path))


def long_body(i: int) -> dict:
    """Sequences 0-3 on one ~2,300-token document, sequence 4 on its own; a short question."""
    doc = text(7, 560) if i < 4 else text(50 + i, 560)
    return ask([{"role": "system", "content": doc},
                {"role": "user", "content": text(200 + i, 3 + i)}], 24)


def test_greedy_answers_at_thousands_of_keys_batched_speculation_off_and_on(long_lm,
                                                                           monkeypatch):
    """Five prompts of 2,300+ tokens batched: with the cache and speculation off, then again on
    the same cache (warm: every prompt read from it) with speculation on, and without the cache
    with speculation on. Drafts come from prompt lookup, and for three answers from a
    prediction (whole, or with two tokens changed: taken in part, then refused); the verify
    passes read the shared prefix with up to nine queries a sequence, the plain steps with one.
    Every answer is the one its prompt gets alone, without the cache or speculation."""
    monkeypatch.setattr(PassCost, "relative", lambda self, seqs, width: 1.0)  # drafts whole
    reads: list = []  # (query rows, prefix keys) of every read of a prefix
    scores = prefix_part.scores
    monkeypatch.setattr(prefix_part, "scores", lambda q, p: reads.append(
        (q.shape[-2], p[0].shape[-2])) or scores(q, p))
    refs = [reference(long_lm, long_body(i)) for i in range(5)]
    preds = [None, bent(refs[1][1]), refs[2][1], None, bent(refs[4][1])]

    def batch(s, cache: bool, speculate: bool, predictions=()) -> list:
        jobs = [Collect({**long_body(i), "use_kv_cache": cache, "speculate": speculate}, long_lm)
                for i in range(5)]
        reqs = serve(s, jobs, predictions)
        assert [j.answers()[0][0] for j in jobs] == [t for t, _ in refs]
        assert [list(r.choices[0].tokens) for r in reqs] == [ids for _, ids in refs]
        assert all(len(r.prompt) > 2_300 for r in reqs)
        return [usage(j) for j in jobs]

    s = make_scheduler(long_lm, "ngram")
    cold = batch(s, True, False)
    assert s.manager.views is not None and s.manager.views.views  # the document, shared
    assert all(u.decode_steps == 23 and u.draft_accepted == 0 for u in cold)
    seen: list = []
    watch(s, seen)
    warm = batch(s, True, True, preds)  # drafts: the answers saved by the cold run
    assert all(u.cached_tokens > 2_048 for u in warm)
    assert all(u.draft_accepted >= 16 and u.draft_rejected == 0 for u in warm)
    uncached = batch(make_scheduler(long_lm, "ngram"), False, True, preds)
    assert all(u.cached_tokens == 0 for u in uncached)
    assert sum(u.draft_accepted for u in uncached) >= 32
    assert uncached[1].draft_rejected > 0 and uncached[3].draft_rejected > 0  # lookup's too
    assert any(len(step) >= 4 and max(len(d) for _, d, *_ in step) == 8 for step in seen)
    # the shared document (4 sequences, 2 query heads a key head) read by a plain step and
    # by a verify pass of nine tokens a sequence
    assert {4 * 2, 4 * 2 * 9} <= {r for r, n in reads if n >= 2_048}, reads
