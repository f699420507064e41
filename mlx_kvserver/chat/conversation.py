"""The one conversation model every API translates into and out of.

A request, whichever API it came through (OpenAI chat, completions, Responses, Anthropic
Messages), becomes a :class:`Conversation`: messages made of parts (text, images, reasoning, tool
calls, tool results), the tool list, the tool choice, sampling and output constraints. The engine
takes only this model; the answer comes back as :mod:`.output` events and parts, which each API
turns into its own shapes.

NOTE (invariant 9): only what reaches the model is here. Fields that do not (``cache_control``,
metadata, item ids other than ``message_id``) are dropped by the API modules, so the same history
renders to the same tokens whichever API and whichever turn it came through.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, Union

ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class Reasoning:
    """A thinking model's reasoning (shown apart from the answer)."""

    text: str


@dataclass(frozen=True)
class ToolCall:
    """A call the model made: ``arguments`` is the JSON text of an object (for a call the model
    wrote badly, the text as written, and ``problem`` says what is wrong with it:
    ``chat/call_events.py``)."""

    id: str
    name: str
    arguments: str = "{}"
    problem: str | None = field(default=None, compare=False)

    def arguments_object(self) -> Any:
        """The arguments parsed (a dict for well-formed calls; the raw text otherwise)."""
        try:
            return json.loads(self.arguments)
        except ValueError:
            return self.arguments


@dataclass(frozen=True)
class ToolResult:
    """The result of a tool call, answered by the client."""

    call_id: str
    content: str
    name: str | None = None
    is_error: bool = False


@dataclass(frozen=True)
class Image:
    """A picture in a message, decoded (``chat/images.py``): ``rgb`` holds its pixels row by
    row, three bytes each. Two images are the same when their ``digest`` is: a hash of the size
    and the pixels, so the same picture sent as another file is the same image."""

    digest: str
    width: int
    height: int
    rgb: bytes = field(default=b"", repr=False, compare=False)


Part = Union[Text, Reasoning, ToolCall, ToolResult, Image]


def add_text(parts: list, text: str, sep: str = "") -> None:
    """``text`` put at the end of ``parts``: joined by ``sep`` to the text part it follows, else
    a part of its own (an empty text adds nothing)."""
    if text and parts and isinstance(parts[-1], Text):
        parts[-1] = Text(parts[-1].text + sep + text)
    elif text:
        parts.append(Text(text))


@dataclass
class Message:
    role: str  # one of ROLES
    parts: list[Part] = field(default_factory=list)
    message_id: str | None = None

    @property
    def text(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, Text))

    @property
    def reasoning(self) -> str:
        return "".join(p.text for p in self.parts if isinstance(p, Reasoning))

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [p for p in self.parts if isinstance(p, ToolCall)]

    @property
    def tool_results(self) -> list[ToolResult]:
        return [p for p in self.parts if isinstance(p, ToolResult)]

    @property
    def images(self) -> list[Image]:
        return [p for p in self.parts if isinstance(p, Image)]


@dataclass(frozen=True)
class Tool:
    """A function the model may call: ``parameters`` is a JSON Schema object."""

    name: str
    description: str = ""
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """``auto`` (the model decides), ``none`` (no calls), ``required`` (at least one call) or
    ``function`` (a call of ``name``)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


@dataclass(frozen=True)
class ResponseFormat:
    """An output constraint on the answer's text: ``text`` (none), ``json_object`` (any JSON
    object) or ``json_schema`` (an instance of ``schema``)."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema: dict | None = None
    name: str | None = None
    strict: bool = True


@dataclass
class Sampling:
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass
class Conversation:
    """Everything a request asks of the engine, whatever API it came through.

    ``prompt`` is set instead of ``messages`` for a raw completion (``/v1/completions``): a text
    or token ids run as they are, with no chat template. ``continue_final`` continues the last
    (assistant) message instead of starting a new one (Anthropic's prefill,
    ``continue_final_message``). ``thinking`` switches a thinking template on or off (None: the
    template's default); ``template_kwargs`` go to the chat template as they are.
    """

    messages: list[Message] = field(default_factory=list)
    sampling: Sampling = field(default_factory=Sampling)
    tools: list[Tool] = field(default_factory=list)
    tool_choice: ToolChoice = field(default_factory=ToolChoice)
    parallel_tool_calls: bool = True
    response_format: ResponseFormat = field(default_factory=ResponseFormat)
    thinking: bool | None = None
    template_kwargs: dict = field(default_factory=dict)
    continue_final: bool = False
    prompt: str | list[int] | None = None
    model: str | None = None
    n: int = 1
    stream: bool = False
    use_kv_cache: bool = True
    echo: bool = False  # completions: the prompt's text comes back before the answer
    speculate: bool = True  # drafts verified in the batch (never changes the answer)
    prediction: str | None = None  # a client's guess of the answer (OpenAI's Predicted Outputs)

    @property
    def images(self) -> list[Image]:
        """Every image of the conversation, in order."""
        return [im for m in self.messages for im in m.images]

    @property
    def calls_tools(self) -> bool:
        """Whether the model is offered tools (and so its output is parsed for calls)."""
        return bool(self.tools) and self.tool_choice.mode != "none"
