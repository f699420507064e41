"""Every model family mlx-lm runs, through the real server, on tiny random-weight models.

One loaded model per family (``harness/tiny_families.py``: full attention, sliding windows, Gemma
4's KV-shared layers of two head sizes, recurrent layers mixed with attention layers), greedy:

- a 4-turn chat answers the same with the cache as without, and turns 2-4 reuse cached tokens;
- the answers without the cache are mlx-lm's own, computed with its own caches;
- a restarted server answers turn 4 from disk, the same answer, with cached tokens;
- an edited earlier message never reuses state past the edit;
- two continuations of one conversation (``n: 2``) share its pages, and each goes on exactly.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
from mlx_lm.models.cache import make_prompt_cache

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from harness.server_utils import running_server
from harness.tiny_families import FAMILIES, SLIDING_WINDOW, make_tiny_family_dir

TURNS = ["Tell me about the sea.", "And the mountains?", "Which is older?", "Say it shorter."]
MAX_TOKENS = 10
PAGE_SIZE = 8  # pages smaller than the sliding window (16 tokens)


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request, tmp_path_factory) -> LoadedModel:
    """The family's tiny model, loaded from its folder as ``--model PATH`` does."""
    path = make_tiny_family_dir(tmp_path_factory.mktemp("families") / request.param,
                                request.param)
    return resolve_and_load(str(path))


@pytest.fixture(scope="module")
def server(lm, tmp_path_factory):
    """One server per family, with a disk cache (for the tests that need no fresh one)."""
    with running_server([lm], config(tmp_path_factory.mktemp("kv"))) as url:
        yield url


def config(cache_dir: Path | None) -> ServerConfig:
    return ServerConfig(max_tokens=MAX_TOKENS, page_size=PAGE_SIZE, kv_cache_dir=cache_dir)


def ask(url: str, lm: LoadedModel, messages: list[dict], use_cache: bool = True):
    """Greedy answer: (text, server-given message_id, usage)."""
    client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=lm.name, messages=messages, max_tokens=MAX_TOKENS,
                                       temperature=0, extra_body={"use_kv_cache": use_cache})
    return r.choices[0].message.content, r.choices[0].message.model_extra["message_id"], r.usage


def cached(usage) -> int:
    return usage.prompt_tokens_details.cached_tokens


def user(tag: str, i: int, text: str | None = None) -> dict:
    return {"role": "user", "content": text or TURNS[i], "message_id": f"{tag}-u{i}"}


def chat(url: str, lm: LoadedModel, tag: str, turns: int) -> tuple[list[dict], list]:
    """``turns`` cached turns; returns the history (answers with their message_ids) and usages."""
    history, usages = [], []
    for i in range(turns):
        history.append(user(tag, i))
        text, mid, usage = ask(url, lm, history)
        history.append({"role": "assistant", "content": text, "message_id": mid})
        usages.append(usage)
    return history, usages


def prompt_ids(lm: LoadedModel, messages: list[dict]) -> list[int]:
    tok = lm.tokenizer
    return tok.encode(tok.render(messages, add_generation_prompt=True))


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def mlx_lm_greedy(lm: LoadedModel, messages: list[dict]) -> str:
    """The greedy answer computed with mlx-lm's own caches (``make_prompt_cache``), the way the
    server decodes: the whole prompt in one call, then a token at a time, up to an end token."""
    cache = make_prompt_cache(lm.model)
    logits = lm.model(mx.array(prompt_ids(lm, messages))[None], cache=cache)[0, -1]
    tokens: list[int] = []
    for _ in range(MAX_TOKENS):
        token = int(mx.argmax(logits).item())
        if token in lm.tokenizer.eos_token_ids:
            break
        tokens.append(token)
        logits = lm.model(mx.array([[token]]), cache=cache)[0, -1]
    return lm.tokenizer.decode(tokens)


def test_four_turns_equal_with_and_without_cache(server, lm):
    history, prompts = [], []
    for i in range(4):
        history.append(user("t", i))
        warm, mid, usage = ask(server, lm, history)
        cold, _, cold_usage = ask(server, lm, history, use_cache=False)
        assert warm == cold, f"turn {i + 1}"
        assert cached(cold_usage) == 0
        if i > 0:
            assert cached(usage) > 0, f"turn {i + 1} reused nothing"
        history.append({"role": "assistant", "content": warm, "message_id": mid})
        prompts.append(usage.prompt_tokens)
    # The chat outgrows the sliding windows, and the answers are not all alike.
    assert prompts[-1] > 4 * SLIDING_WINDOW
    assert len({m["content"] for m in history if m["role"] == "assistant"}) > 1


def test_answers_are_mlx_lm_s_own(server, lm):
    history = []
    for i in range(4):
        history.append(user("r", i))
        answer, mid, _ = ask(server, lm, history, use_cache=False)
        assert answer == mlx_lm_greedy(lm, history), f"turn {i + 1}"
        history.append({"role": "assistant", "content": answer, "message_id": mid})


def test_restart_answers_turn_four_from_disk(lm, tmp_path):
    with running_server([lm], config(tmp_path)) as url:
        history, _ = chat(url, lm, "d", 3)
    history.append(user("d", 3))
    with running_server([lm], config(tmp_path)) as url:  # a new server state, same directory
        warm, _, usage = ask(url, lm, history)
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][lm.name]
        cold, _, _ = ask(url, lm, history, use_cache=False)
    assert warm == cold
    assert cached(usage) > 0
    assert stats["disk_hits"] >= 1


def test_edited_earlier_message_never_reuses_stale_state(server, lm):
    history, _ = chat(server, lm, "e", 3)
    edited = [dict(m) for m in history]
    edited[2] = dict(edited[2], content="Something else entirely.")  # turn 2's user message
    edited.append(user("e", 3))
    warm, _, usage = ask(server, lm, edited)
    cold, _, _ = ask(server, lm, edited, use_cache=False)
    assert warm == cold
    # Reuse stops where the edited prompt leaves the stored conversation's tokens (and the
    # first turn, before the edit, is reused).
    common = common_prefix(prompt_ids(lm, history + [user("e", 3)]), prompt_ids(lm, edited))
    assert 0 < cached(usage) <= common


def test_two_continuations_share_pages_and_each_goes_on_exactly(lm):
    first = [user("f", 0)]
    with running_server([lm], config(None)) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0, timeout=120)
        r = client.chat.completions.create(model=lm.name, messages=first, max_tokens=MAX_TOKENS,
                                           n=2, temperature=1.0, seed=3)
        others = ["f-u0"]  # every entry but the two answers
        for choice in r.choices:
            history = first + [{"role": "assistant", "content": choice.message.content,
                                "message_id": choice.message.model_extra["message_id"]},
                               user(f"f{choice.index}", 1)]
            warm, mid, usage = ask(url, lm, history)
            cold, _, _ = ask(url, lm, history, use_cache=False)
            assert warm == cold, f"choice {choice.index}"
            assert cached(usage) > 0, f"choice {choice.index}"
            others += [f"f{choice.index}-u1", mid]
        # With every other entry gone, the prompt's pages are still held by both answers.
        for key in others:
            assert httpx.delete(f"{url}/kv_cache/{key}").status_code == 200, key
        stats = httpx.get(f"{url}/kv_cache/stats").json()["models"][lm.name]
        # (with recurrent state, the state points at the prompts' message boundaries stay too:
        # after f-u0, and after each answer and each second question:
        # kv_cache/model/state_points.py)
        assert stats["ram"]["entries"] == 2 + (5 if lm.cache_spec.has_state else 0)
        assert stats["ram"]["bytes_shared"] > 0
