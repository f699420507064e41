"""The chat page at / in a real headless Chromium (selenium, Debian's chromium + chromium-driver)
against the real server on the tiny model: turns from the cache across a reload and a server
restart, edit, regenerate, fork, model choice, the cache panel, the API-key prompt, images
attached or pasted (on the tiny Qwen2.5-VL), and model output with HTML in it rendered as text; a turn's reasoning and tool calls (canned events from a
stub, see that test). Without a browser the browser tests are skipped, and
the skip reason says so (pytest -ra prints it in the summary)."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import struct
import threading
import time
from pathlib import Path

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from harness.browser_utils import MISSING, find_chromium, quit_chromium, start_chromium
from harness.server_utils import serve_app
from harness.server_utils import running_server
from harness.services import required, unavailable
from tests.chat.pictures import data_url, file_of, picture
from tests.clients.test_repl import WEATHER, plain_answer, thinking_answer

CHROMIUM = find_chromium()
needs_browser = pytest.mark.skipif(CHROMIUM is None and "chromium" not in required(),
                                   reason=MISSING)
STORAGE_KEY = "mlx-kvchat.conversations.v1"
KEY = "page-s3cret"


class Served:
    """A running server that can be stopped and started again on the same port."""

    def __init__(self, models, config: ServerConfig):
        self.models, self.config, self.port, self._cm = models, config, 0, None

    def start(self) -> None:
        self._cm = running_server(self.models, self.config, port=self.port)
        self.url = self._cm.__enter__()
        self.root = self.url.removesuffix("/v1")
        self.port = int(self.root.rsplit(":", 1)[1])

    def stop(self) -> None:
        self._cm.__exit__(None, None, None)

    def restart(self) -> None:
        self.stop()
        self.start()


@pytest.fixture(scope="module")
def served(tiny_lm, tiny_lm_b, tmp_path_factory):
    config = ServerConfig(max_tokens=8, kv_cache_dir=tmp_path_factory.mktemp("page-kv"))
    s = Served([tiny_lm, tiny_lm_b], config)
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def downloads(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("downloads")


@pytest.fixture(scope="module")
def web(downloads):
    if CHROMIUM is None:
        unavailable("chromium", MISSING)
    driver = start_chromium(*CHROMIUM, downloads=downloads)
    yield driver
    quit_chromium(driver)


# -- helpers ------------------------------------------------------------------------------------


def until(web, predicate, timeout: float = 30, what: str = "the page"):
    from selenium.webdriver.support.ui import WebDriverWait

    # polled every 50 ms, not selenium's default 500 ms: an answer of the tiny model takes less
    return WebDriverWait(web, timeout, poll_frequency=0.05).until(lambda w: predicate(w),
                                                                  f"waiting for {what}")


def css(web, selector: str):
    from selenium.webdriver.common.by import By

    return web.find_elements(By.CSS_SELECTOR, selector)


def open_page(web, root: str) -> None:
    web.get(root + "/")
    until(web, lambda w: w.execute_script("return document.body.dataset.ready") == "1")


def answers(web) -> int:
    return int(css(web, "#main")[0].get_attribute("data-answers"))


def answered(web, before: int) -> dict:
    """Waits for the next answer to finish; its message_id and the figures under it."""
    until(web, lambda w: answers(w) > before and
          css(w, "#main")[0].get_attribute("data-state") == "idle", what="an answer")
    error = css(web, "#error")[0]
    assert not error.is_displayed(), error.text
    last = css(web, "#messages .msg")[-1]
    stats = last.find_elements("css selector", ".msg-stats")[0]
    return {"id": last.get_attribute("data-message-id"), "text": stats.text,
            "cached": int(stats.get_attribute("data-cached")),
            "prompt": int(stats.get_attribute("data-prompt"))}


def say(web, text: str) -> dict:
    before = answers(web)
    box = css(web, "#input")[0]
    box.send_keys(text)
    css(web, "#send")[0].click()
    return answered(web, before)


def click_action(web, index: int, name: str) -> None:
    msg = css(web, f'#messages .msg[data-index="{index}"]')[0]
    web.execute_script("arguments[0].scrollIntoView()", msg)
    msg.find_elements("css selector", f".act-{name}")[0].click()


def stored(web) -> dict:
    return json.loads(web.execute_script(f"return localStorage.getItem('{STORAGE_KEY}')"))


def active(web) -> dict:
    data = stored(web)
    return next(c for c in data["conversations"] if c["id"] == data["current"])


# -- the page in a browser ----------------------------------------------------------------------


@needs_browser
def test_turns_come_from_the_cache_across_reload_edit_fork_and_restart(served, web, tiny_lm,
                                                                       tiny_lm_b):
    open_page(web, served.root)
    assert css(web, "#model-choice")[0].is_displayed()  # two models served: a choice
    first = say(web, "hello there")
    assert first["cached"] == 0 and "ttft" in first["text"] and "tok/s" in first["text"]
    second = say(web, "tell me more")
    assert 0 < second["cached"] < second["prompt"]  # the history came from the cache
    assert not css(web, "#turns")[0].get_attribute("hidden")
    assert len(css(web, "#turns-chart svg rect.bar-cached")) == 2
    conv = active(web)
    assert [m["role"] for m in conv["messages"]] == ["user", "assistant"] * 2
    assert all(m["message_id"] for m in conv["messages"])
    assert conv["messages"][-1]["message_id"] == second["id"]

    web.refresh()  # the conversation comes back from localStorage, with its ids
    until(web, lambda w: len(css(w, "#messages .msg")) == 4)
    third = say(web, "and then?")
    assert third["cached"] > second["prompt"] // 2

    user_id = active(web)["messages"][4]["message_id"]  # edit the third question
    click_action(web, 4, "edit")
    area = css(web, ".edit-input")[0]
    area.clear()
    area.send_keys("a different question")
    before = answers(web)
    css(web, ".edit-save")[0].click()
    edited = answered(web, before)
    msgs = active(web)["messages"]
    assert len(msgs) == 6 and msgs[4]["content"] == "a different question"
    assert msgs[4]["message_id"] != user_id  # an edited message is a new message
    assert edited["cached"] > 0  # the turns before it still come from the cache

    before = answers(web)
    click_action(web, 5, "regen")
    regen = answered(web, before)
    assert regen["id"] != edited["id"] and regen["cached"] >= edited["prompt"] - 1
    assert len(active(web)["messages"]) == 6

    original = active(web)
    click_action(web, 1, "fork")  # a new conversation with the first question and answer
    until(web, lambda w: len(css(w, "#conversations li")) == 2)
    fork = active(web)
    assert fork["id"] != original["id"]
    assert [m["message_id"] for m in fork["messages"]] == \
        [m["message_id"] for m in original["messages"][:2]]
    branch = say(web, "a branch")
    assert branch["cached"] > 0
    assert len(next(c for c in stored(web)["conversations"]
                    if c["id"] == original["id"])["messages"]) == 6  # the original is intact

    from selenium.webdriver.support.ui import Select

    Select(css(web, "#model")[0]).select_by_value(tiny_lm_b.name)
    other = say(web, "and on the other model?")
    assert tiny_lm_b.name in other["text"] and other["cached"] == 0  # its own cache: empty
    assert active(web)["messages"][-1]["model"] == tiny_lm_b.name

    served.restart()  # a new server process state: the cache comes back from disk
    web.refresh()
    until(web, lambda w: w.execute_script("return document.body.dataset.ready") == "1")
    css(web, f'#conversations li[data-id="{original["id"]}"] .conv-open')[0].click()
    until(web, lambda w: len(css(w, "#messages .msg")) == 6)
    assert Select(css(web, "#model")[0]).first_selected_option.text == tiny_lm.name
    after = say(web, "after a restart")
    assert after["cached"] > regen["prompt"] // 2
    stats = httpx.get(f"{served.url}/kv_cache/stats").json()["models"][tiny_lm.name]
    assert stats["disk_hits"] >= 1


@needs_browser
def test_cache_panel_shows_stats_exports_and_deletes(served, web, downloads, tiny_lm):
    open_page(web, served.root)
    css(web, "#new-chat")[0].click()
    say(web, "fill the cache")
    reply_id = say(web, "and a second turn")["id"]
    css(web, "#toggle-cache")[0].click()
    until(web, lambda w: css(w, f'.cache-entry[data-message-id="{reply_id}"]'), what="entries")
    section = css(web, f'.cache-model[data-model="{tiny_lm.name}"]')[0]
    rows = {r.get_attribute("data-stat"): r.text for r in
            section.find_elements("css selector", "tr")}
    assert set(rows) >= {"hits", "tokens", "ram", "ram-entries", "shared", "disk", "evictions"}
    assert " of " in rows["ram"] and "GiB" in rows["ram"] and " of " in rows["disk"]
    assert len(section.find_elements("css selector", "meter")) == 2
    assert len(css(web, ".cache-entry")) == 4  # both questions and both answers
    mem = {r.get_attribute("data-stat"): r.text for r in  # the server's one memory budget
           css(web, ".cache-memory tr")}
    assert set(mem) == {"memory", "weights", "pages", "working", "process", "pressure"}
    assert "outside MLX" in mem["process"] and "kept free" in mem["process"], mem
    limit = httpx.get(f"{served.url}/kv_cache/stats").json()["models"][tiny_lm.name][
        "memory"]["limit_bytes"]
    assert f"of {limit / (1 << 30):.1f} GiB" in mem["memory"], mem
    assert "0 refused" in mem["pressure"]

    entry = css(web, f'.cache-entry[data-message-id="{reply_id}"]')[0]
    entry.find_elements("css selector", ".entry-export")[0].click()
    target = downloads / f"kv-{reply_id}.safetensors"
    deadline = time.monotonic() + 20
    while not target.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    data = target.read_bytes()
    header = json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])
    assert header["__metadata__"]["key"] == reply_id

    entry.find_elements("css selector", ".entry-delete")[0].click()
    until(web, lambda w: not css(w, f'.cache-entry[data-message-id="{reply_id}"]'),
          what="the entry to go")
    assert httpx.get(f"{served.url}/kv_cache/{reply_id}").status_code == 404


EVIL = """Here is **bold**, *italic* and `<b>code</b>`.

<script>window.__pwned = "script"</script>
<img src=x onerror="window.__pwned = 'img'">
[click me](javascript:window.__pwned='link') and [a real link](https://example.com/a?b=1)
See https://example.org/page.

```html
<img src=x onerror="window.__pwned = 'code'">
```

- one <iframe src="javascript:window.__pwned='iframe'"></iframe>
- two"""


@needs_browser
def test_model_output_with_html_renders_as_text(served, web):
    """An answer stored as the page stores answers (localStorage), with HTML and script in it:
    the page renders it through its own Markdown renderer, as text."""
    open_page(web, served.root)
    conv = {"id": "conv-evil", "title": "<img src=x onerror=\"window.__pwned='title'\">",
            "model": None, "created": 1, "updated": 4102444800000, "messages": [
                {"role": "user", "content": "<b>hi</b><img src=x onerror=\"window.__pwned='u'\">",
                 "message_id": "user-evil"},
                {"role": "assistant", "content": EVIL, "message_id": "msg-evil"}]}
    web.execute_script("localStorage.setItem(arguments[0], arguments[1])", STORAGE_KEY,
                       json.dumps({"version": 1, "current": "conv-evil", "conversations": [conv]}))
    open_page(web, served.root)
    until(web, lambda w: len(css(w, "#messages .msg")) == 2)
    time.sleep(1.0)  # an <img onerror> would have fired by now
    assert web.execute_script("return window.__pwned") is None
    for tag in ("script", "img", "iframe", "b"):
        assert not css(web, f"#messages {tag}, #conversations {tag}"), tag
    body = css(web, '#messages .msg[data-role="assistant"] .msg-body')[0]
    text = body.text
    assert '<script>window.__pwned = "script"</script>' in text
    assert "<img src=x onerror=\"window.__pwned = 'img'\">" in text
    assert "[click me](javascript:window.__pwned='link')" in text
    assert [e.text for e in body.find_elements("css selector", "strong")] == ["bold"]
    assert [e.text for e in body.find_elements("css selector", "em")] == ["italic"]
    assert body.find_elements("css selector", "p code")[0].text == "<b>code</b>"
    code = body.find_elements("css selector", "pre code")[0]
    assert code.text == "<img src=x onerror=\"window.__pwned = 'code'\">"
    assert code.get_attribute("class") == "lang-html"
    links = body.find_elements("css selector", "a")
    assert [a.get_attribute("href") for a in links] == ["https://example.com/a?b=1",
                                                        "https://example.org/page"]
    assert links[0].get_attribute("rel") == "noopener noreferrer nofollow"
    items = body.find_elements("css selector", "ul li")
    assert len(items) == 2 and "<iframe" in items[0].text
    user = css(web, '#messages .msg[data-role="user"] .msg-body')[0]
    assert user.text == "<b>hi</b><img src=x onerror=\"window.__pwned='u'\">"
    assert css(web, "#conversations .conv-open")[0].text.startswith("<img src=x")


@needs_browser
def test_api_key_prompt(tiny_lm, web):
    with running_server([tiny_lm], ServerConfig(max_tokens=4, api_key=KEY)) as url:
        web.get(url.removesuffix("/v1") + "/")
        until(web, lambda w: css(w, "#key-dialog")[0].is_displayed(), what="the key prompt")
        assert "needs an API key" in css(web, "#key-message")[0].text
        css(web, "#key-input")[0].send_keys("wrong")
        css(web, "#key-form button[type=submit]")[0].click()
        until(web, lambda w: "not accepted" in css(w, "#key-message")[0].text)
        css(web, "#key-input")[0].send_keys(KEY)
        css(web, "#key-form button[type=submit]")[0].click()
        until(web, lambda w: w.execute_script("return document.body.dataset.ready") == "1")
        assert not css(web, "#key-dialog")[0].is_displayed()
        assert not css(web, "#model-choice")[0].is_displayed()  # one model: no choice
        css(web, "#new-chat")[0].click()
        assert say(web, "hello with a key")["prompt"] > 0
        web.execute_script("sessionStorage.clear(); localStorage.clear()")


class CannedChat:
    """A stub server for the rendering check only: the page and its files are the real routes
    (mlx_kvserver.api.page), /v1/models and /v1/chat/completions stream canned events shaped as the
    server's (the tiny random-weight models make no reasoning or tool calls on their own). A
    "wait" item holds the stream until ``gate`` is set; ``bodies`` are the requests it got."""

    def __init__(self, answers: list[list]):
        self.answers, self.bodies, self.gate = list(answers), [], threading.Event()

    def app(self):
        from starlette.applications import Starlette
        from starlette.responses import JSONResponse, StreamingResponse
        from starlette.routing import Route

        from mlx_kvserver.api.page import page_routes

        async def models(request):
            return JSONResponse({"object": "list", "data": [{"id": "stub", "object": "model"}]})

        async def chat(request):
            self.bodies.append(await request.json())
            chunks = self.answers.pop(0)

            async def events():
                for c in chunks:
                    if c == "wait":
                        await asyncio.to_thread(self.gate.wait, 30)
                    else:
                        yield f"data: {json.dumps(c)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(events(), media_type="text/event-stream")

        return Starlette(routes=[*page_routes(), Route("/v1/models", models),
                                 Route("/v1/chat/completions", chat, methods=["POST"])])


THOUGHT = ["The user wants the weather. ", "<script>window.__pwned='r'</script> I should call ",
           "the tool."]
EVIL_CALL = {"id": "call_2", "type": "function", "function": {
    "name": "<img src=x onerror=\"window.__pwned='name'\">", "arguments": "<b>not json</b>"}}


def parts_of(msg) -> list[str]:
    return [c.get_attribute("class") for c in msg.find_elements("css selector", ":scope > *")]


@needs_browser
def test_reasoning_folds_and_tool_calls_show_across_a_reload(web):
    """Canned events (a stub, for the rendering only): the reasoning streams into an open
    "Reasoning" block that folds when the answer starts; each tool call is a block with its
    name and pretty-printed arguments, as text; both stay after a reload, and the next turn
    sends them back as the server sent them."""
    first = thinking_answer("msg-a", THOUGHT, ["Let me look that up."], [WEATHER, EVIL_CALL],
                            "tool_calls")
    first.insert(1 + len(THOUGHT), "wait")  # the reasoning is out; the answer waits
    stub = CannedChat([first, thinking_answer("msg-b", [], ["It is sunny."])])
    with serve_app(stub.app()) as root:
        open_page(web, root)
        before = answers(web)
        css(web, "#input")[0].send_keys("weather in Paris?")
        css(web, "#send")[0].click()
        until(web, lambda w: css(w, ".msg-reasoning[open] .reasoning-body") and "the tool." in
              css(w, ".msg-reasoning .reasoning-body")[0].text, what="the reasoning, open")
        summary = css(web, ".msg-reasoning summary")[0].text
        n = len("".join(THOUGHT))
        assert summary == f"Reasoning… · {n} chars"
        assert css(web, "#main")[0].get_attribute("data-state") == "streaming"
        stub.gate.set()
        answered(web, before)
        msg = css(web, '#messages .msg[data-role="assistant"]')[-1]
        assert parts_of(msg) == ["msg-head", "msg-reasoning", "msg-body", "msg-tools",
                                 "msg-stats"]
        details = msg.find_elements("css selector", ".msg-reasoning")[0]
        assert details.get_attribute("open") is None  # folded once the answer started
        assert re.fullmatch(rf"Reasoning · {n} chars · \d+\.\d s", details.text)
        details.find_elements("css selector", "summary")[0].click()
        assert details.find_elements("css selector", ".reasoning-body")[0].text == \
            "".join(THOUGHT)
        assert msg.find_elements("css selector", ".msg-body")[0].text == "Let me look that up."
        calls = msg.find_elements("css selector", ".tool-call")
        assert [c.find_elements("css selector", ".tool-call-name")[0].text for c in calls] == \
            ["get_weather", EVIL_CALL["function"]["name"]]
        args = [c.find_elements("css selector", ".tool-call-args")[0].text for c in calls]
        assert args == ['{\n  "city": "Paris",\n  "days": 2\n}', "<b>not json</b>"]
        assert "call_1" in calls[0].text
        assert not css(web, "#messages script, #messages img, #messages b")
        assert web.execute_script("return window.__pwned") is None
        kept = active(web)["messages"][-1]
        assert kept["reasoning_content"] == "".join(THOUGHT) and kept["reasoning_time"] >= 0
        assert kept["tool_calls"] == [WEATHER, EVIL_CALL]

        web.refresh()  # from localStorage: the same parts, the reasoning folded
        until(web, lambda w: len(css(w, "#messages .msg")) == 2)
        msg = css(web, '#messages .msg[data-role="assistant"]')[0]
        assert parts_of(msg) == ["msg-head", "msg-reasoning", "msg-body", "msg-tools",
                                 "msg-stats"]
        assert msg.find_elements("css selector", ".msg-reasoning")[0].get_attribute("open") \
            is None
        assert len(msg.find_elements("css selector", ".tool-call")) == 2
        say(web, "thanks")
        sent = stub.bodies[1]["messages"][1]
        assert sent == {"role": "assistant", "content": "Let me look that up.",
                        "message_id": "msg-a", "reasoning_content": "".join(THOUGHT),
                        "tool_calls": [WEATHER, EVIL_CALL]}
        assert "reasoning_content" not in stub.bodies[1]["messages"][0]
        web.execute_script("localStorage.clear()")


def spec_answer(mid: str, text: str, completion: int, steps: int, taken: int,
                refused: int) -> list:
    """A streamed answer whose usage says how it was decoded (speculative decoding)."""
    chunks = thinking_answer(mid, [], [text])
    chunks[-1] = {"choices": [], "usage": {
        "prompt_tokens": 10, "completion_tokens": completion, "decode_steps": steps,
        "prompt_tokens_details": {"cached_tokens": 0},
        # a prediction's counts are not the drafts the line shows (the server's, every source)
        "completion_tokens_details": {"reasoning_tokens": 0, "accepted_prediction_tokens": 5,
                                      "rejected_prediction_tokens": 6,
                                      "accepted_draft_tokens": taken,
                                      "rejected_draft_tokens": refused}}}
    return chunks


@needs_browser
def test_answer_line_shows_tokens_per_pass_and_drafts_taken(web):
    """Canned usages (a stub, for the exact figures): tokens per forward pass where the answer
    had decode passes, the drafts taken only where there were drafts; both kept across a
    reload."""
    stub = CannedChat([spec_answer("msg-a", "Drafted.", 11, 4, 7, 2),
                       spec_answer("msg-b", "Plain.", 6, 6, 0, 0),
                       thinking_answer("msg-c", [], ["Older server."]),  # no decode_steps
                       spec_answer("msg-d", "One token.", 1, 0, 0, 0)])
    with serve_app(stub.app()) as root:
        open_page(web, root)
        css(web, "#new-chat")[0].click()
        # 11 tokens in 4 decode passes, 7 of 9 drafted taken; then no drafts: the first token
        # from the prompt's pass, 5 more and the end token in 6 passes
        lines = [say(web, q)["text"] for q in ("one", "two", "three", "four")]
        assert lines[0].endswith(" · 11 tokens · 2.75 tok/pass · drafts: 7 of 9 taken")
        assert lines[1].endswith(" · 6 tokens · 1.00 tok/pass")
        assert lines[2].endswith(" · 5 tokens") and lines[3].endswith(" · 1 tokens")
        first = css(web, '#messages .msg[data-role="assistant"] .msg-stats')[0]
        assert first.get_attribute("data-decode-steps") == "4"
        assert first.get_attribute("data-drafts") == "7/9"
        kept = [m["stats"] for m in active(web)["messages"] if m["role"] == "assistant"]
        assert [(k["decode_steps"], k["accepted"], k["drafted"]) for k in kept] == \
            [(4, 7, 9), (6, 0, 0), (None, 0, 0), (0, 0, 0)]
        web.refresh()  # from localStorage: the same figures
        until(web, lambda w: len(css(w, "#messages .msg")) == 8)
        assert [e.text for e in css(web, "#messages .msg-stats")] == lines
        web.execute_script("localStorage.clear()")


@needs_browser
def test_drafts_and_tokens_per_step_from_the_real_server(served, web, tiny_lm):
    """The same question in two new conversations (greedy): the second answer drafts from the
    first's saved tokens. The answer lines add up to what the server's speculation counters
    moved by, and the cache panel shows those counters."""
    from selenium.webdriver.support.ui import Select

    def speculation() -> dict:
        return httpx.get(f"{served.url}/kv_cache/stats").json()["models"][tiny_lm.name][
            "speculation"]

    open_page(web, served.root)
    css(web, "#new-chat")[0].click()
    Select(css(web, "#model")[0]).select_by_value(tiny_lm.name)
    before = speculation()
    first = say(web, "tell me a story")
    css(web, "#new-chat")[0].click()
    second = say(web, "tell me a story")
    after = speculation()
    figures = re.compile(r" · (\d+) tokens · (\d+\.\d\d) tok/pass(?: · drafts: (\d+) of "
                         r"(\d+) taken)?")
    turns = [figures.search(t["text"]).groups() for t in (first, second)]
    assert all(done == "8" for done, *_ in turns), turns
    taken, drafted = int(turns[1][2]), int(turns[1][3])
    assert 0 < taken <= drafted and float(turns[1][1]) > 1  # drafts from the first answer
    assert sum(int(t[2] or 0) for t in turns) == after["accepted"] - before["accepted"]
    assert sum(int(t[3] or 0) for t in turns) == after["drafted"] - before["drafted"]
    # 8 tokens an answer over its passes: the passes add up to the server's decode steps
    assert sum(round(8 / float(t[1])) for t in turns) == \
        after["decode_steps"] - before["decode_steps"]

    css(web, "#toggle-cache")[0].click()
    until(web, lambda w: css(w, f'.cache-model[data-model="{tiny_lm.name}"] '
                                'tr[data-stat="speculation"]'), what="the cache panel")
    section = css(web, f'.cache-model[data-model="{tiny_lm.name}"]')[0]
    rows = {r.get_attribute("data-stat"): r.find_elements("css selector", "td")[0].text
            for r in section.find_elements("css selector", "tr")}
    assert rows["speculation"] == "ngram"
    # (JavaScript's toFixed rounds a tie up, Python's format to even: the figures within half a
    # unit of the last digit)
    taken, drafted, rate = re.fullmatch(r"(\d+) of (\d+) \((\d+\.\d)%\)", rows["drafts"]).groups()
    assert (int(taken), int(drafted)) == (after["accepted"], after["drafted"])
    assert abs(float(rate) - 100 * after["accepted"] / after["drafted"]) <= 0.05 + 1e-9
    per, tokens, steps = re.fullmatch(r"(\d+\.\d\d) \((\d+) tokens in (\d+) passes\)",
                                      rows["per-step"]).groups()
    assert (int(tokens), int(steps)) == (after["tokens"], after["decode_steps"])
    assert abs(float(per) - after["tokens"] / after["decode_steps"]) <= 0.005 + 1e-9
    css(web, "#toggle-cache")[0].click()


# -- images ---------------------------------------------------------------------------------------


def paste_picture(web, data: bytes, kind: str = "image/png") -> None:
    """A paste of an image file into the message box, as a browser dispatches one."""
    web.execute_script("""
        const bytes = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));
        const dt = new DataTransfer();
        dt.items.add(new File([bytes], "pasted", {type: arguments[1]}));
        document.getElementById("input").dispatchEvent(new ClipboardEvent("paste", {
            clipboardData: dt, bubbles: true, cancelable: true}));""",
                       base64.b64encode(data).decode(), kind)


def thumbnails(web) -> list[str]:
    return [i.get_attribute("src") for i in css(web, "#attachments img")]


@needs_browser
def test_images_attached_or_pasted_are_sent_shown_kept_and_refused_by_a_text_model(
        vision_served, web, tiny_lm, tmp_path):
    """On the tiny Qwen2.5-VL: a picture attached with the file input (a second one attached and
    removed) is sent with the message: the answer and its prompt tokens equal the same chat sent
    by httpx with the same data URL; the picture shows in the conversation and after a reload,
    and the next turn sends it again (the same answer as the whole history sent uncached). A
    pasted picture is attached the same way; on the text model the attach control is hidden, a
    paste is refused, and the server's 400 is shown with the message and its picture left in the
    box."""
    from selenium.webdriver.support.ui import Select

    url, vlm = vision_served
    root = url.removesuffix("/v1")
    web.get(root + "/")
    web.execute_script("localStorage.clear(); sessionStorage.clear()")
    open_page(web, root)
    assert css(web, "#attach")[0].is_displayed()  # the tiny VLM takes images
    Select(css(web, "#model")[0]).select_by_value(tiny_lm.name)
    assert not css(web, "#attach")[0].is_displayed()  # the text model does not
    Select(css(web, "#model")[0]).select_by_value(vlm.name)
    assert css(web, "#attach")[0].is_displayed()

    first, second = file_of(picture(64, 48)), file_of(picture(32, 32), "JPEG")
    for name, data in (("first.png", first), ("second.jpg", second)):
        (tmp_path / name).write_bytes(data)
        css(web, "#attach-input")[0].send_keys(str(tmp_path / name))
    until(web, lambda w: len(thumbnails(w)) == 2, what="two thumbnails")
    assert thumbnails(web)[0] == data_url(first)
    css(web, "#attachments .image-remove")[1].click()  # the second one goes
    until(web, lambda w: len(thumbnails(w)) == 1, what="one thumbnail")

    turn = say(web, "what is in this picture?")
    assert not thumbnails(web) and not css(web, "#attachments")[0].is_displayed()
    question = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(first)}},
        {"type": "text", "text": "what is in this picture?"}]}
    plain = plain_answer(url, vlm.name, [question])
    text_only = plain_answer(url, vlm.name, [{"role": "user",
                                              "content": "what is in this picture?"}])
    conv = active(web)
    assert conv["messages"][0]["images"] == [data_url(first)]
    assert conv["messages"][1]["content"] == plain["choices"][0]["message"]["content"]
    assert turn["prompt"] == plain["usage"]["prompt_tokens"] > \
        text_only["usage"]["prompt_tokens"] + 10  # 12 image tokens for 64 x 48 pixels
    shown = css(web, '#messages .msg[data-role="user"] .msg-images img')
    assert [i.get_attribute("src") for i in shown] == [data_url(first)]
    assert web.execute_script("return arguments[0].naturalWidth", shown[0]) == 64

    web.refresh()  # from localStorage: the picture is shown and goes with the next turn
    until(web, lambda w: len(css(w, "#messages .msg-images img")) == 1, what="the picture")
    again = say(web, "and its colours?")
    answer = conv["messages"][1]
    history = [question, {"role": "assistant", "content": answer["content"]},
               {"role": "user", "content": "and its colours?"}]
    assert active(web)["messages"][3]["content"] == \
        plain_answer(url, vlm.name, history)["choices"][0]["message"]["content"]
    assert again["cached"] > turn["prompt"] // 2  # the picture's turn came from the cache

    css(web, "#new-chat")[0].click()
    paste_picture(web, second, "image/jpeg")
    until(web, lambda w: len(thumbnails(w)) == 1, what="the pasted picture")
    assert thumbnails(web) == ["data:image/jpeg;base64," + base64.b64encode(second).decode()]
    Select(css(web, "#model")[0]).select_by_value(tiny_lm.name)
    assert not css(web, "#attach")[0].is_displayed()
    paste_picture(web, first)  # refused on the page: the model takes no images
    until(web, lambda w: css(w, "#error")[0].is_displayed())
    assert "does not take images" in css(web, "#error")[0].text and len(thumbnails(web)) == 1
    before = answers(web)
    css(web, "#input")[0].send_keys("and this one?")
    css(web, "#send")[0].click()
    until(web, lambda w: answers(w) > before, what="the refusal")
    error = css(web, "#error")[0].text
    assert "HTTP 400" in error and "does not take images" in error, error
    assert css(web, "#input")[0].get_attribute("value") == "and this one?"
    assert len(thumbnails(web)) == 1  # nothing lost from the box
    assert not css(web, "#messages .msg") and not active(web)["messages"]
    web.execute_script("localStorage.clear()")


# -- without a browser --------------------------------------------------------------------------

STATIC = Path(__file__).resolve().parents[2] / "mlx_kvserver" / "clients" / "page"


def test_page_scripts_never_parse_html():
    """Model output reaches the DOM as text only: no HTML sinks anywhere in the page's code."""
    sinks = ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval(",
             "new Function", "createContextualFragment", "DOMParser")
    for path in STATIC.glob("*.js"):
        source = path.read_text()
        assert not [s for s in sinks if s in source], path.name


def test_page_and_files_are_served_with_a_strict_policy(tiny_lm):
    with running_server([tiny_lm], ServerConfig(api_key=KEY)) as url:
        root = url.removesuffix("/v1")
        page = httpx.get(f"{root}/")  # public: a browser cannot send the key for a page
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "connect-src 'self'" in csp
        assert "frame-ancestors 'none'" in csp and "unsafe-inline" not in csp
        assert 'src="static/app.js"' in page.text
        for name in ("app.js", "markdown.js", "parts.js", "images.js", "store.js", "client.js",
                     "chart.js", "cache.js", "style.css"):
            r = httpx.get(f"{root}/static/{name}")
            assert r.status_code == 200 and r.headers["x-content-type-options"] == "nosniff"
            kind = "css" if name.endswith(".css") else "javascript"
            assert kind in r.headers["content-type"], name
        missing = httpx.get(f"{root}/static/nope.js")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"
        assert httpx.get(f"{root}/static/../api.py").status_code == 404
        assert httpx.get(f"{url}/models").status_code == 401  # the API still needs the key
