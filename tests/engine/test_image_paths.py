"""A chat about an image (the tiny Qwen2.5-VL, greedy) on the paths beside the plain one, each
answer the same token for token as the same chat decoded plainly and uncached: drafts verified
around the image (prompt lookup and a client's prediction; a draft model reads the chat without
the image's tokens), several choices of one request, image and text chats sent at once, and
turn 2 on a second server reading the image's pages from the shared store."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from harness.redis_proc import running_redis
from harness.server_utils import make_engine, running_server
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.engine import Engine
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.engine.test_images import no_hub, vlm
from tests.models.image_families.exact import (FOLLOW_UP, PICTURES, QUESTION, cached,
                                               first_turn, logprobs, prompt_of, same)

__all__ = ["no_hub", "vlm"]  # fixtures
MAX_TOKENS = 16


def post(url: str, model: str, messages: list[dict], use_cache: bool = True, **kw) -> dict:
    r = httpx.post(f"{url}/chat/completions", timeout=300, json={
        "model": model, "messages": messages, "max_tokens": MAX_TOKENS, "temperature": 0,
        "use_kv_cache": use_cache, "logprobs": True, **kw})
    assert r.status_code == 200, r.text
    return r.json()


def answer(r: dict) -> str:
    return r["choices"][0]["message"]["content"]


def then(image: str, first: dict, follow_up: str = FOLLOW_UP) -> list[dict]:
    return first_turn(image) + [{"role": "assistant", "content": answer(first)},
                                {"role": "user", "content": follow_up}]


def image_span(lm: LoadedModel, image: str):
    return prompt_of(lm, PICTURES[image]).spans[0]


def config(tmp_path: Path, **kw) -> ServerConfig:
    return ServerConfig(max_tokens=MAX_TOKENS, page_size=8, kv_cache_dir=tmp_path, **kw)


def drafts(r: dict) -> tuple[int, int]:
    d = r["usage"]["completion_tokens_details"]
    return d["accepted_draft_tokens"], d["rejected_draft_tokens"]


@pytest.fixture
def whole_drafts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every draft verified whole (a pass of any width costs what a plain step does)."""
    monkeypatch.setattr(PassCost, "relative", lambda self, seqs, width: 1.0)


def test_drafts_verified_around_an_image_answer_as_plain_decoding(
        vlm: LoadedModel, tmp_path: Path, whole_drafts: None) -> None:
    """Prompt lookup and a client's prediction (the text around the image, and the answer
    itself) drafted and verified after the image, cached and uncached, turn 1 and turn 2: the
    same answers as with speculation off."""
    with running_server([vlm], off := config(tmp_path / "off", speculate="off"),
                        engine=make_engine([vlm], off)) as url:
        plain = post(url, vlm.name, first_turn("a"), False)
        plain2 = post(url, vlm.name, then("a", plain), False)
    wanted = answer(plain)
    predictions = {"answer": wanted, "question": QUESTION + wanted, "wrong": wanted[:len(wanted) // 2] + "zq" * 8}
    with running_server([vlm], on := config(tmp_path / "on"),
                        engine=make_engine([vlm], on)) as url:
        runs = {k: post(url, vlm.name, first_turn("a"), cache,
                        prediction={"type": "content", "content": p})
                for k, p in predictions.items() for cache in (True, False)}
        warm = post(url, vlm.name, then("a", plain), prediction={
            "type": "content", "content": answer(plain2)})
        lookup = post(url, vlm.name, then("a", plain, FOLLOW_UP + " " + answer(plain2)))
        lookup_plain = post(url, vlm.name, then("a", plain, FOLLOW_UP + " " + answer(plain2)),
                            False, speculate=False)
    for r in runs.values():
        assert same(logprobs(r), logprobs(plain))
    assert same(logprobs(warm), logprobs(plain2))
    assert cached(warm) > image_span(vlm, "a").end  # turn 2 read the image from the cache
    assert same(logprobs(lookup), logprobs(lookup_plain))
    assert drafts(runs["answer"])[0] > 0 and drafts(warm)[0] > 0  # drafts were taken
    assert drafts(warm)[1] + drafts(lookup)[1] > 0  # and refused
    assert drafts(lookup_plain) == (0, 0)


def test_a_draft_model_reads_the_chat_without_the_images_tokens(
        vlm: LoadedModel, tmp_path: Path, whole_drafts: None) -> None:
    """A draft model (here the same weights, loaded again) sees no pixels: it reads an image
    chat with the image's tokens left out, and the answers are those of plain decoding."""
    draft = resolve_and_load(vlm.source)
    image_token = vlm.model.vlm.config.image_token_id
    text = [{"role": "user", "content": "Tell me about the sea."}]
    chats = [first_turn("a"), first_turn("b"), text]
    with running_server([vlm], off := config(tmp_path / "off", speculate="off"),
                        engine=make_engine([vlm], off)) as url:
        plain = [post(url, vlm.name, m, False) for m in chats]
    on = config(tmp_path / "on", speculate="draft")
    engine = Engine([vlm], on, draft=draft)
    seen: list[list[int]] = []
    propose = engine.draft.propose

    def spy(wants):
        seen.extend(list(ctx) for _, ctx, _ in wants)
        return propose(wants)

    engine.draft.propose = spy
    with running_server([vlm], on, engine=engine) as url:
        runs = [post(url, vlm.name, m, cache) for m in chats for cache in (True, False)]
        warm = post(url, vlm.name, then("a", plain[0]))
    for r, p in zip(runs, [p for p in plain for _ in (0, 1)]):
        assert same(logprobs(r), logprobs(p))
    assert seen and all(image_token not in ctx for ctx in seen)
    assert drafts(runs[-1])[0] > 0  # the text chat: the same weights draft what is taken
    assert sum(sum(drafts(r)) for r in runs[:4]) > 0  # the image chats were drafted for too
    assert cached(warm) > image_span(vlm, "a").end


def test_several_choices_of_an_image_chat_each_answer_as_one(vlm: LoadedModel,
                                                             tmp_path: Path) -> None:
    """``n`` = 3 under greedy sampling: each choice is the single choice's answer, with the
    cache on (the choices fork the prompt's pages) and off (each computes the prompt)."""
    with running_server([vlm], c := config(tmp_path), engine=make_engine([vlm], c)) as url:
        one = post(url, vlm.name, first_turn("a"), False)
        many = {cache: post(url, vlm.name, first_turn("a"), cache, n=3)
                for cache in (True, False)}
        one2 = post(url, vlm.name, then("a", one), False)
        many2 = post(url, vlm.name, then("a", one), n=3)
    for r, single in ((many[True], one), (many[False], one), (many2, one2)):
        assert sorted(c["index"] for c in r["choices"]) == [0, 1, 2]
        for c in r["choices"]:
            assert same(logprobs({"choices": [c]}), logprobs(single))
    assert cached(many2) > image_span(vlm, "a").end


def test_image_and_text_chats_sent_at_once_answer_as_alone(vlm: LoadedModel,
                                                           tmp_path: Path) -> None:
    """Turn 1 and turn 2 of chats about two images and text chats, sent at once from threads
    with the cache on (prompts read together, turn 2 from the cache, decoded in one batch):
    each the same as sent alone, uncached."""
    text = [[{"role": "user", "content": f"Tell me about {w}."}] for w in ("the sea", "snow")]
    with running_server([vlm], c := config(tmp_path / "alone"),
                        engine=make_engine([vlm], c)) as url:
        firsts = {i: post(url, vlm.name, first_turn(i), False) for i in ("a", "b")}
        chats = [first_turn("a"), *text, first_turn("b"), then("a", firsts["a"]),
                 then("b", firsts["b"]), text[0] + [{"role": "assistant", "content": "Blue."},
                                                    {"role": "user", "content": "Why?"}]]
        alone = [post(url, vlm.name, m, False) for m in chats]
    c = config(tmp_path / "together")
    engine = make_engine([vlm], c)
    with running_server([vlm], c, engine=engine) as url:
        for i in ("a", "b"):  # their turn 1 cached, so turn 2 reads it while the others run
            post(url, vlm.name, first_turn(i))
        with ThreadPoolExecutor(len(chats)) as pool:
            together = list(pool.map(lambda m: post(url, vlm.name, m), chats))
    assert engine.schedulers[vlm.name].runner.batched
    for x, y in zip(alone, together):
        assert same(logprobs(x), logprobs(y))
    for k in (4, 5):  # turn 2 of each image chat read its image from the cache
        assert cached(together[k]) > image_span(vlm, "a").end


def test_turn_2_on_another_server_reads_the_image_from_the_shared_store(
        vlm: LoadedModel, tmp_path: Path) -> None:
    """Two servers on one store: turn 1 on A, turn 2 on B reads turn 1's pages, the image's
    included, from the store (B never saw the image) and answers as uncached; another image
    with the same text reads nothing from its image on."""
    other = resolve_and_load(vlm.source)  # B's own copy of the model
    span = image_span(vlm, "a")
    with running_redis(tmp_path / "redis") as redis:
        a_config = config(tmp_path / "a", kv_store=redis.url)
        with running_server([vlm], a_config, engine=make_engine([vlm], a_config)) as a:
            first = post(a, vlm.name, first_turn("a"))
            settled(a, vlm.name)
        b_config = config(tmp_path / "b", kv_store=redis.url)
        with running_server([other], b_config, engine=make_engine([other], b_config)) as b:
            warm = post(b, vlm.name, then("a", first))
            store = settled(b, vlm.name)
            uncached = post(b, vlm.name, then("a", first), False)
            another = post(b, vlm.name, then("b", first))
            another_plain = post(b, vlm.name, then("b", first), False)
    assert same(logprobs(warm), logprobs(uncached))
    assert cached(warm) >= first["usage"]["prompt_tokens"] // 8 * 8 > span.end
    assert store["pages_read"] > span.end // 8 and store["errors"] == 0
    assert same(logprobs(another), logprobs(another_plain))
    assert cached(another) <= span.start


def settled(url: str, model: str) -> dict:
    """The store's stats once the server's writes to it are done (they run after an answer)."""
    import time

    for _ in range(300):
        s = httpx.get(f"{url}/kv_cache/stats").json()["models"][model]["store"]
        if s["queued"] == 0:
            return s
        time.sleep(0.02)
    return s
