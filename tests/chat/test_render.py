"""Rendering conversations through real chat templates (tests/chat/templates.py)."""

from __future__ import annotations

import re

import pytest

from mlx_kvserver.chat.conversation import (Conversation, Image, Message, Reasoning, Text, Tool,
                                            ToolCall, ToolResult)
from mlx_kvserver.chat.formats import detect
from mlx_kvserver.chat.render import SYSTEM_PREFIX, TOOLS_HOW, TOOLS_INTRO, render
from mlx_kvserver.errors import RequestError
from tests.chat.templates import QWEN25, make_chat_tokenizer

WEATHER = Tool("get_weather", "Weather of a city",
               {"type": "object", "properties": {"city": {"type": "string"}},
                "required": ["city"]})
TIME = Tool("get_time", parameters={"type": "object", "properties": {}})


def msg(role: str, *parts, mid: str | None = None) -> Message:
    return Message(role, [Text(p) if isinstance(p, str) else p for p in parts], mid)


def call(cid: str = "call_1", city: str = "Paris") -> ToolCall:
    return ToolCall(cid, "get_weather", f'{{"city": "{city}"}}')


def render_family(family: str, messages: list[Message], **kw):
    tok = make_chat_tokenizer(family)
    return render(tok, detect(tok), Conversation(messages=messages, **kw))


def tool_loop() -> list[Message]:
    return [msg("system", "Be brief."), msg("user", "Weather in Paris?"),
            msg("assistant", Reasoning("I need the tool."), call()),
            msg("tool", ToolResult("call_1", "18C"))]


@pytest.mark.parametrize("family", ["qwen25", "qwen3", "llama31", "mistral", "smollm2"])
def test_tools_reach_the_prompt(family: str) -> None:
    text = render_family(family, tool_loop(), tools=[WEATHER, TIME]).text
    assert "get_weather" in text and "Weather of a city" in text and "get_time" in text
    assert "18C" in text


def test_qwen25_calls_and_results_in_the_templates_own_shapes() -> None:
    text = render_family("qwen25", tool_loop(), tools=[WEATHER]).text
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
            '{"city": "Paris"}}\n</tool_call><|im_end|>\n') in text
    assert "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_llama31_call_and_ipython_result() -> None:
    text = render_family("llama31", tool_loop(), tools=[WEATHER]).text
    assert '{"name": "get_weather", "parameters": {"city": "Paris"}}<|eot_id|>' in text
    assert '<|start_header_id|>ipython<|end_header_id|>\n\n"18C"<|eot_id|>' in text


def test_mistral_ids_are_nine_characters_the_same_on_call_and_result() -> None:
    text = render_family("mistral", tool_loop(), tools=[WEATHER]).text
    ids = re.findall(r'"id": "(\w+)"', text) + re.findall(r'"call_id": "(\w+)"', text)
    assert len(ids) == 2 and ids[0] == ids[1] and len(ids[0]) == 9 and ids[0].isalnum()
    assert ids[0] == re.findall(r'"id": "(\w+)"', render_family(
        "mistral", tool_loop(), tools=[WEATHER]).text)[0]  # stable


def test_fallback_format_exactly() -> None:
    msgs = tool_loop() + [msg("assistant", "It is 18C.")]
    text = render_family("smollm2", msgs + [msg("user", "Thanks")], tools=[WEATHER]).text
    tools = ('{"name": "get_weather", "description": "Weather of a city", "parameters": '
             '{"type": "object", "properties": {"city": {"type": "string"}}, '
             '"required": ["city"]}}')
    assert text == (
        f"<|im_start|>system\n{TOOLS_INTRO}\n{tools}\n\n{TOOLS_HOW}\n\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nWeather in Paris?<|im_end|>\n"
        '<|im_start|>assistant\n<tool_call>{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n18C\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\nIt is 18C.<|im_end|>\n"
        "<|im_start|>user\nThanks<|im_end|>\n<|im_start|>assistant\n")


def test_fallback_without_a_system_message_adds_one_first() -> None:
    text = render_family("smollm2", [msg("user", "Hi")], tools=[TIME]).text
    assert text.startswith(f"<|im_start|>system\n{TOOLS_INTRO}\n")
    assert "SmolLM" not in text  # the template's default system prompt gave way
    assert "SmolLM" in render_family("smollm2", [msg("user", "Hi")]).text


def test_fallback_results_share_one_user_message_with_the_text_after_them() -> None:
    msgs = [msg("user", "Both?"),
            msg("assistant", "Checking.", call("c1"), call("c2", "Rome")),
            msg("tool", ToolResult("c1", "18C")), msg("tool", ToolResult("c2", "25C")),
            msg("user", "And?")]
    anthropic = msgs[:2] + [msg("user", ToolResult("c1", "18C"), ToolResult("c2", "25C"),
                                "And?")]
    text = render_family("smollm2", msgs, tools=[WEATHER]).text
    assert text == render_family("smollm2", anthropic, tools=[WEATHER]).text
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>{"name": "get_weather", "arguments":'
            ' {"city": "Paris"}}</tool_call>\n<tool_call>') in text
    assert ("<|im_start|>user\n<tool_response>\n18C\n</tool_response>\n<tool_response>\n25C\n"
            "</tool_response>\nAnd?<|im_end|>\n<|im_start|>assistant\n") in text


def _turns(family: str, tools: list[Tool], **kw) -> None:
    """Each turn's prompt is a prefix of the next turn's rendering of the same history."""
    hist = [msg("system", "Be brief."), msg("user", "Weather in Paris?")]
    answers = [msg("assistant", Reasoning("Tool."), call()),
               msg("tool", ToolResult("call_1", "18C")),
               msg("assistant", "It is 18C."), msg("user", "And Rome?"),
               msg("assistant", call("call_2", "Rome")), msg("tool", ToolResult("call_2", "25C"))]
    prompts = []
    for m in [None, *answers]:
        hist = hist + ([m] if m else [])
        if hist[-1].role != "assistant":
            prompts.append(render_family(family, hist, tools=tools, **kw).text)
    for a, b in zip(prompts, prompts[1:]):
        assert b.startswith(a), (family, a[-200:], b[len(a) - 200:])


@pytest.mark.parametrize("family", ["qwen25", "llama31", "smollm2"])
@pytest.mark.parametrize("tools", [[], [WEATHER]])
def test_turn_n_prompt_is_a_prefix_of_turn_n_plus_1(family: str, tools: list[Tool]) -> None:
    _turns(family, tools)


def test_qwen3_prefix_holds_in_a_tool_loop_but_old_reasoning_is_dropped() -> None:
    loop = tool_loop()
    turn1 = render_family("qwen3", loop[:2], tools=[WEATHER]).text
    turn2 = render_family("qwen3", loop, tools=[WEATHER]).text
    assert turn2.startswith(turn1)
    assert "<think>\nI need the tool.\n</think>\n\n<tool_call>" in turn2
    # after the next user message the template leaves the earlier reasoning out (its design)
    turn3 = render_family("qwen3", loop + [msg("assistant", "18C."), msg("user", "Rome?")],
                          tools=[WEATHER]).text
    assert "I need the tool." not in turn3


def test_rendering_is_deterministic_and_ignores_ids() -> None:
    a = render_family("qwen3", tool_loop(), tools=[WEATHER]).text
    ided = [Message(m.role, m.parts, f"msg-{i}") for i, m in enumerate(tool_loop())]
    assert render_family("qwen3", ided, tools=[WEATHER]).text == a


@pytest.mark.parametrize("family", ["qwen25", "qwen3", "llama31", "smollm2"])
def test_developer_renders_as_system(family: str) -> None:
    dev = render_family(family, [msg("developer", "Rules."), msg("user", "Hi")]).text
    assert dev == render_family(family, [msg("system", "Rules."), msg("user", "Hi")]).text
    assert "developer" not in dev


def test_thinking_switch() -> None:
    msgs = [msg("user", "Hi")]
    on, off, default = (render_family("qwen3", msgs, thinking=t) for t in (True, False, None))
    assert on.text == default.text and on.text.endswith("<|im_start|>assistant\n")
    assert off.text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not on.in_reasoning and not off.in_reasoning
    # a template whose generation prompt opens the think block
    strict_on = render_family("qwen3_strict", msgs)
    assert strict_on.text.endswith("<think>\n") and strict_on.in_reasoning
    assert not render_family("qwen3_strict", msgs, thinking=False).in_reasoning
    # explicit template_kwargs win; a template without the switch ignores it
    assert render_family("qwen3", msgs, thinking=True,
                         template_kwargs={"enable_thinking": False}).text == off.text
    assert render_family("qwen25", msgs, thinking=False).text == \
        render_family("qwen25", msgs).text


def test_template_kwargs_pass_through_and_reserved_names_are_refused() -> None:
    text = render_family("llama31", [msg("user", "Hi")],
                         template_kwargs={"date_string": "01 Jan 2030"}).text
    assert "Today Date: 01 Jan 2030" in text
    with pytest.raises(RequestError) as e:
        render_family("llama31", [msg("user", "Hi")], template_kwargs={"tools": []})
    assert e.value.status == 400 and "tools" in e.value.message


def test_mid_conversation_system_stays_in_place() -> None:
    msgs = [msg("system", "Main."), msg("user", "Hi"), msg("system", "Reminder."),
            msg("assistant", "Hello"), msg("user", "Bye")]
    text = render_family("qwen25", msgs).text
    assert ("<|im_start|>user\nHi<|im_end|>\n<|im_start|>system\nReminder.<|im_end|>\n"
            "<|im_start|>assistant\nHello<|im_end|>") in text
    assert text.startswith("<|im_start|>system\nMain.<|im_end|>")
    # a template that refuses it: a user message with a clear prefix, in the same place
    text = render_family("qwen3_strict", msgs).text
    assert (f"<|im_start|>user\nHi<|im_end|>\n<|im_start|>user\n{SYSTEM_PREFIX}Reminder."
            "<|im_end|>\n<|im_start|>assistant\n") in text
    # a template that also enforces alternation: joined to the user message before it
    text = render_family("mistral", msgs).text
    assert f"[INST] Hi\n\n{SYSTEM_PREFIX}Reminder.[/INST] Hello</s>" in text


@pytest.mark.parametrize("template", ["{{ raise_exception('no tools for you') }}",
                                      "{% for m in messages %}{{ m.content ",
                                      "{{ messages[0].content + none }}"])
def test_template_errors_are_400(template: str) -> None:
    tok = make_chat_tokenizer("smollm2", template=template)
    with pytest.raises(RequestError) as e:
        render(tok, detect(tok), Conversation(messages=[msg("user", "Hi")]))
    assert e.value.status == 400 and "chat template" in e.value.message


def test_an_image_is_never_rendered_away() -> None:
    """A text prompt has no place for an image: refused, not rendered without it."""
    picture = Image("0" * 64, 2, 1, bytes(6))
    for messages in ([msg("user", "What is this?", picture)],
                     [msg("user", "a"), msg("assistant", call()),
                      msg("tool", ToolResult("call_1", "shot"), picture)]):
        with pytest.raises(RequestError) as e:
            render_family("qwen25", messages)
        assert e.value.status == 400 and e.value.code == "images_not_supported"


def test_a_model_that_takes_images_gets_its_placeholders_in_place() -> None:
    """With ``images``, a user message with images goes to the template as parts, each image
    where it was; one without stays a string (rendered as for a text model)."""
    from harness.tiny_vlm import CHAT_TEMPLATE

    picture = Image("0" * 64, 2, 1, bytes(6))
    tok = make_chat_tokenizer("qwen25", CHAT_TEMPLATE)
    conv = Conversation(messages=[msg("user", "Look: ", picture, " and ", picture, "?"),
                                  msg("assistant", "Two."), msg("user", "Sure?")])
    text = render(tok, detect(tok), conv, images=True).text
    pad = "<|vision_start|><|image_pad|><|vision_end|>"
    assert text == (f"<|im_start|>user\nLook: {pad} and {pad}?<|im_end|>\n"
                    "<|im_start|>assistant\nTwo.<|im_end|>\n<|im_start|>user\nSure?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = Conversation(messages=[msg("user", "Sure?")])
    assert render(tok, detect(tok), plain, images=True) == render(tok, detect(tok), plain)


def test_alternation_errors_are_400() -> None:
    with pytest.raises(RequestError) as e:
        render_family("mistral", [msg("user", "a"), msg("user", "b")])
    assert e.value.status == 400 and "alternate" in e.value.message


def test_continue_final_prefills_the_answer() -> None:
    r = render_family("qwen25", [msg("user", "Hi"), msg("assistant", "Hello, I am")],
                      continue_final=True)
    assert r.text.endswith("<|im_start|>assistant\nHello, I am") and not r.in_reasoning
    r = render_family("qwen3_strict", [msg("user", "Hi"), msg("assistant", "<think>\nHmm")],
                      continue_final=True)
    assert r.in_reasoning


def test_result_names_come_from_their_calls() -> None:
    from mlx_kvserver.chat.render import _messages
    fmt = detect(make_chat_tokenizer("qwen25"))
    out = _messages(fmt, tool_loop())
    assert out[-1] == {"role": "tool", "tool_call_id": "call_1", "content": "18C",
                       "name": "get_weather"}
    assert out[2]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]
    assert out[2]["reasoning_content"] == "I need the tool."


# -- gpt-oss's Harmony template -----------------------------------------------------------------

def test_harmony_system_developer_reasoning_calls_and_results() -> None:
    msgs = [msg("system", "Be brief."), msg("developer", "Use metric."), *tool_loop()[1:],
            msg("system", "Late note.")]
    text = render_family("gpt_oss", msgs, tools=[WEATHER]).text
    # the leading system and developer messages are the developer message's instructions,
    # beside the tools; a later one is a user message (the template would drop it)
    assert ("<|start|>developer<|message|># Instructions\n\nBe brief.\n\nUse metric.\n\n"
            "# Tools\n\n## functions") in text
    assert "// Weather of a city\ntype get_weather = (_: {\ncity: string,\n}) => any;" in text
    assert text.endswith(f"<|start|>user<|message|>{SYSTEM_PREFIX}Late note.<|end|>"
                         "<|start|>assistant")
    # the reasoning of a call that no final answer follows yet is its analysis message
    assert ("<|start|>user<|message|>Weather in Paris?<|end|>"
            "<|start|>assistant<|channel|>analysis<|message|>I need the tool.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"'
            "<|end|>") in text


def test_harmony_drops_the_analysis_once_a_final_answer_follows() -> None:
    loop = tool_loop()
    turn1 = render_family("gpt_oss", loop[:2], tools=[WEATHER]).text
    turn2 = render_family("gpt_oss", loop, tools=[WEATHER]).text
    assert turn2.startswith(turn1) and "I need the tool." in turn2
    final = msg("assistant", Reasoning("It says 18C."), "18C.")
    turn3 = render_family("gpt_oss", loop + [final, msg("user", "Rome?")], tools=[WEATHER]).text
    assert "I need the tool." not in turn3 and "It says 18C." not in turn3
    assert "<|start|>assistant<|channel|>final<|message|>18C.<|end|><|start|>user" in turn3
    assert turn3 == render_family("gpt_oss", loop + [final, msg("user", "Rome?")],
                                  tools=[WEATHER]).text  # the same history, the same text


def test_harmony_one_call_a_message_each_followed_by_its_result() -> None:
    """The template renders one call per message and names a result after the call before it:
    two calls become two messages, each followed by its own result, whatever their order; text
    beside the calls joins the reasoning."""
    msgs = [msg("user", "Weather and time?"),
            msg("assistant", Reasoning("Both."), "Checking.", call(),
                ToolCall("call_2", "get_time", "{}")),
            msg("tool", ToolResult("call_2", "noon")), msg("tool", ToolResult("call_1", "18C"))]
    text = render_family("gpt_oss", msgs, tools=[WEATHER, TIME]).text
    assert ("<|start|>assistant<|channel|>analysis<|message|>Both.\n\nChecking.<|end|>"
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris"}<|call|><|start|>functions.get_weather to=assistant'
            '<|channel|>commentary<|message|>"18C"<|end|>'
            "<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}"
            '<|call|><|start|>functions.get_time to=assistant<|channel|>commentary<|message|>'
            '"noon"<|end|><|start|>assistant') in text


PAD = "<|vision_start|><|image_pad|><|vision_end|>"
SHOT = Tool("screenshot", "The screen as a picture", {"type": "object", "properties": {}})


def images_in(template: str, where: str) -> str:
    """``template`` with ``where`` (where it prints a message's content) printing content parts
    instead, an image's placeholder for each image, as vision models' templates do."""
    parts = ("{%- if message.content is string %}{{- message.content }}{%- else %}"
             "{%- for part in message.content %}{%- if part.type == 'image' %}"
             f"{{{{- '{PAD}' }}}}"
             "{%- elif part.type == 'text' %}{{- part.text }}{%- endif %}{%- endfor %}"
             "{%- endif %}")
    assert where in template
    return template.replace(where, parts + "\n" * where.endswith("\n"))


def screenshot_loop(*result) -> list[Message]:
    return [msg("user", "Look at the screen."),
            msg("assistant", ToolCall("call_1", "screenshot", "{}")),
            msg("tool", ToolResult("call_1", "the screen"), *result), msg("user", "And now?")]


def test_an_image_in_a_tool_result_is_shown_inside_the_fallbacks_tool_response() -> None:
    """A template without tools (the fallback): a result's images go inside its
    ``<tool_response>`` block, after its text, in the user message that carries it."""
    from harness.tiny_vlm import CHAT_TEMPLATE

    picture = Image("0" * 64, 2, 1, bytes(6))
    tok = make_chat_tokenizer("qwen25", CHAT_TEMPLATE)
    conv = Conversation(messages=screenshot_loop(picture, picture), tools=[SHOT])
    text = render(tok, detect(tok), conv, images=True).text
    assert (f"<|im_start|>user\n<tool_response>\nthe screen\n{PAD}\n{PAD}\n</tool_response>\n"
            "And now?<|im_end|>\n") in text
    assert text.count(PAD) == 2
    # without the images, the result renders as before
    plain = Conversation(messages=screenshot_loop(), tools=[SHOT])
    assert "<tool_response>\nthe screen\n</tool_response>\nAnd now?" in \
        render(tok, detect(tok), plain, images=True).text


def test_an_image_in_a_tool_result_goes_to_a_native_template_in_the_tool_message() -> None:
    """A template that renders tool results itself gets a result with images as a tool
    message whose content is parts (its text, then each image), as it gets a user message."""
    template = images_in(QWEN25, "        {{- message.content }}\n")
    picture = Image("0" * 64, 2, 1, bytes(6))
    tok = make_chat_tokenizer("qwen25", template)
    assert detect(tok).native_tools
    conv = Conversation(messages=screenshot_loop(picture), tools=[SHOT])
    text = render(tok, detect(tok), conv, images=True).text
    assert f"<tool_response>\nthe screen{PAD}\n</tool_response>" in text
    assert text.count(PAD) == 1
    # Qwen2.5's own template prints a tool message's content as it is: no placeholder
    tok = make_chat_tokenizer("qwen25")
    assert PAD not in render(tok, detect(tok), conv, images=True).text
