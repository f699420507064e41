"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API,
translated into and out of the one conversation model (``chat/conversation.py``).

What a body becomes:

- ``system`` (a string or text blocks): one system message first; the blocks' texts are joined
  by ``"\\n\\n"`` in order. A ``system`` message inside ``messages`` (the mid-conversation
  system beta) stays a system message where it is: never merged, never moved.
- content blocks: ``text`` -> text, ``thinking`` -> reasoning (``redacted_thinking`` dropped),
  ``tool_use`` -> a tool call (its ``input`` as JSON text), ``tool_result`` -> one ``tool``
  message per result, in order; text after results in the same user message becomes a user
  message after them. ``image`` blocks (base64 or url) in a user message or a tool result
  become images where they are (read in ``api/images.py``); documents and Anthropic's server
  tools are refused (400).
- a history that ends with an assistant message is a prefill: the answer continues it and its
  content is only the continuation.
- ``temperature`` absent: the server's default (``--temperature``), as on every API.

NOTE (invariant 9): ``cache_control``, ``metadata``, ``context_management``, signatures, beta
headers, ``service_tier``, ``container`` and unknown top-level fields never reach the model:
the same history renders to the same tokens on every turn.

Usage: this server caches every prompt and answer itself, with no separate cache write, so
``input_tokens`` = prompt tokens computed now, ``cache_read_input_tokens`` = prompt tokens
reused from the KV cache, ``cache_creation_input_tokens`` = 0; their sum is the whole prompt
(what ``count_tokens`` returns). The response's ``id`` (``msg_<hex>``) is the ``message_id``
the answer's KV cache is saved under; ``message_id`` on a message (this server's extension)
names it on later turns.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import (Conversation, Message, Reasoning, ResponseFormat, Sampling, Text,
                                 ToolCall, ToolChoice, ToolResult, add_text)
from ..chat.images import MEDIA_TYPES, ImageSource, base64_bytes
from ..chat.output import Error, Finish, Usage
from ..chat.tool_choice import checked
from ..errors import RequestError, bad_request
from .anthropic_output import message_body, stream
from .http import SSE_HEADERS, job_events, read_object
from .tokenize import prompt_of
from .validate import (boolean, check_history, check_message_id, integer, json_schema, model_name,
                       number, obj, one_of, optional_obj, stop_list, string, tool, tool_entries,
                       tool_list, top_k)

ROLES = ("user", "assistant", "system")
UNSERVED = ("document", "search_result", "container_upload")


def _unserved(kind: str, where: str) -> RequestError:
    return bad_request(f"{where}: {kind} blocks are not served", where,
                       code="unsupported_content")


def _image(block: dict, where: str) -> ImageSource:
    """An ``image`` block: its ``source`` base64 (``media_type``, ``data``) or a ``url``."""
    src = obj(block.get("source"), f"{where}.source")
    kind = src.get("type")
    if kind == "base64":
        media = src.get("media_type")
        if media not in MEDIA_TYPES:
            raise bad_request(f"{where}.source.media_type must be one of "
                              f"{', '.join(MEDIA_TYPES)}", where, code="invalid_image")
        data = string(src.get("data"), f"{where}.source.data")
        return ImageSource(where, where, data=base64_bytes(data, where, where))
    if kind == "url":
        return ImageSource(where, where, url=string(src.get("url"), f"{where}.source.url"))
    raise bad_request(f"{where}.source.type must be 'base64' or 'url' (files are not served)",
                      where, code="unsupported_content")


def _block(raw: Any, where: str) -> dict:
    block = obj(raw, where)
    if not isinstance(block.get("type"), str):
        raise bad_request(f"{where}.type must be a string", where)
    if block["type"] in UNSERVED:
        raise _unserved(block["type"], where)
    return block


def _text_of(block: dict, where: str) -> str:
    return string(block.get("text"), f"{where}.text", empty=True)


def _texts(content: Any, where: str, sep: str = "\n\n") -> str:
    """A string, or text blocks joined by ``sep`` (system prompts)."""
    text, _ = _texts_and_images(content, where, sep)
    return text


def _texts_and_images(content: Any, where: str, sep: str = "\n\n",
                      images: bool = False) -> tuple[str, list[ImageSource]]:
    """A string, or text blocks joined by ``sep`` and, where ``images`` (a tool result), the
    image blocks among them."""
    if isinstance(content, str):
        return string(content, where, empty=True), []
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    out, found = [], []
    for k, raw in enumerate(content):
        block = _block(raw, f"{where}[{k}]")
        if block["type"] == "image" and images:
            found.append(_image(block, f"{where}[{k}]"))
        elif block["type"] != "text":
            raise bad_request(f"{where}[{k}] must be a text block"
                              + (" or an image block" if images else "")
                              + f", not {block['type']!r}", where)
        else:
            out.append(_text_of(block, f"{where}[{k}]"))
    return sep.join(out), found


def _messages(raw: Any, role: str, i: int, names: dict[str, str]) -> list[Message]:
    """One Anthropic message as one or more internal messages (tool results apart)."""
    where = f"messages[{i}]"
    m = obj(raw, where)
    content = m.get("content")
    if content is None:
        raise bad_request(f"{where}.content is required", f"{where}.content")
    if role == "system":
        text = _texts(content, f"{where}.content")
        return [Message("system", [Text(text)] if text else [],
                        check_message_id(m.get("message_id"), f"{where}.message_id"))]
    if isinstance(content, str):
        content = [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content blocks",
                          f"{where}.content")
    out: list[Message] = []
    parts: list = []
    for k, b in enumerate(content):
        w = f"{where}.content[{k}]"
        block = _block(b, w)
        kind = block["type"]
        if kind == "text":
            add_text(parts, _text_of(block, w), "\n\n")  # blocks are paragraphs: kept apart
        elif kind == "image" and role == "user":
            parts.append(_image(block, w))
        elif kind in ("thinking", "redacted_thinking") and role == "assistant":
            if kind == "thinking":
                parts.append(Reasoning(string(block.get("thinking"), f"{w}.thinking",
                                              empty=True)))
        elif kind == "tool_use" and role == "assistant":
            call_id, name = string(block.get("id"), f"{w}.id"), string(block.get("name"),
                                                                     f"{w}.name")
            args = obj(block.get("input", {}), f"{w}.input")
            parts.append(ToolCall(call_id, name, json.dumps(args, ensure_ascii=False)))
            names[call_id] = name
        elif kind == "tool_result" and role == "user":
            if parts:
                out.append(Message(role, parts))
                parts = []
            call_id = string(block.get("tool_use_id"), f"{w}.tool_use_id")
            result = block.get("content")
            text, images = ("", []) if result is None else _texts_and_images(
                result, f"{w}.content", images=True)
            is_error = boolean(block, "is_error", False)
            out.append(Message("tool", [ToolResult(call_id, text, names.get(call_id),
                                                   is_error), *images]))
        else:
            raise bad_request(f"{w}: a {kind!r} block is not supported in a {role} message",
                              w, code="unsupported_content")
    if parts or not out:
        out.append(Message(role, parts))
    out[-1].message_id = check_message_id(m.get("message_id"), f"{where}.message_id")
    return out


def _tools(raw: Any) -> list:
    out = []
    for w, t in tool_entries(raw):
        if t.get("type", "custom") not in ("custom", None):
            raise bad_request(f"{w}: {t.get('type')!r} is one of Anthropic's server "
                              "tools, which this server does not run; only custom tools "
                              "(name, description, input_schema) are served", "tools",
                              code="unsupported_tool")
        if "input_schema" not in t:
            raise bad_request(f"{w}.input_schema is required", "tools")
        out.append(tool(t.get("name"), t.get("description"), t.get("input_schema"),
                        t.get("strict"), w))
    return tool_list(out, "tools")


def _tool_choice(raw: Any, tools: list) -> tuple[ToolChoice, bool]:
    """``tool_choice`` as (choice, parallel tool calls)."""
    if raw is None:
        return ToolChoice(), True
    raw = obj(raw, "'tool_choice'", "tool_choice")
    modes = {"auto": "auto", "any": "required", "tool": "function", "none": "none"}
    kind = one_of(raw.get("type"), modes, "'tool_choice.type' must be 'auto', 'any', 'tool' or "
                  "'none'", "tool_choice")
    name = string(raw.get("name"), "tool_choice.name", "tool_choice") if kind == "tool" \
        else None
    choice = checked(ToolChoice(modes[kind], name), tools)  # type: ignore[arg-type]
    return choice, not boolean(raw, "disable_parallel_tool_use", False)


def _thinking(raw: Any) -> bool | None:
    if raw is None:
        return None
    raw = obj(raw, "'thinking'", "thinking")
    kind = raw.get("type")
    if kind == "enabled":
        budget = raw.get("budget_tokens")
        if budget is not None and (integer(budget) is None or budget < 0):
            raise bad_request("'thinking.budget_tokens' must be a non-negative integer",
                              "thinking")
        return True
    if kind in ("disabled", "adaptive"):
        return False if kind == "disabled" else None
    raise bad_request("'thinking.type' must be 'enabled', 'disabled' or 'adaptive'", "thinking")


def _output_format(body: dict) -> ResponseFormat:
    """``output_config.format``, else the older beta's ``output_format`` (both checked)."""
    config = optional_obj(body.get("output_config"), "'output_config'", "output_config")
    effort = config.get("effort")
    if effort is not None and not isinstance(effort, str):
        raise bad_request("'output_config.effort' must be a string", "output_config")
    formats = [_format(fmt, param) for fmt, param in (
        (config.get("format"), "output_config.format"),
        (body.get("output_format"), "output_format")) if fmt is not None]
    return formats[0] if formats else ResponseFormat()


def _format(raw: Any, param: str) -> ResponseFormat:
    fmt = obj(raw, f"'{param}'", param)
    if fmt.get("type") != "json_schema":
        raise bad_request(f"'{param}.type' must be 'json_schema'", param)
    return ResponseFormat("json_schema", json_schema(fmt.get("schema"), f"{param}.schema"))


def parse(body: dict, config, count_only: bool = False) -> Conversation:
    """A checked Messages body as a :class:`Conversation` (``count_only``: a count_tokens
    body, which needs no ``max_tokens``)."""
    model = model_name(body)
    if model is None:
        raise bad_request("'model' is required", "model")
    if not count_only and body.get("max_tokens") is None:
        raise bad_request("'max_tokens' is required", "max_tokens")
    if body.get("mcp_servers") not in (None, []):
        raise bad_request("'mcp_servers': MCP connectors are not served here; run the MCP "
                          "servers in your client", "mcp_servers")
    optional_obj(body.get("metadata"), "'metadata'", "metadata")  # never reaches the model
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages: list[Message] = []
    system = body.get("system")
    if system is not None:
        text = _texts(system, "system")
        if text:
            messages.append(Message("system", [Text(text)]))
    names: dict[str, str] = {}
    for i, m in enumerate(raw):
        role = obj(m, f"messages[{i}]").get("role")
        if role not in ROLES:
            raise bad_request(f"messages[{i}].role must be 'user', 'assistant' or 'system'; "
                              f"got {role!r}", f"messages[{i}].role")
        messages += _messages(m, role, i, names)
    check_history(messages)
    tools = _tools(body.get("tools"))
    choice, parallel = _tool_choice(body.get("tool_choice"), tools)
    last = messages[-1]
    continue_final = last.role == "assistant"
    if continue_final and last.tool_calls:
        raise bad_request("the last message is an assistant message with tool_use blocks: "
                          "send their tool_result blocks in a user message", "messages")
    temperature = number(body, "temperature", config.temperature)
    if temperature > 1.0 and body.get("temperature") is not None:
        raise bad_request(f"'temperature' must be between 0 and 1, got {temperature}",
                          "temperature")
    sampling = Sampling(max_tokens=None if count_only else number(body, "max_tokens", None),
                        temperature=temperature, top_p=number(body, "top_p", 1.0),
                        top_k=top_k(body), stop=stop_list(body, "stop_sequences"))
    return Conversation(
        messages=messages, sampling=sampling, tools=tools, tool_choice=choice,
        parallel_tool_calls=parallel, response_format=_output_format(body),
        thinking=_thinking(body.get("thinking")), continue_final=continue_final, model=model,
        n=1, stream=boolean(body, "stream", False),
        use_kv_cache=boolean(body, "use_kv_cache", True),
        speculate=boolean(body, "speculate", True))


# -- answers ------------------------------------------------------------------------------------

async def handle(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    conv = parse(body, served.config)
    msg_id = f"msg_{uuid.uuid4().hex}"
    # NOTE: the response id is the answer's message_id: the key its KV cache is saved under.
    job, accepted, watch = await served.start(request, conv, job_id=msg_id, answer_ids=[msg_id])
    usage = Usage(accepted.prompt_tokens, 0, accepted.cached_tokens)
    if conv.stream:
        return StreamingResponse(stream(job, watch, msg_id, conv.model or "", usage),
                                 media_type="text/event-stream", headers=SSE_HEADERS)
    finish = None
    async for ev in job_events(job, watch):
        if isinstance(ev, Error):
            raise ev.error  # the app's guard renders it in Anthropic's shape
        if isinstance(ev, Finish):
            finish = ev
        elif isinstance(ev, Usage):
            usage = ev
    return JSONResponse(message_body(msg_id, conv.model or "", finish, usage))


async def count_tokens(served, request: Request) -> Response:
    """``{"input_tokens": N}``: what ``/v1/messages`` would report as input + cache read for
    the same body (no job is submitted)."""
    body = await read_object(request, served.config.max_body_bytes)
    conv = parse(body, served.config, count_only=True)
    _, ids = await prompt_of(served, request, conv)  # as /v1/messages renders it
    return JSONResponse({"input_tokens": len(ids)})
