"""A :class:`Conversation` rendered to prompt text through the model's own chat template.

Messages go to the template in Hugging Face's shapes: tools as
``{"type": "function", "function": {"name", "description", "parameters"}}``, an assistant's
calls as ``tool_calls: [{"id", "type": "function", "function": {"name", "arguments": {...}}}]``,
its reasoning as ``reasoning_content``, results as ``{"role": "tool", "tool_call_id", "name",
"content"}``; ``developer`` renders as ``system``. Tools reach the prompt whatever the tool
choice, so changing ``tool_choice`` between turns keeps the prompt (and its cache) the same.

The fallback, for a template that cannot render tools (``ChatFormat.native_tools`` False, e.g.
SmolLM2's ChatML) or whose call format we cannot parse:

- the tool list goes at the START of the first message when it is a system message (a new
  system message otherwise): :data:`TOOLS_INTRO`, then one line per tool,
  ``{"name": ..., "description": ..., "parameters": {...}}``, then :data:`TOOLS_HOW`. At the start,
  because agents end their system prompts with what changes (dates, folders, git status);
- an assistant's calls become its text followed by ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one per line (what the parser reads back);
- results become ``<tool_response>\\n...\\n</tool_response>`` blocks in a *user* message
  (consecutive results share one): every template renders ``user``, templates that enforce
  user/assistant alternation keep it, and the models were trained on user turns, not on a
  ``tool`` role that only some templates would print. A result's images (a model that takes
  them) go inside its block, after its text, one a line.

With a template that renders results itself, a result with images is a tool message whose
content is parts (its text, then ``{"type": "image"}`` for each image), as a user message's.

gpt-oss's Harmony template (``ChatFormat.harmony``) reads other shapes: the leading system and
developer messages become one (its first message becomes the developer message's instructions,
beside the tools), later ones user messages starting with :data:`SYSTEM_PREFIX` (it would drop
them); the reasoning goes in ``thinking`` (an ``analysis`` message, rendered only before a call
that no final answer follows yet); an assistant message with calls becomes one message per call
(it renders only the first), each followed by its result (it names a result after the call just
before), the text joined to the reasoning (it renders no text beside a call).

System messages after the first stay where they are. A template that raises on them gets them as
user messages whose text starts with :data:`SYSTEM_PREFIX`; if it still raises (templates that
enforce alternation), that text is joined to the user message just before it (or after it).

Rendering is a function of the conversation's content alone (invariant 9): the same messages
render to the same text every turn. Whether turn N's prompt is a prefix of turn N+1's is the
template's doing: ChatML, Qwen2.5 and Qwen3 inside a tool loop keep it; Qwen3 drops the reasoning
of turns before the last user message; Mistral v0.3 moves the tools and the system prompt to the
last user message; Llama 3.1 and gpt-oss print today's date; gpt-oss drops the analysis once a
final answer follows, and renders a call's header in another order than the model writes it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from ..errors import RequestError
from .conversation import (Conversation, Image, Message, Reasoning, Text, Tool, ToolCall,
                           ToolResult)
from .formats import ChatFormat

TOOLS_INTRO = ("# Tools\n\nYou can call these tools. Each line is one tool: its name, what it "
               "does and the JSON schema of its arguments.")
TOOLS_HOW = ('To call a tool, answer with <tool_call>{"name": <tool name>, "arguments": '
             '<the arguments as a JSON object>}</tool_call>, one such block per call. Each '
             "result comes back in <tool_response></tool_response>.")
SYSTEM_PREFIX = "[System message]\n"
_RESPONSE_END = "</tool_response>"
TEXT_PARTS = (Text, Reasoning, ToolCall, ToolResult)  # what a text prompt renders (no images)
_RESERVED = {"messages", "tools", "documents", "chat_template", "add_generation_prompt",
             "continue_final_message", "tokenize", "return_dict"}


@dataclass(frozen=True)
class Rendered:
    """A rendered prompt: ``text``, and ``in_reasoning`` when it ends inside an open think block
    (a template whose generation prompt ends with ``<think>\\n``)."""

    text: str
    in_reasoning: bool = False


def encode(tok: Any, fmt: ChatFormat, conv: Conversation) -> tuple[list[int], Rendered]:
    """``conv`` rendered (``render``) and its text encoded: the prompt's token ids as the engine
    runs them, and the rendering."""
    rendered = render(tok, fmt, conv)
    return tok.encode(rendered.text), rendered


def render(tok: Any, fmt: ChatFormat, conv: Conversation, images: bool = False) -> Rendered:
    """``conv`` rendered with ``tok``'s chat template (a ``ChatTokenizer``). A template error,
    or ``template_kwargs`` that name the template's own arguments, are a ``RequestError`` 400.
    With ``images`` (a model that takes them), a user message with images goes to the template
    as a list of parts, ``{"type": "image"}`` where each image is (the template writes its
    placeholder there); a message without images stays a string, as for a text model."""
    allowed = (*TEXT_PARTS, Image) if images else TEXT_PARTS
    if any(not isinstance(p, allowed) for m in conv.messages for p in m.parts):
        raise RequestError(400, "this model's prompt is rendered as text only: it does not take "
                           "images", param="messages", code="images_not_supported")
    bad = sorted(_RESERVED & set(conv.template_kwargs))
    if bad:
        raise RequestError(400, f"template_kwargs may not set {', '.join(bad)}",
                           param="chat_template_kwargs")
    kwargs = dict(conv.template_kwargs)
    if conv.thinking is not None and fmt.thinking_kwarg:
        kwargs.setdefault(fmt.thinking_kwarg, conv.thinking)
    msgs = _messages(fmt, conv.messages, images)
    tools = [hf_tool(t) for t in conv.tools] if conv.tools and fmt.native_tools else None
    if fmt.harmony:
        msgs = _harmony(msgs)
        # its template writes every tool's description: one is always there
        tools = [{**t, "function": {"description": "", **t["function"]}}
                 for t in tools] if tools else None
    if not fmt.native_tools:
        msgs = _with_tool_block(_merge_results(msgs), conv.tools)

    def apply(ms: list[dict]) -> str:
        out = tok.hf.apply_chat_template(
            ms, chat_template=tok.chat_template, tools=tools, tokenize=False,
            add_generation_prompt=not conv.continue_final,
            continue_final_message=conv.continue_final, **kwargs)
        return out if isinstance(out, str) else str(out)

    mid = [i for i, m in enumerate(msgs) if m["role"] == "system" and i > 0]
    attempts = [msgs] + ([_as_user(msgs, mid), _folded(msgs, mid)] if mid else [])
    error: Exception | None = None
    for ms in attempts:
        try:
            text = apply(ms)
            break
        except Exception as e:  # noqa: BLE001 - templates raise anything (TemplateError, ...)
            error = error or e
    else:
        raise RequestError(400, f"the model's chat template cannot render this conversation: "
                           f"{error}", param="messages") from error
    return Rendered(text, _in_reasoning(fmt, text, conv.continue_final))


def tools_block(tools: list[Tool]) -> str:
    """The fallback's description of ``tools`` (what goes at the start of the system prompt)."""
    lines = [json.dumps({"name": t.name, **({"description": t.description} if t.description
                                            else {}), "parameters": t.parameters},
                        ensure_ascii=False) for t in tools]
    return "\n".join([TOOLS_INTRO, *lines, "", TOOLS_HOW])


def fallback_call(call: ToolCall) -> str:
    """One call in the fallback format: ``<tool_call>{"name", "arguments"}</tool_call>``."""
    body = json.dumps({"name": call.name, "arguments": call.arguments_object()},
                      ensure_ascii=False)
    return f"<tool_call>{body}</tool_call>"


def hf_tool(t: Tool) -> dict:
    """``t`` in Hugging Face's shape (what templates and mlx-lm's parsers take)."""
    fn: dict[str, Any] = {"name": t.name}
    if t.description:
        fn["description"] = t.description
    fn["parameters"] = t.parameters
    return {"type": "function", "function": fn}


def _messages(fmt: ChatFormat, messages: list[Message], images: bool = False) -> list[dict]:
    names = {c.id: c.name for m in messages for c in m.tool_calls}
    ident = _mistral_id if fmt.tool_parser == "mistral" else (lambda s: s)
    out: list[dict] = []
    for m in messages:
        role = "system" if m.role == "developer" else m.role
        if role == "assistant":
            out.append(_assistant(fmt, m, ident))
            continue
        if role not in ("user", "tool"):
            out.append({"role": role, "content": m.text})
            continue
        parts = m.parts if role == "user" or m.tool_results else [ToolResult("", m.text)]
        texts: list[str | Image] = []
        result: dict | None = None  # the result just rendered: a tool message's images join it
        for p in parts:  # results, text and images, in their order
            if isinstance(p, ToolResult):
                if texts:
                    out.append({"role": "user", "content": _content(texts)})
                    texts = []
                result = _result(fmt, p, p.name or names.get(p.call_id), ident)
                out.append(result)
            elif isinstance(p, Text) and role == "user":
                texts.append(p.text)
            elif isinstance(p, Image) and images and role == "user":
                texts.append(p)
            elif isinstance(p, Image) and images and result is not None:
                result["content"] = _with_image(result["content"], fmt.native_tools)
        if texts or (role == "user" and not m.tool_results):
            out.append({"role": "user", "content": _content(texts)})
    return out


def _content(texts: list[str | Image]) -> str | list[dict]:
    """A user message's content: its text joined, or where it holds images, its parts in order
    in Hugging Face's shapes (``{"type": "text", "text"}``, ``{"type": "image"}``)."""
    return _joined(*(IMAGE if isinstance(t, Image) else t for t in texts))


IMAGE = [{"type": "image"}]  # an image's place in a message's content (the template's placeholder)


def _joined(*contents: str | list[dict]) -> str | list[dict]:
    """Message contents one after the other: a string where all are strings, else their parts
    in order, text next to text joined into one part and empty text left out."""
    if all(isinstance(c, str) for c in contents):
        return "".join(contents)  # type: ignore[arg-type]
    out: list[dict] = []
    for c in contents:
        for part in [{"type": "text", "text": c}] if isinstance(c, str) else c:
            if part["type"] != "text":
                out.append(dict(part))
            elif part["text"] and out and out[-1]["type"] == "text":
                out[-1] = {"type": "text", "text": out[-1]["text"] + part["text"]}
            elif part["text"]:
                out.append(dict(part))
    return out


def _with_image(content: str | list[dict], native: bool) -> list[dict]:
    """A tool result's content with an image after what it holds: at the end of a tool
    message's content (``native``: the template renders the result), else inside the
    fallback's ``<tool_response>`` block, before its closing tag."""
    if native:
        return _joined(content, IMAGE)  # type: ignore[return-value]
    parts = _joined(content, IMAGE[:0])
    head, end = parts[:-1], parts[-1]["text"]
    cut = end.rindex(_RESPONSE_END)
    return _joined(head, end[:cut], IMAGE, "\n" + end[cut:])  # type: ignore[return-value]


def _assistant(fmt: ChatFormat, m: Message, ident: Any) -> dict:
    msg: dict[str, Any] = {"role": "assistant", "content": m.text}
    if m.reasoning:
        msg["reasoning_content"] = m.reasoning
    calls = m.tool_calls
    if calls and fmt.native_tools:
        msg["tool_calls"] = [{"id": ident(c.id), "type": "function", "function": {
            "name": c.name, "arguments": c.arguments_object()}} for c in calls]
    elif calls:
        text = "\n".join(fallback_call(c) for c in calls)
        msg["content"] = f"{m.text}\n{text}" if m.text else text
    return msg


def _result(fmt: ChatFormat, r: ToolResult, name: str | None, ident: Any) -> dict:
    if not fmt.native_tools:
        return {"role": "user", "content": f"<tool_response>\n{r.content}\n{_RESPONSE_END}",
                "_result": True}
    msg = {"role": "tool", "tool_call_id": ident(r.call_id), "content": r.content}
    if name:
        msg["name"] = name
    return msg


def _with_tool_block(msgs: list[dict], tools: list[Tool]) -> list[dict]:
    if not tools:
        return msgs
    block = tools_block(tools)
    if msgs and msgs[0]["role"] == "system":
        first = msgs[0]["content"]
        return [{**msgs[0], "content": f"{block}\n\n{first}" if first else block}, *msgs[1:]]
    return [{"role": "system", "content": block}, *msgs]


def _merge_results(msgs: list[dict]) -> list[dict]:
    """Fallback: consecutive results share one user message, user text after them joins it."""
    out: list[dict] = []
    for m in msgs:
        prev = out[-1] if out else None
        if prev is not None and prev.get("_result") and m["role"] == "user":
            out[-1] = {**prev, "content": _joined(prev["content"], "\n", m["content"]),
                       "_result": m.get("_result", False)}
        else:
            out.append(m)
    return [{k: v for k, v in m.items() if k != "_result"} for m in out]


def _as_user(msgs: list[dict], mid: list[int]) -> list[dict]:
    return [{"role": "user", "content": SYSTEM_PREFIX + m["content"]} if i in mid else m
            for i, m in enumerate(msgs)]


def _folded(msgs: list[dict], mid: list[int]) -> list[dict]:
    """Each mid-conversation system text joined to the user message before it (else after)."""
    out = [dict(m) for m in _as_user(msgs, mid)]
    gone: set[int] = set()
    for i in mid:
        text = out[i]["content"]
        j = next((k for k in range(i - 1, -1, -1) if k not in gone), None)
        if j is not None and out[j]["role"] == "user" and j not in mid:
            out[j]["content"] = _joined(out[j]["content"], "\n\n" + text)
        elif i + 1 < len(out) and out[i + 1]["role"] == "user":
            out[i + 1]["content"] = _joined(text + "\n\n", out[i + 1]["content"])
        else:
            continue
        gone.add(i)
    return [m for i, m in enumerate(out) if i not in gone]


def _harmony(msgs: list[dict]) -> list[dict]:
    """``msgs`` in the shapes gpt-oss's template reads (see the module's doc)."""
    lead = next((i for i, m in enumerate(msgs) if m["role"] != "system"), len(msgs))
    out = [{"role": "system", "content": "\n\n".join(m["content"] for m in msgs[:lead]
                                                     if m["content"])}] if lead else []
    rest = msgs[lead:]
    i = 0
    while i < len(rest):
        m = rest[i]
        i += 1
        if m["role"] == "system":
            out.append({"role": "user", "content": SYSTEM_PREFIX + m["content"]})
            continue
        if m["role"] != "assistant":
            out.append(m)
            continue
        reasoning, text = m.get("reasoning_content", ""), m["content"]
        calls = m.get("tool_calls")
        if not calls:
            out.append({"role": "assistant", "content": text,
                        **({"thinking": reasoning} if reasoning else {})})
            continue
        thinking = "\n\n".join(t for t in (reasoning, text) if t)
        results = []
        while i < len(rest) and rest[i]["role"] == "tool":
            results.append(rest[i])
            i += 1
        for k, call in enumerate(calls):  # one call a message, each followed by its result
            out.append({"role": "assistant", "content": "", "tool_calls": [call],
                        **({"thinking": thinking} if thinking and k == 0 else {})})
            mine = [r for r in results if r.get("tool_call_id") == call["id"]]
            out += mine if k < len(calls) - 1 else results
            results = [r for r in results if r not in mine]
    return out


def _mistral_id(call_id: str) -> str:
    """Mistral's templates take only 9-character alphanumeric ids: a stable one from ``call_id``
    (the same on the call and on its result, and on every turn)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    n = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
    chars = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
    return "".join(chars[(n >> (6 * k)) % 62] for k in range(9))


def _in_reasoning(fmt: ChatFormat, text: str, continued: bool) -> bool:
    if not fmt.think_start or not fmt.think_end:
        return False
    i = text.rfind(fmt.think_start)
    if i < 0 or fmt.think_end in text[i:]:
        return False
    return continued or not text[i + len(fmt.think_start):].strip()
