"""A chat about an image (the tiny Qwen2.5-VL, greedy) on the paths beside the plain one, each
answer the same token for token as the same chat decoded plainly and uncached: drafts verified
around the image (prompt lookup and a client's prediction; a draft model reads the chat without
the image's tokens), several choices of one request, image and text chats sent at once, turn 2
on a second server reading the image's pages from the shared store, and an image in a tool
result (a screenshot tool) read where the result is, through each API."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import base64
import copy

import httpx
import pytest

from harness.redis_proc import running_redis
from harness.server_utils import make_engine, running_server
from mlx_kvserver.chat.conversation import (Conversation, Message, Text, Tool, ToolCall,
                                            ToolResult)
from mlx_kvserver.chat.images import decode_image
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.request import Prompt
from mlx_kvserver.errors import RequestError
from mlx_kvserver.engine.engine import Engine
from mlx_kvserver.engine.speculation.pass_cost import PassCost
from mlx_kvserver.models.loading import LoadedModel, resolve_and_load
from tests.chat.pictures import data_url
from tests.chat.templates import QWEN25
from tests.chat.test_render import images_in
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


SCREEN = {"name": "screenshot", "description": "The screen as a picture",
          "parameters": {"type": "object", "properties": {}}}


def test_an_image_in_a_tool_result_is_read_through_every_api(vlm: LoadedModel,
                                                             tmp_path: Path) -> None:
    """A screenshot tool's result with an image: an OpenAI ``tool`` message with an image part,
    an Anthropic ``tool_result`` with an ``image`` block, a Responses ``function_call_output``
    with an ``input_image``. The template has no tools (the fallback), so the result's image
    goes inside its ``<tool_response>`` block: each answers as that prompt written by hand
    with the image in a user message, the later ones reading the image from the cache."""
    image = data_url(PICTURES["a"])
    look = {"role": "user", "content": "Look at the screen."}
    by_hand = [look, {"role": "assistant", "content":
                      '<tool_call>{"name": "screenshot", "arguments": {}}</tool_call>'},
               {"role": "user", "content": [
                   {"type": "text", "text": "<tool_response>\nthe screen\n"},
                   {"type": "image_url", "image_url": {"url": image}},
                   {"type": "text", "text": "\n</tool_response>"}]}]
    openai = [look, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "screenshot", "arguments": "{}"}}]},
              {"role": "tool", "tool_call_id": "call_1", "content": [
                  {"type": "text", "text": "the screen"},
                  {"type": "image_url", "image_url": {"url": image}}]}]
    tools = [{"type": "function", "function": SCREEN}]
    with running_server([vlm], c := config(tmp_path), engine=make_engine([vlm], c)) as url:
        want = post(url, vlm.name, by_hand, False, tools=tools)
        got = post(url, vlm.name, openai, tools=tools)
        anthropic = httpx.post(f"{url}/messages", timeout=300, json={
            "model": vlm.name, "max_tokens": MAX_TOKENS, "temperature": 0,
            "tools": [{"name": SCREEN["name"], "description": SCREEN["description"],
                       "input_schema": SCREEN["parameters"]}],
            "messages": [look, {"role": "assistant", "content": [
                {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                              "content": [
                    {"type": "text", "text": "the screen"},
                    {"type": "image", "source": {
                        "type": "base64", "media_type": "image/png",
                        "data": base64.b64encode(PICTURES["a"]).decode()}}]}]}]})
        responses = httpx.post(f"{url}/responses", timeout=300, json={
            "model": vlm.name, "max_output_tokens": MAX_TOKENS, "temperature": 0,
            "store": False, "tools": [{"type": "function", **SCREEN}],
            "input": [look, {"type": "function_call", "call_id": "call_1",
                             "name": "screenshot", "arguments": "{}"},
                      {"type": "function_call_output", "call_id": "call_1", "output": [
                          {"type": "input_text", "text": "the screen"},
                          {"type": "input_image", "image_url": image}]}]})
    span = image_span(vlm, "a")
    assert same(logprobs(got), logprobs(want))
    assert got["usage"]["prompt_tokens"] == want["usage"]["prompt_tokens"] > span.length
    said = answer(want)
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == said
    assert anthropic.json()["usage"]["cache_read_input_tokens"] > span.length
    assert responses.status_code == 200, responses.text
    assert [c["text"] for o in responses.json()["output"] if o["type"] == "message"
            for c in o["content"]] == [said]
    assert responses.json()["usage"]["input_tokens_details"]["cached_tokens"] > span.length


def test_a_template_that_shows_no_image_in_a_tool_result_is_a_clear_400(
        vlm: LoadedModel) -> None:
    """A template that renders tool results itself and shows images in user messages but
    prints a tool message's content as it is (Qwen2.5's, its user messages made to show
    images): the request is refused, saying so."""
    lm = copy.copy(vlm)
    lm.tokenizer, lm.chat = copy.copy(vlm.tokenizer), None
    user = "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    assert user in QWEN25
    lm.tokenizer.chat_template = images_in(QWEN25.replace(
        user, "{{- '<|im_start|>' + message.role + '\\n' }}CONTENT{{- '<|im_end|>\\n' }}"),
        "CONTENT")
    picture = decode_image(PICTURES["a"], "x")
    conv = Conversation(messages=[
        Message("user", [Text("Look at the screen.")]),
        Message("assistant", [ToolCall("call_1", "screenshot")]),
        Message("tool", [ToolResult("call_1", "the screen"), picture])],
        tools=[Tool(SCREEN["name"], SCREEN["description"], SCREEN["parameters"])])
    with pytest.raises(RequestError) as e:
        Prompt.of(conv, lm)
    assert e.value.status == 400 and e.value.code == "images_not_supported"
    assert "does not show images in tool results" in e.value.message
    # the same image in a user message is read
    conv.messages[-1:] = [Message("tool", [ToolResult("call_1", "the screen")]),
                          Message("user", [picture])]
    assert len(Prompt.of(conv, lm).spans) == 1
