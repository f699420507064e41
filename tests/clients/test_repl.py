"""The terminal chat (mlx_kvserver/clients/repl.py): SSE parsing and conversation bookkeeping without a
server, then the real REPL in a pseudo-terminal against the real server on the tiny model."""

from __future__ import annotations

import base64
import fcntl
import io
import logging
import os
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import httpx
import pytest

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.clients.client import ChatError, Client, Streamed, parse_sse
from mlx_kvserver.clients.repl import Conversation, Repl
from mlx_kvserver.clients.repl_render import _CONTROL
from harness.server_utils import running_server
from tests.chat.pictures import data_url, file_of, picture

ROOT = Path(__file__).resolve().parents[2]
STATUS = re.compile(r"\[ttft (?:\d+\.\d+s|-) \| (?:[\d.]+|-) tok/s \| (\d+) tokens \| "
                    r"cached (\d+)/(\d+) prompt tokens"
                    r"(?: \| (\d+\.\d\d) tok/pass)?(?: \| drafts: (\d+) of (\d+) taken)?\]")

# -- SSE parsing ------------------------------------------------------------------------------


def test_parse_sse_events_comments_multiline_and_done():
    lines = [": keep-alive", "", 'data: {"a": 1}', "", "event: x", 'data: {"b":', "data: 2}", "",
             "data: [DONE]", "", 'data: {"after": "done"}', ""]
    assert list(parse_sse(lines)) == [{"a": 1}, {"b": 2}]
    assert list(parse_sse(['data:{"c": 3}'])) == [{"c": 3}]  # no space, no closing blank line


def test_parse_sse_error_event_and_garbage_raise():
    err = 'data: {"error": {"message": "boom", "type": "server_error"}}'
    with pytest.raises(ChatError, match="server_error: boom"):
        list(parse_sse(['data: {"ok": 1}', "", err, ""]))
    with pytest.raises(ChatError, match="malformed"):
        list(parse_sse(["data: {not json", ""]))


# -- conversation bookkeeping -----------------------------------------------------------------


def test_conversation_ids_regen_fork_back_new_system():
    c = Conversation()
    u = c.add("user", "hi")
    assert u["message_id"].startswith("user-")
    c.add("assistant", "A", "msg-1")
    assert c.drop_answer() and c.messages == [u]  # /regen keeps the user's message and id
    assert c.drop_answer()  # nothing more to drop; the user message is still there to answer
    c.add("assistant", "A2", "msg-2")
    assert c.fork() == 1
    c.add("user", "branch")
    assert c.fork() == 2 and len(c.messages) == 3
    assert c.back() and len(c.messages) == 3 and c.back()
    assert [m["content"] for m in c.messages] == ["hi", "A2"] and not c.back()
    c.set_system("be brief")
    sys_id = c.messages[0]["message_id"]
    c.set_system("be verbose")  # a new text is a new message: a new id, still one system message
    assert c.messages[0]["content"] == "be verbose" and c.messages[0]["message_id"] != sys_id
    assert [m["role"] for m in c.messages] == ["system", "user", "assistant"]
    c.fork()
    c.new()
    assert [m["role"] for m in c.messages] == ["system"] and c.forks == []
    c.set_system("")
    assert c.messages == [] and not c.drop_answer()


class FakeClient:
    """Scripted answers: each is a list of chunks, an exception, or chunks then an exception."""

    base_url, root = "http://fake/v1", "http://fake"

    def __init__(self, answers, gets=None):
        self.answers, self.gets, self.sent = list(answers), dict(gets or {}), []

    def chat_stream(self, messages, **params):
        self.sent.append([dict(m) for m in messages])
        for item in self.answers.pop(0):
            if isinstance(item, BaseException):
                raise item
            yield item

    def get(self, url):
        return self.gets[url]


def answer(text, mid, prompt=10, cached=0, **usage):
    return [{"message_id": mid, "choices": [{"index": 0, "delta": {"role": "assistant",
                                                                     "content": ""}}]},
            {"message_id": mid, "choices": [{"index": 0, "delta": {"content": text}}]},
            {"choices": [], "usage": {"prompt_tokens": prompt, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": cached},
                                      **usage}}]


def run_repl(client, lines, out=None):
    out, prompts, it = out or io.StringIO(), [], iter(lines)

    def read(prompt):
        prompts.append(prompt)
        try:
            return next(it)
        except StopIteration:
            raise EOFError

    repl = Repl(client, {"max_tokens": 8}, out=out)
    repl.run(read)
    return repl, out.getvalue(), prompts


def test_repl_regen_fork_back_send_the_right_history():
    client = FakeClient([answer("A", "msg-a"), answer("B", "msg-b", cached=9),
                         answer("X", "msg-x"), answer("Y", "msg-y")])
    repl, out, prompts = run_repl(client, ["hi", "/regen", "/fork", "x", "/back", "y", "/quit"])
    hi = client.sent[0][0]
    assert client.sent[1] == [hi]  # regen: the same user message, same id (its cache)
    after_regen = [hi, {"role": "assistant", "content": "B", "message_id": "msg-b"}]
    assert [m["content"] for m in client.sent[2]] == ["hi", "B", "x"]
    assert client.sent[2][:2] == after_regen and client.sent[3][:2] == after_regen
    assert client.sent[3][2]["content"] == "y"  # /back forgot the branch, kept the fork point
    assert "[fork 1] >>> " in prompts and prompts[-1] == ">>> "
    ids = [m["message_id"] for m in repl.conv.messages]
    assert ids[1] == "msg-b" and ids[2].startswith("user-") and ids[3] == "msg-y"
    assert len(STATUS.findall(out)) == 4 and "cached 9/10 prompt tokens" in out
    assert "forked after 2 messages" in out and "back at the fork point" in out
    assert repl.totals == {"turns": 4, "prompt": 40, "cached": 9, "completion": 12}


def drafted(taken, refused):
    # a prediction's counts are not the drafts the line shows (the server's, every source)
    return {"completion_tokens_details": {"reasoning_tokens": 0,
                                          "accepted_prediction_tokens": 5,
                                          "rejected_prediction_tokens": 6,
                                          "accepted_draft_tokens": taken,
                                          "rejected_draft_tokens": refused}}


def test_status_line_shows_tokens_per_pass_and_drafts_taken_when_there_were_drafts():
    client = FakeClient([
        answer("A", "m1", completion_tokens=11, decode_steps=4, **drafted(7, 2)),
        answer("B", "m2", completion_tokens=6, decode_steps=6, **drafted(0, 0)),
        answer("C", "m3"),  # a server that says nothing of decode passes
        answer("D", "m4", completion_tokens=1, decode_steps=0, **drafted(0, 0))])
    _, out, _ = run_repl(client, ["a", "b", "c", "d"])
    lines = [line for line in out.splitlines() if line.startswith("[ttft")]
    # 11 tokens in 4 decode passes; 7 of the 9 drafted taken
    assert lines[0].endswith("| 11 tokens | cached 0/10 prompt tokens | 2.75 tok/pass | "
                             "drafts: 7 of 9 taken]")
    # no drafts: the first token from the prompt's pass, 5 more and the end token in 6 passes
    assert lines[1].endswith("| cached 0/10 prompt tokens | 1.00 tok/pass]")
    assert lines[2].endswith("| cached 0/10 prompt tokens]")
    assert lines[3].endswith("| 1 tokens | cached 0/10 prompt tokens]")  # no decode pass
    assert [m.groups()[3:] for m in STATUS.finditer(out)] == [
        ("2.75", "7", "9"), ("1.00", None, None), (None, None, None), (None, None, None)]


def test_repl_errors_interrupts_and_unknown_commands():
    client = FakeClient([
        [ChatError("HTTP 400 invalid_request_error: bad")],
        answer("A", "msg-a")[:2] + [KeyboardInterrupt()],  # Ctrl-C after some text
        [KeyboardInterrupt()],  # Ctrl-C before any text
        answer("C", "msg-c"),
    ])
    repl, out, _ = run_repl(client, ["one", "two", "three", "/bogus", "/regen"])
    assert "error: HTTP 400 invalid_request_error: bad" in out
    assert out.count("[stopped]") == 2 and "unknown command /bogus" in out and "/fork" in out
    # the failed turn left nothing; the stopped one kept its partial answer (with its id) until
    # /regen replaced it; "three", stopped before any text, was dropped
    assert [m["content"] for m in client.sent[2]] == ["two", "A", "three"]
    assert client.sent[3] == client.sent[1] and client.sent[1][0]["content"] == "two"
    assert [(m["content"], m.get("message_id")) for m in repl.conv.messages][1:] == \
        [("C", "msg-c")]
    assert len(STATUS.findall(out)) == 1


# -- reasoning and tool calls (canned server events: the tiny test models make neither) ----------

WEATHER = {"id": "call_1", "type": "function",
           "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}}


def thinking_answer(mid, reasoning=(), text=(), calls=(), reason="stop"):
    """The chunks of one streamed answer as the server sends them: the role, reasoning pieces,
    text pieces, each tool call (id and name, then its arguments in two fragments), the finish
    reason and the usage."""
    def chunk(delta, finish=None):
        return {"message_id": mid, "choices": [{"index": 0, "delta": delta,
                                                "finish_reason": finish}]}
    out = [chunk({"role": "assistant", "content": "", "message_id": mid})]
    out += [chunk({"reasoning_content": r}) for r in reasoning]
    out += [chunk({"content": t}) for t in text]
    for k, call in enumerate(calls):
        fn, args = call["function"], call["function"]["arguments"]
        out.append(chunk({"tool_calls": [{"index": k, "id": call["id"], "type": "function",
                                          "function": {"name": fn["name"], "arguments": ""}}]}))
        out += [chunk({"tool_calls": [{"index": k, "function": {"arguments": part}}]})
                for part in (args[:7], args[7:])]
    out.append(chunk({}, reason))
    out.append({"choices": [], "usage": {"prompt_tokens": 10, "completion_tokens": 5,
                                         "prompt_tokens_details": {"cached_tokens": 0}}})
    return out


def test_streamed_puts_reasoning_text_and_tool_calls_together_as_sent():
    s = Streamed()
    for c in thinking_answer("m", ["Let me ", "think."], ["It is ", "sunny."],
                             [WEATHER, {**WEATHER, "id": "call_2"}], "tool_calls")[:-1]:
        s.add(c["choices"][0]["delta"])
    assert (s.reasoning, s.text) == ("Let me think.", "It is sunny.")
    assert s.tool_calls == [WEATHER, {**WEATHER, "id": "call_2"}]
    assert s.message("msg-1") == {"role": "assistant", "content": "It is sunny.",
                                  "reasoning_content": "Let me think.",
                                  "tool_calls": [WEATHER, {**WEATHER, "id": "call_2"}],
                                  "message_id": "msg-1"}
    s.add({"tool_calls": [{"index": 99, "function": {"name": "x", "arguments": 5}}, "junk"]})
    assert s.tool_calls[2] == {"id": "", "type": "function",
                               "function": {"name": "x", "arguments": ""}}
    assert Streamed().message(None) == {"role": "assistant", "content": ""}


def test_reasoning_folds_to_a_summary_tool_calls_print_and_both_go_back_in_the_history():
    """Canned events: a thinking answer, then one that calls a tool, then /reasoning shows the
    last reasoning and the next answer's in full. The history sent back keeps what the server
    sent (reasoning_content, tool_calls), so the next turn renders the same tokens."""
    client = FakeClient([
        thinking_answer("msg-a", ["The user ", "greets me.\nBe brief."], ["Hello", "!"]),
        thinking_answer("msg-b", ["Use the\x1b[31m tool."], [], [WEATHER], "tool_calls"),
        thinking_answer("msg-c", ["Paris is ", "sunny."], ["Sunny."]),
        answer("D", "msg-d")])
    repl, out, _ = run_repl(client, ["hi", "weather?", "/reasoning", "thanks", "/reasoning",
                                     "bye"])
    first, second, third = out.split("[ttft")[:3]
    assert re.search(r"^\[reasoning: 29 chars, \d+\.\ds\] /reasoning shows it\nHello!\n$", first)
    assert "The user" not in out.split("reasoning: shown in full")[0]  # folded until asked
    assert re.search(r"\n\[reasoning: 18 chars, \d+\.\ds\] /reasoning shows it\n"
                     r'\[tool call\] get_weather\(\{"city": "Paris", "days": 2\}\)\n$', second)
    assert "\x1b" not in out and "Use the\ufffd[31m tool." not in second  # folded, and clean
    # /reasoning: the last answer's reasoning in full, then the next answer's as it streams
    assert "reasoning: shown in full\n[reasoning: 18 chars] of the last answer:\n" \
           "Use the\ufffd[31m tool.\n" in third
    assert third.endswith("[reasoning]\nParis is sunny.\nSunny.\n")
    assert "reasoning: folded to a summary" in out and "/reasoning     show" in \
        run_repl(FakeClient([]), ["/help"])[1]
    a, b, c = (m for m in client.sent[3] if m["role"] == "assistant")
    assert a == {"role": "assistant", "content": "Hello!", "message_id": "msg-a",
                 "reasoning_content": "The user greets me.\nBe brief."}
    assert b == {"role": "assistant", "content": "", "message_id": "msg-b",
                 "reasoning_content": "Use the\x1b[31m tool.", "tool_calls": [WEATHER]}
    assert c["reasoning_content"] == "Paris is sunny." and c["content"] == "Sunny."
    assert len(STATUS.findall(out)) == 4


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_a_placeholder_streams_then_the_summary_replaces_it(monkeypatch):
    monkeypatch.setenv("TERM", "xterm")
    monkeypatch.delenv("NO_COLOR", raising=False)
    client = FakeClient([thinking_answer("msg-a", ["Hmm."], ["Yes."]),
                         thinking_answer("msg-b", ["Hmm"])[:2] + [KeyboardInterrupt()]])
    repl, out, _ = run_repl(client, ["hi", "again"], out=Tty())
    assert "\x1b[2m[reasoning…]\x1b[0m\r\x1b[K\x1b[2m[reasoning: 4 chars, " in out
    assert "/reasoning shows it\n\x1b[0mYes.\n" in out
    # stopped while still reasoning: the summary, [stopped], and the turn is dropped
    assert out.endswith("[stopped]\x1b[0m\n") and "[reasoning: 3 chars" in out
    assert [m["role"] for m in repl.conv.messages] == ["user", "assistant"]


STATS = {"object": "kv_cache.stats", "models": {
    "tiny-a": {"hits": 3, "misses": 1, "tokens_served": 1234, "disk_hits": 1,
               "ram": {"entries": 5, "bytes": 12 << 20, "budget_bytes": 2 << 30,
                       "bytes_shared": 3 << 19, "evictions": 2},
               "disk": {"entries": 7, "bytes_on_disk": 40 << 20, "budget": 10 << 30,
                        "evictions": 1},
               "speculation": {"mode": "ngram", "decode_steps": 1200, "tokens": 2950,
                               "verify_steps": 800, "drafted": 2400, "accepted": 1750,
                               "acceptance_rate": 0.7292, "tokens_per_step": 2.4583}},
    "a-much-longer-model-name": {"hits": 0, "misses": 0, "tokens_served": 0,
                                 "ram": {"entries": 0, "bytes": 0, "budget_bytes": 1 << 30,
                                         "bytes_shared": 0, "evictions": 0},
                                 "disk": None}}}


def test_stats_is_a_table_of_the_kv_cache_route_and_json_on_request():
    client = FakeClient([answer("A", "m1", prompt=10, cached=4)],
                        {"http://fake/v1/kv_cache/stats": (200, STATS)})
    _, out, _ = run_repl(client, ["hi", "/stats"])
    lines = out.splitlines()
    head = lines.index("server KV cache (/v1/kv_cache/stats):")
    table = lines[head + 1:head + 12]
    assert table == [
        "                        tiny-a                               a-much-longer-model-name",
        "  cache hits            3 of 4 lookups (1 from disk)         0 of 0 lookups",
        "  tokens from cache     1,234                                0",
        "  RAM used              12.0 MiB of 2.0 GiB (0.6%)           0 B of 1.0 GiB (0.0%)",
        "  RAM entries           5, 1.5 MiB shared                    0, 0 B shared",
        "  disk used             40.0 MiB of 10.0 GiB (0.4%)          off",
        "  disk entries          7                                    -",
        "  evictions RAM / disk  2 pages / 1 entries                  0 pages / -",
        # speculation: the mode, draft tokens taken of those verified, tokens per decode step;
        # dashes for a server that says nothing of it
        "  speculation           ngram                                -",
        "  drafts taken          1,750 of 2,400 (72.9%)               -",
        "  tokens per step       2.46 (2,950 tokens in 1,200 passes)  -"]
    assert "{" not in out  # not a JSON dump
    assert "session: 1 turns, 10 prompt tokens, 4 from cache (40%), 3 completion tokens" in out
    _, out, _ = run_repl(client, ["/stats --json", "/stats --bogus"])
    assert '"tokens_served": 1234' in out and '"object": "kv_cache.stats"' in out
    assert "usage: /stats [--json]" in out


def test_stats_falls_back_to_health_or_shows_the_error():
    client = FakeClient([], {
        "http://fake/v1/kv_cache/stats": (404, {"error": {"message": "not found"}}),
        "http://fake/health": (200, {"status": "ok", "models": ["m"]})})
    _, out, _ = run_repl(client, ["/stats"])
    assert "server /health" in out and "  status: ok\n  models: ['m']" in out
    client.gets["http://fake/v1/kv_cache/stats"] = (401, {"error": {
        "message": "a valid API key is required", "type": "authentication_error"}})
    _, out, _ = run_repl(client, ["/stats"])
    assert "HTTP 401 authentication_error: a valid API key is required" in out


# -- the real REPL in a pseudo-terminal ---------------------------------------------------------

ANSI = re.compile(r"\x1b(?:\[[0-?]*[ -/]*[@-~]|[()][0-9A-Za-z]|[=>])")
# Make the pty the child's controlling terminal (so Ctrl-C there sends SIGINT), then exec, with
# SIGINT's default action as a terminal gives it: a suite started in the background (`.ci/run &`
# from a script) has SIGINT ignored, and an ignored SIGINT survives exec (Python then never
# raises KeyboardInterrupt).
CTTY = ("import fcntl, os, signal, sys, termios; os.setsid(); "
        "fcntl.ioctl(0, termios.TIOCSCTTY, 0); signal.signal(signal.SIGINT, signal.SIG_DFL); "
        "os.execv(sys.argv[1], sys.argv[1:])")


class Pty:
    def __init__(self, argv: list[str], env: dict):
        self.master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.proc = subprocess.Popen([sys.executable, "-c", CTTY, *argv], stdin=slave,
                                     stdout=slave, stderr=slave, env=env, cwd=ROOT)
        os.close(slave)
        self.raw, self.pos, self.eof = b"", 0, False

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode("utf-8", "replace")).replace("\r", "")

    def _pump(self, timeout: float) -> None:
        if self.eof or not select.select([self.master], [], [], timeout)[0]:
            return
        try:
            chunk = os.read(self.master, 65536)
        except OSError:  # EIO: the child closed its side
            chunk = b""
        self.raw += chunk
        self.eof = not chunk

    def expect(self, pattern: str, timeout: float = 20.0) -> re.Match:
        rx, deadline = re.compile(pattern), time.monotonic() + timeout
        while not (m := rx.search(self.text, self.pos)):
            if self.eof or time.monotonic() > deadline:
                raise AssertionError(f"no {pattern!r} in the output:\n{self.text[self.pos:]}")
            self._pump(0.05)
        self.pos = m.end()
        return m

    def type(self, line: str) -> None:
        os.write(self.master, line.encode() + b"\r")

    def wait(self, timeout: float = 20.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self._pump(0.05)
        return self.proc.wait(timeout=1)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.master)


def repl_env(home: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MLX_KVCHAT_HISTORY", "NO_COLOR")}
    return {**env, "TERM": "xterm", "HOME": str(home), "XDG_CACHE_HOME": str(home / ".cache"),
            "PROMPT_TOOLKIT_NO_CPR": "1", "LANG": "C.UTF-8", "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def server(tiny_lm):
    with running_server([tiny_lm], ServerConfig(max_tokens=8)) as url:
        yield url


def uncached(url: str, contents: list[str]) -> str:
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": c}
                for i, c in enumerate(contents)]
    r = httpx.post(f"{url}/chat/completions", timeout=60,
                   json={"messages": messages, "max_tokens": 8, "use_kv_cache": False})
    return r.json()["choices"][0]["message"]["content"]


def test_repl_in_a_pty_streams_answers_reuses_cache_and_shows_stats(server, tiny_lm, tmp_path):
    pty = Pty([sys.executable, "-m", "mlx_kvserver.clients.repl", "--url", server, "--max-tokens", "8"],
              repl_env(tmp_path))
    try:
        pty.expect(rf"mlx-kvchat: {re.escape(server)} \({re.escape(tiny_lm.name)}\)")
        pty.expect(">>>")
        answers = []
        for text in ("hello there", "tell me more"):
            pty.type(text)
            # the echoed line, the streamed answer, the status line; then the next prompt
            m = pty.expect(rf">>> {text}\n((?s:.*?))" + STATUS.pattern, timeout=30)
            answers.append(m)
            pty.expect(">>>")
        first = uncached(server, ["hello there"])
        second = uncached(server, ["hello there", first, "tell me more"])
        for m, expected in zip(answers, (first, second)):
            expected = expected.translate(_CONTROL)  # the REPL never prints control characters
            assert m.group(1) == expected + ("" if expected.endswith("\n") else "\n")
            assert 0 < int(m.group(2)) <= 8
        assert int(answers[0].group(3)) == 0  # the first turn: nothing cached yet
        cached, prompt = int(answers[1].group(3)), int(answers[1].group(4))
        assert 0 < cached < prompt  # the second turn: the history came from the cache
        pty.type("/stats")
        pty.expect(r"server KV cache \(/v1/kv_cache/stats\):\n +" + re.escape(tiny_lm.name))
        pty.expect(r"\n  cache hits +1 of 2 lookups\n  tokens from cache +\d+\n"
                   r"  RAM used +[\d.]+ KiB of 2\.0 GiB \(0\.0%\)\n")
        pty.expect(r"session: 2 turns, \d+ prompt tokens, \d+ from cache")
        pty.expect(">>>")
        pty.type("/quit")
        assert pty.wait() == 0
    finally:
        pty.close()
    history = (tmp_path / ".cache" / "mlx-kvserver" / "chat_history").read_text()
    assert "+hello there" in history and "+/stats" in history


def plain_answer(url: str, model: str, messages: list[dict]) -> dict:
    """The same chat sent by httpx without the cache (greedy: the server's temperature is 0)."""
    r = httpx.post(f"{url}/chat/completions", timeout=120, json={
        "model": model, "messages": messages, "max_tokens": 8, "use_kv_cache": False})
    assert r.status_code == 200, r.text
    return r.json()


def test_image_attaches_files_lists_them_and_sends_them_with_the_next_message(
        vision_served, tiny_lm, tmp_path):
    """On the tiny Qwen2.5-VL: /image reads a PNG and a JPEG (a missing file and a file that is
    not an image are refused with a clear message), /image lists them, and the next message
    carries both: its answer and prompt tokens equal the same chat sent by httpx with the same
    data URLs. To the text model the server's 400 is shown and the images stay attached."""
    url, vlm = vision_served
    png, jpeg = file_of(picture(64, 48)), file_of(picture(32, 32), "JPEG")
    (tmp_path / "a.png").write_bytes(png)
    (tmp_path / "b c.jpg").write_bytes(jpeg)  # a space in the name
    (tmp_path / "notes.txt").write_text("not a picture")
    client = Client(url, model=vlm.name)
    try:
        repl, out, _ = run_repl(client, [
            "/help", "/image", f"/image {tmp_path}/missing.png", f"/image {tmp_path}/notes.txt",
            f"/image {tmp_path}/a.png", f"/image {tmp_path}/b c.jpg", "/image",
            "what is in these pictures?", "/image"])
    finally:
        client.close()
    assert "/image [PATH]  attach an image file" in out
    assert out.count("no images attached (/image PATH attaches one)") == 2  # before and after
    assert f"error: no such file: {tmp_path}/missing.png" in out
    assert f"error: {tmp_path}/notes.txt: not an image (want PNG, JPEG, WEBP, GIF)" in out
    assert f"attached to the next message:\n  1. {tmp_path}/a.png (64 x 48)\n" \
           f"  2. {tmp_path}/b c.jpg (32 x 32)\n" in out
    urls = [data_url(png), "data:image/jpeg;base64," + base64.b64encode(jpeg).decode()]
    question = {"role": "user", "content": [
        *({"type": "image_url", "image_url": {"url": u}} for u in urls),
        {"type": "text", "text": "what is in these pictures?"}]}
    sent = repl.conv.messages[0]
    assert {k: v for k, v in sent.items() if k != "message_id"} == question
    plain = plain_answer(url, vlm.name, [question])
    text_only = plain_answer(url, vlm.name, [{"role": "user", "content": question["content"][2][
        "text"]}])
    assert repl.conv.messages[1]["content"] == plain["choices"][0]["message"]["content"]
    (status,) = STATUS.findall(out)
    assert int(status[2]) == plain["usage"]["prompt_tokens"] > \
        text_only["usage"]["prompt_tokens"] + 12  # 12 + 4 image tokens
    assert not repl.images

    client = Client(url, model=tiny_lm.name)
    try:
        repl, out, _ = run_repl(client, [f"/image {tmp_path}/a.png", "and this?", "/image",
                                         "/image --clear"])
    finally:
        client.close()
    assert f"error: HTTP 400 invalid_request_error: model '{tiny_lm.name}' does not take " \
           "images" in out
    assert "(1 image still attached: /image lists them, /image --clear drops them)" in out
    assert f"  1. {tmp_path}/a.png (64 x 48)" in out and repl.conv.messages == []
    assert out.endswith("no images attached\n") and not repl.images


def test_drafts_and_tokens_per_pass_from_a_real_server(server, tiny_lm):
    """The same question twice in new conversations (greedy): the second answer's drafts come
    from the first's saved tokens. Each status line's figures add up to what the server's
    speculation counters moved by, and /stats shows those counters."""
    def speculation() -> dict:
        return httpx.get(f"{server}/kv_cache/stats").json()["models"][tiny_lm.name][
            "speculation"]

    before = speculation()
    client = Client(server)
    try:
        _, out, _ = run_repl(client, ["tell me a story", "/new", "tell me a story", "/stats"])
    finally:
        client.close()
    after = speculation()
    turns = [(int(m.group(1)), m.group(4), int(m.group(5) or 0), int(m.group(6) or 0))
             for m in STATUS.finditer(out)]
    assert len(turns) == 2 and all(done == 8 and per_pass for done, per_pass, _, _ in turns)
    (_, first, *_), (_, second, taken, tried) = turns
    assert 0 < taken <= tried and float(second) > 1  # the first answer's tokens were drafts
    assert sum(t[2] for t in turns) == after["accepted"] - before["accepted"]
    assert sum(t[3] for t in turns) == after["drafted"] - before["drafted"]
    # 8 tokens a turn over its passes: the passes add up to the server's decode steps (its
    # tokens: those after each answer's first)
    passes = [round(8 / float(t[1])) for t in turns]
    assert sum(passes) == after["decode_steps"] - before["decode_steps"]
    assert after["tokens"] - before["tokens"] == 14
    rows = dict(re.findall(r"\n  (speculation|drafts taken|tokens per step) +(.+)", out))
    assert rows["speculation"] == "ngram"
    rate = 100 * after["accepted"] / after["drafted"]
    assert rows["drafts taken"] == f"{after['accepted']:,} of {after['drafted']:,} ({rate:.1f}%)"
    per_step = after["tokens"] / after["decode_steps"]
    assert rows["tokens per step"] == \
        f"{per_step:.2f} ({after['tokens']:,} tokens in {after['decode_steps']:,} passes)"


def test_ctrl_c_in_a_pty_stops_the_answer_and_cancels_generation(tiny_lm, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="mlx_kvserver.engine")
    with running_server([tiny_lm]) as url:
        pty = Pty([sys.executable, "-m", "mlx_kvserver.clients.repl", "--url", url, "--max-tokens",
                   "1500"], repl_env(tmp_path))
        try:
            pty.expect(">>>")
            pty.type("hello there")
            pty.expect(r">>> hello there\n(?s:.)")  # the answer is streaming
            os.write(pty.master, b"\x03")
            pty.expect(r"\[stopped\]\n")
            pty.expect(">>>")
            deadline = time.monotonic() + 10
            while "cancelled by the client" not in caplog.text and time.monotonic() < deadline:
                time.sleep(0.05)
            assert "cancelled by the client" in caplog.text
            pty.type("/quit")
            assert pty.wait() == 0
        finally:
            pty.close()
        assert STATUS.search(pty.text) is None  # the stopped answer has no status line


def test_piped_input_with_an_in_process_server(tiny_model_dir, tmp_path):
    """No --url: the REPL re-execs with OpenBLAS (keeping `-m`), loads the model, serves it on
    loopback; piped stdin is read as plain lines. /regen reuses the user's message cache."""
    r = subprocess.run([sys.executable, "-m", "mlx_kvserver.clients.repl", "--model", str(tiny_model_dir),
                        "--max-tokens", "4", "--kv-cache-dir", str(tmp_path / "kv")],
                       input="hello\n/regen\n/nope\n", capture_output=True, text=True,
                       timeout=120, cwd=ROOT, env=repl_env(tmp_path))
    assert r.returncode == 0, r.stderr
    status = STATUS.findall(r.stdout)
    assert len(status) == 2 and status[0][1] == "0", r.stdout
    assert 0 < int(status[1][1]) < int(status[1][2]) == int(status[0][2])
    assert "unknown command /nope" in r.stdout and "\x1b" not in r.stdout
