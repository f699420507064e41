"""A thinking template drops earlier reasoning: the next turn is prepared while the engine is
idle, so it reads only its new message (and answers exactly as without the cache)."""

from __future__ import annotations

import time
from dataclasses import replace
from types import SimpleNamespace

import openai
import pytest

from mlx_kvserver.chat.conversation import (Conversation, Message, Reasoning, Text, Tool, ToolCall,
                                            ToolResult)
from mlx_kvserver.chat.output import Finish
from mlx_kvserver.chat.render import render
from mlx_kvserver.chat.support import chat_support
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.engine.prepare import next_turn_tokens
from mlx_kvserver.models.loading import resolve_and_load
from tests.chat.tiny_chat_model import make_tiny_chat_model_dir
from harness.server_utils import make_engine, running_server


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return resolve_and_load(str(make_tiny_chat_model_dir(
        tmp_path_factory.mktemp("q3") / "tiny-qwen3", "qwen3_strict")))


def idle(engine, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while engine.busy:
        assert time.monotonic() < deadline, "the engine stayed busy"
        time.sleep(0.02)


def test_next_turn_reads_only_its_new_message(qwen3, tmp_path):
    config = ServerConfig(max_tokens=8, kv_cache_dir=tmp_path / "kv", page_size=8)
    engine = make_engine([qwen3], config)
    with running_server([qwen3], config, engine=engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        history = [{"role": "user", "content": "Plan the trip."}]
        first = client.chat.completions.create(model=qwen3.name, messages=history,
                                               temperature=0)
        msg = first.choices[0].message
        assert msg.model_extra.get("reasoning_content")  # the template opened a think block
        answer = {"role": "assistant", "content": msg.content or "",
                  "reasoning_content": msg.model_extra["reasoning_content"]}
        idle(engine)  # the prepared next turn is read here, before the next request
        history.append(answer)
        history.append({"role": "user", "content": "And the way back?"})
        second = client.chat.completions.create(model=qwen3.name, messages=history,
                                                temperature=0)
        cached = second.usage.prompt_tokens_details.cached_tokens
        # without preparing, reuse stops where the template dropped the reasoning, inside
        # turn 1's prompt; prepared, it covers turn 1 and its answer
        assert cached > first.usage.prompt_tokens, (cached, first.usage)
        tail = "And the way back?<|im_end|>\n<|im_start|>assistant\n<think>\n"
        # what is read: the new message (its role header at most one token more)
        assert second.usage.prompt_tokens - cached <= len(qwen3.tokenizer.encode(tail)) + 2
        cold = client.chat.completions.create(model=qwen3.name, messages=history,
                                              temperature=0,
                                              extra_body={"use_kv_cache": False})
        assert second.choices[0].message.model_extra.get("reasoning_content") == \
            cold.choices[0].message.model_extra.get("reasoning_content")
        assert second.choices[0].message.content == cold.choices[0].message.content


def test_nothing_is_prepared_when_the_template_keeps_the_answer(tiny_lm, tmp_path):
    config = ServerConfig(max_tokens=4, kv_cache_dir=tmp_path / "kv")
    engine = make_engine([tiny_lm], config)
    with running_server([tiny_lm], config, engine=engine) as url:
        client = openai.OpenAI(base_url=url, api_key="x", max_retries=0)
        client.chat.completions.create(model=tiny_lm.name, temperature=0,
                                       messages=[{"role": "user", "content": "hi"}])
        assert not engine.schedulers[tiny_lm.name].prepares


def test_after_tool_calls_the_next_turn_is_rendered_with_a_tool_result(qwen3):
    """An answer that reasoned and called a tool: the prepared tokens are what the next turn
    (its tool result appended) renders, up to the result itself."""
    support = chat_support(qwen3)
    conv = Conversation(messages=[Message("user", [Text("Find the file.")])])
    call = ToolCall("call_7", "search", '{"q": "file"}')
    finish = Finish(0, "tool_calls", "m1", "", reasoning="I should search.",
                    tool_calls=(call,))
    request = SimpleNamespace(conversation=conv, lm=qwen3, support=support)
    tok = qwen3.tokenizer
    prompt = tok.encode(render(tok, support.format, conv).text)
    tokens = next_turn_tokens(request, finish, prompt + tok.encode("I should search."))
    # in a tool loop the template keeps the reasoning (no new user query yet)
    later = Conversation(messages=[*conv.messages,
                                   Message("assistant", [Reasoning("I should search."), call]),
                                   Message("tool", [ToolResult("call_7", "found it")])])
    full = tok.encode(render(tok, support.format, later).text)
    assert tokens is not None and len(tokens) > len(prompt)
    assert full[:len(tokens)] == tokens
    assert len(full) - len(tokens) <= len(tok.encode("found it\n</tool_response><|im_end|>\n"
                                                    "<|im_start|>assistant\n<think>\n")) + 2


def _harmony_next_turn(answer_text: str, finish: Finish):
    """(prepared tokens, the next turn's prompt tokens) after gpt-oss wrote ``answer_text``."""
    from tests.chat.templates import make_chat_tokenizer

    tok = make_chat_tokenizer("gpt_oss")
    support = chat_support(SimpleNamespace(tokenizer=tok, model=None, chat=None))
    weather = Tool("get_weather", "Weather", {"type": "object", "properties": {}})
    conv = Conversation(messages=[Message("user", [Text("Weather in Paris?")])], tools=[weather])
    request = SimpleNamespace(conversation=conv, lm=SimpleNamespace(tokenizer=tok),
                              support=support)
    prompt = tok.encode(render(tok, support.format, conv).text)
    tokens = next_turn_tokens(request, finish, prompt + tok.encode(answer_text))
    answer = Message("assistant", ([Reasoning(finish.reasoning)] if finish.reasoning else []) +
                     ([Text(finish.text)] if finish.text else []) + list(finish.tool_calls))
    nxt = Message("tool", [ToolResult("c1", "18C")]) if finish.tool_calls else \
        Message("user", [Text("Thanks")])
    later = Conversation(messages=[*conv.messages, answer, nxt], tools=conv.tools)
    return tokens, tok.encode(render(tok, support.format, later).text)


@pytest.mark.parametrize("reasoning", ["", "Need the tool."])
def test_harmony_call_is_prepared_in_the_templates_shape(reasoning: str) -> None:
    """gpt-oss writes a call's recipient after its channel; its template renders it before:
    the next turn is prepared even with no reasoning to drop."""
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    analysis = f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant" \
        if reasoning else ""
    text = (analysis + '<|channel|>commentary to=functions.get_weather <|constrain|>json'
            '<|message|>{"city": "Paris"}')
    tokens, full = _harmony_next_turn(text, Finish(0, "tool_calls", "m1", "", reasoning,
                                                   tool_calls=(call,)))
    assert tokens is not None and full[:len(tokens)] == tokens
    assert len(full) - len(tokens) <= 12  # the result's message, not the history


def test_harmony_final_answer_drops_its_analysis_next_turn() -> None:
    text = ("<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final"
            "<|message|>Sunny.")
    tokens, full = _harmony_next_turn(text, Finish(0, "stop", "m1", "Sunny.", "Easy."))
    assert tokens is not None and full[:len(tokens)] == tokens
    # with no reasoning and no call the answer renders as the model wrote it: nothing to do
    plain = "<|channel|>final<|message|>Sunny."
    assert _harmony_next_turn(plain, Finish(0, "stop", "m1", "Sunny."))[0] is None


def test_harmony_final_answer_after_a_call_drops_the_calls_analysis() -> None:
    """A final answer with no reasoning of its own, after a call whose analysis the prompt
    held: the next turn leaves that analysis out, so it is prepared."""
    from tests.chat.templates import make_chat_tokenizer

    tok = make_chat_tokenizer("gpt_oss")
    support = chat_support(SimpleNamespace(tokenizer=tok, model=None, chat=None))
    call = ToolCall("c1", "get_weather", '{"city": "Paris"}')
    conv = Conversation(messages=[Message("user", [Text("Weather?")]),
                                  Message("assistant", [Reasoning("Need the tool."), call]),
                                  Message("tool", [ToolResult("c1", "18C")])])
    request = SimpleNamespace(conversation=conv, lm=SimpleNamespace(tokenizer=tok),
                              support=support)
    prompt = tok.encode(render(tok, support.format, conv).text)
    finish = Finish(0, "stop", "m1", "18C.")
    tokens = next_turn_tokens(request, finish, prompt + tok.encode(
        "<|channel|>final<|message|>18C."))
    later = replace(conv, messages=[*conv.messages, Message("assistant", [Text("18C.")]),
                                    Message("user", [Text("Thanks")])])
    full = tok.encode(render(tok, support.format, later).text)
    assert tokens is not None and full[:len(tokens)] == tokens
    assert "Need the tool." not in tok.decode(tokens)
