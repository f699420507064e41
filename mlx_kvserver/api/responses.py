"""``/v1/responses``: OpenAI's Responses API, translated into and out of the one conversation
model (``chat/conversation.py``), and ``GET``/``DELETE /v1/responses/{id}``.

``input`` is a string or a list of items: messages (``input_text``/``output_text`` parts, and
``input_image`` parts in user messages and function call outputs, read in ``api/images.py``),
``function_call``, ``function_call_output`` and ``reasoning`` items (its ``content`` text, else its
summary; ``encrypted_content`` is ignored). Consecutive assistant-side items (reasoning, assistant
messages, function calls) make one assistant message, as one response's output does. Item ids
are ignored (invariant 9). ``instructions`` become a system message first and are not part of
the history a later ``previous_response_id`` continues (OpenAI's semantics).

Tools: ``function`` tools, and the functions of ``namespace`` tools (Codex CLI sends its MCP
tools so), offered to the model as ``<namespace>.<name>`` (``<namespace><name>`` when the
namespace ends in ``_``, ``.``, ``:`` or ``-``, as Codex's ``mcp__server__``); their calls come
back with ``name`` and ``namespace`` apart, which is what Codex routes by. Hosted tools
(``web_search``, ``file_search``, ``code_interpreter``, ``custom``, ...) are accepted and not
offered to the model: this server does not run them, and refusing them would lock out clients
that always send them (Codex sends ``web_search``).

A response's id is also the message id its answer is cached under, so ``previous_response_id``
(the stored history + that answer + the new input, rendered whole) finds the KV cache by id, also
after a restart. Stored responses (``store``, default true) live in :mod:`..storage.responses`.
Beyond OpenAI's fields: ``use_kv_cache``, ``top_k``, ``chat_template_kwargs``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import (Conversation, Message, Reasoning, ResponseFormat, Text, ToolCall,
                                 ToolResult, add_text)
from ..chat.images import ImageSource
from ..chat.output import (Error, Finish, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart,
                           Usage)
from ..errors import RequestError, bad_request
from ..storage.responses import message_from_json, message_to_json
from .http import SSE_HEADERS, job_events, openai_error_body, read_object, sse
from .openai_chat import EFFORTS, image_part, response_format, sampling, tool_choice
from .responses_output import Output, answer_message, usage_body
from .validate import (TOOL_NAME, boolean, check_history, check_message_id, model_name, number,
                       obj, one_of, optional_obj, string, text_value, tool, tool_entries,
                       tool_list)

INPUT_ROLES = ("user", "assistant", "system", "developer")
SUMMARIES = (None, "auto", "concise", "detailed")
LOGPROBS = "message.output_text.logprobs"
log = logging.getLogger("mlx_kvserver.api.responses")
TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")
# A namespace's function is offered as "<namespace>.<name>": the two fit one tool name.
MAX_NAMESPACE, MAX_NAMESPACED = 63, 64


def flat_name(namespace: str, name: str) -> str:
    """The name a namespace's function is offered to the model under."""
    return namespace + name if namespace.endswith(("_", ".", ":", "-")) \
        else f"{namespace}.{name}"


# -- request -> Conversation ---------------------------------------------------------------------

def _parts_text(content: Any, where: str, param: str = "input") -> str:
    """A string, or text parts (``input_text``, ``output_text``, ...) joined."""
    return "".join(p.text for p in _parts(content, where, param) if isinstance(p, Text))


def _parts(content: Any, where: str, param: str = "input", images: bool = False) -> list:
    """A string, or text parts joined and, where ``images`` (a user message, a function call's
    output), ``input_image`` parts in their places."""
    if isinstance(content, str):
        text = text_value(content, where, param)
        return [Text(text)] if text else []
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts", param)
    out: list = []
    for i, part in enumerate(content):
        w, kind = f"{where}[{i}]", part.get("type") if isinstance(part, dict) else None
        if kind == "input_image" and images:
            out.append(_image(part, w, param))
            continue
        if kind in ("input_image", "input_file", "input_audio"):
            raise bad_request(f"{w}: {kind} parts are not supported here", param,
                              code="unsupported_content")
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{w} must be a text part ({{'type': 'input_text', "
                              "'text': ...}})", param)
        add_text(out, text_value(part["text"], f"{w}.text", param))
    return out


def _image(part: dict, where: str, param: str) -> ImageSource:
    """An ``input_image`` part: its ``image_url``; a ``file_id`` is refused (this server has no
    Files API)."""
    if part.get("file_id") is not None and part.get("image_url") is None:
        raise bad_request(f"{where}: input_image with a file_id is not supported (this server "
                          "has no Files API); send image_url as a data URL "
                          "('data:image/png;base64,...')", param, code="unsupported_content")
    return image_part(part, where, param)


def _reasoning_text(item: dict, where: str) -> str:
    """A reasoning item's ``content`` text, else its summary's (we send both the same)."""
    content, summary = item.get("content"), item.get("summary")
    text = "" if content is None else _parts_text(content, f"{where}.content")
    if summary is not None and not isinstance(summary, list):
        raise bad_request(f"{where}.summary must be a list", "input")
    summarized = "\n\n".join(_parts_text([p], f"{where}.summary[{k}]")  # checked either way
                             for k, p in enumerate(summary or []))
    return text or summarized


def input_messages(raw: Any) -> list[Message]:
    """``input`` as messages (ids dropped: invariant 9)."""
    if isinstance(raw, str) and raw:
        return [Message("user", [Text(text_value(raw, "'input'", "input"))])]
    if not isinstance(raw, list) or not raw:
        raise bad_request("'input' must be a non-empty string or a non-empty list of items",
                          "input")
    out: list[Message] = []

    def assistant() -> Message:
        if not out or out[-1].role != "assistant":
            out.append(Message("assistant"))
        return out[-1]

    for i, item in enumerate(raw):
        w = f"input[{i}]"
        item = obj(item, w, "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in INPUT_ROLES:
                raise bad_request(f"{w}.role must be one of {', '.join(INPUT_ROLES)}; got "
                                  f"{role!r}", "input")
            parts = _parts(item.get("content"), f"{w}.content", images=role == "user")
            if role == "assistant":
                if parts:
                    assistant().parts.extend(parts)
            else:
                out.append(Message(role, parts))
        elif kind == "reasoning":
            text = _reasoning_text(item, w)
            if text:
                assistant().parts.append(Reasoning(text))
        elif kind == "function_call":
            name = string(item.get("name"), f"{w}.name", "input")
            if item.get("namespace") is not None:
                name = flat_name(string(item["namespace"], f"{w}.namespace", "input"), name)
            args = item.get("arguments", "{}")
            if isinstance(args, dict):
                args = json.dumps(args, ensure_ascii=False)
            assistant().parts.append(ToolCall(
                string(item.get("call_id"), f"{w}.call_id", "input"), name,
                string(args, f"{w}.arguments", "input", empty=True) or "{}"))
        elif kind == "function_call_output":
            call_id = string(item.get("call_id"), f"{w}.call_id", "input")
            output = _parts(item.get("output"), f"{w}.output", images=True)
            text = "".join(p.text for p in output if isinstance(p, Text))
            out.append(Message("tool", [ToolResult(call_id, text),
                                        *(p for p in output if not isinstance(p, Text))]))
        else:
            raise bad_request(f"{w}: items of type {kind!r} are not supported (messages, "
                              "function_call, function_call_output, reasoning)", "input",
                              code="unsupported_item")
    return out


def _tools(raw: Any) -> list:
    out = []
    for w, t in tool_entries(raw):
        kind = t.get("type")
        if kind == "function":
            out.append(tool(t.get("name"), t.get("description"), t.get("parameters"),
                            t.get("strict"), w))
        elif kind == "namespace":
            ns = _name(t.get("name"), MAX_NAMESPACE, f"{w}.name")
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise bad_request(f"{w}.tools must be a list of function tools", "tools")
            for k, f in enumerate(inner):
                f = obj(f, f"{w}.tools[{k}]", "tools")
                if one_of(f.get("type", "function"), ("function", "custom"),
                          f"{w}.tools[{k}].type must be 'function' or 'custom'",
                          "tools") == "function":  # custom ones: not offered
                    name = _name(f.get("name"), MAX_NAMESPACED, f"{w}.tools[{k}].name")
                    out.append(tool(flat_name(ns, name), f.get("description"),
                                    f.get("parameters"), f.get("strict"), f"{w}.tools[{k}]"))
        elif not isinstance(kind, str):
            raise bad_request(f"{w}.type must be a string", "tools")
        # NOTE: hosted tools (web_search, file_search, ...) are not offered: we do not run them.
    return tool_list(out, "tools")


def _name(raw: Any, longest: int, where: str) -> str:
    """A namespace's name or one of its functions' (together they make one tool name)."""
    if not isinstance(raw, str) or not TOOL_NAME.match(raw) or len(raw) > longest:
        raise bad_request(f"{where} must be 1-{longest} letters, digits, '_', '.', ':' or '-'",
                          "tools")
    return raw


def namespaces(raw_tools: Any) -> dict[str, tuple[str, str]]:
    """Flat name -> (namespace, name) of a checked ``tools`` list's namespaced functions."""
    out = {}
    for t in raw_tools or []:
        if t.get("type") == "namespace":
            for f in t["tools"]:
                if f.get("type", "function") == "function":
                    out[flat_name(t["name"], f["name"])] = (t["name"], f["name"])
    return out


def _text_format(body: dict) -> ResponseFormat:
    text = optional_obj(body.get("text"), "'text'", "text")
    return response_format(text.get("format"), "text.format", flat=True)


def _reasoning(body: dict) -> tuple[dict, bool | None]:
    r = optional_obj(body.get("reasoning"), "'reasoning'", "reasoning")
    effort, summary = r.get("effort"), r.get("summary")
    if effort is not None and effort not in EFFORTS:
        raise bad_request(f"'reasoning.effort' must be one of {', '.join(EFFORTS)}",
                          "reasoning.effort")
    if summary not in SUMMARIES:
        raise bad_request("'reasoning.summary' must be 'auto', 'concise' or 'detailed'",
                          "reasoning.summary")
    thinking = None if effort is None else effort not in ("none", "minimal")
    return {"effort": effort, "summary": summary}, thinking


def parse(body: dict, config, previous: list[Message] | None = None) -> Conversation:
    """A checked ``/v1/responses`` body as a :class:`Conversation`; ``previous`` is the stored
    history that ``previous_response_id`` names (its answer last)."""
    if boolean(body, "background", False):
        raise bad_request("'background' responses are not supported", "background")
    if body.get("conversation") is not None:
        raise bad_request("'conversation' is not supported; use previous_response_id",
                          "conversation")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise bad_request("'instructions' must be a string", "instructions")
    messages = [Message("system", [Text(text_value(instructions, "'instructions'",
                                                   "instructions"))])] if instructions else []
    messages += list(previous or []) + input_messages(body.get("input"))
    check_history(messages, "input")
    if messages[-1].role == "assistant" and messages[-1].tool_calls:
        raise bad_request("the input ends with a function_call that has no "
                          "function_call_output", "input")
    tools = _tools(body.get("tools"))
    raw_choice = body.get("tool_choice")
    if isinstance(raw_choice, dict) and raw_choice.get("namespace") is not None:
        raw_choice = {"type": raw_choice.get("type"), "name": flat_name(
            string(raw_choice["namespace"], "'tool_choice.namespace'", "tool_choice"),
            string(raw_choice.get("name"), "'tool_choice.name'", "tool_choice"))}
    try:
        s = sampling({**body, "max_tokens": body.get("max_output_tokens")}, config)
    except RequestError as e:
        if e.param == "max_tokens":
            e.param, e.message = "max_output_tokens", e.message.replace("'max_tokens'",
                                                                        "'max_output_tokens'")
        raise
    include = body.get("include")
    if include is not None and (not isinstance(include, list)
                                or not all(isinstance(x, str) for x in include)):
        raise bad_request("'include' must be a list of strings", "include")
    s.logprobs = LOGPROBS in (include or [])
    top_logprobs = number(body, "top_logprobs", 0)
    s.top_logprobs = top_logprobs if s.logprobs else 0
    kwargs = optional_obj(body.get("chat_template_kwargs"), "'chat_template_kwargs'",
                          "chat_template_kwargs")
    optional_obj(body.get("metadata"), "'metadata'", "metadata")
    boolean(body, "store", True)
    return Conversation(
        messages=messages, sampling=s, tools=tools,
        tool_choice=tool_choice(raw_choice, tools, flat=True),
        parallel_tool_calls=boolean(body, "parallel_tool_calls", True),
        response_format=_text_format(body), thinking=_reasoning(body)[1],
        template_kwargs=dict(kwargs), model=model_name(body),
        stream=boolean(body, "stream", False), use_kv_cache=boolean(body, "use_kv_cache", True),
        speculate=boolean(body, "speculate", True))


# -- answers --------------------------------------------------------------------------------------

class _Run:
    """One response: its body as the client sees it, its events, and storing it."""

    def __init__(self, rid, body, conv, job, accepted, history, store):
        self.rid, self.body, self.conv, self.job = rid, body, conv, job
        self.history, self.store = history, store
        self.usage = Usage(accepted.prompt_tokens, 0, accepted.cached_tokens)
        self.out = Output(namespaces(body.get("tools")), conv.sampling.logprobs)
        self.error: RequestError | None = None
        self.response: dict = self._body("in_progress")

    def _body(self, status: str, incomplete: dict | None = None, error: dict | None = None):
        b, s = self.body, self.conv.sampling
        done = status != "in_progress"
        return {
            "id": self.rid, "object": "response", "created_at": self.job.created,
            "status": status, "background": False, "error": error,
            "incomplete_details": incomplete, "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"), "model": self.job.lm.name,
            "output": self.out.items if done else [], "output_text": self.out.output_text(),
            "parallel_tool_calls": self.conv.parallel_tool_calls,
            "previous_response_id": b.get("previous_response_id"),
            "prompt_cache_key": b.get("prompt_cache_key"), "reasoning": _reasoning(b)[0],
            "service_tier": b.get("service_tier") or "default",
            "store": boolean(b, "store", True), "temperature": s.temperature,
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice") or "auto", "tools": b.get("tools") or [],
            "top_p": s.top_p, "truncation": b.get("truncation") or "disabled",
            "usage": usage_body(self.usage) if done else None, "user": b.get("user"),
            "metadata": b.get("metadata") or {}}

    async def events(self, watch) -> AsyncIterator[dict]:
        yield {"type": "response.created", "response": self.response}
        yield {"type": "response.in_progress", "response": self.response}
        finish = None
        async for ev in job_events(self.job, watch):
            if isinstance(ev, TextDelta):
                events = self.out.text(ev.text, ev.logprobs)
            elif isinstance(ev, ReasoningDelta):
                events = self.out.reasoning(ev.text)
            elif isinstance(ev, ToolCallStart):
                events = self.out.call(ev.id, ev.name)
            elif isinstance(ev, ToolCallDelta):
                events = self.out.arguments(ev.call, ev.arguments)
            elif isinstance(ev, Finish):
                finish, events = ev, self.out.finish(ev)
            elif isinstance(ev, Error):
                self.error = err = ev.error
                self.response = self._body("failed", error={
                    "code": "server_error" if err.status >= 500 else "invalid_prompt",
                    "message": err.message})
                yield {"type": "response.failed", "response": self.response}
                return
            else:
                events = []
                if isinstance(ev, Usage):
                    self.usage = ev
            for e in events:
                yield e
        length = finish is not None and finish.reason == "length"
        self.response = self._body("incomplete" if length else "completed",
                                   {"reason": "max_output_tokens"} if length else None)
        if finish is not None and self.response["store"]:
            history = self.history + [answer_message(finish, self.rid)]
            await asyncio.to_thread(self.store.put, self.rid, {  # off the loop: it fsyncs
                "response": self.response, "history": [message_to_json(m) for m in history]})
        yield {"type": f"response.{self.response['status']}", "response": self.response}

    async def stream(self, watch) -> AsyncIterator[str]:
        n = 0
        async for e in self.events(watch):
            yield sse({**e, "sequence_number": n}, event=e["type"])
            n += 1


def _not_found(what: str, rid: str, param: str | None = None,
               code: str | None = None) -> RequestError:
    shown = rid if len(rid) <= 200 else rid[:200] + "..."
    return RequestError(404, f"{what} with id '{shown}' not found.", param=param, code=code)


def conversation(served, body: dict) -> Conversation:
    """``body`` as a :class:`Conversation`, after the stored history its
    ``previous_response_id`` names (a 404 when there is none)."""
    previous: list[Message] = []
    prev_id = check_message_id(body.get("previous_response_id"), "previous_response_id")
    if prev_id is not None:
        record = served.responses.get(prev_id)
        try:
            previous = [message_from_json(m) for m in record["history"]]  # type: ignore[index]
        except (TypeError, KeyError, ValueError):
            raise _not_found("Previous response", prev_id, "previous_response_id",
                             "previous_response_not_found")
    return parse(body, served.config, previous)


async def handle(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    store = served.responses
    conv = conversation(served, body)
    history = conv.messages[1:] if body.get("instructions") else conv.messages
    rid = f"resp_{uuid.uuid4().hex}"
    try:
        job, accepted, watch = await served.start(request, conv, job_id=rid, answer_ids=[rid])
    except RequestError as e:
        if e.param == "messages":  # the engine's name for the conversation: here, the input
            e.param = "input"
        raise
    run = _Run(rid, body, conv, job, accepted, history, store)
    if conv.stream:
        return StreamingResponse(run.stream(watch), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    async for _ in run.events(watch):
        pass
    if run.error is not None:
        return JSONResponse(openai_error_body(run.error), status_code=run.error.status)
    return JSONResponse(run.response)


async def handle_id(served, request: Request) -> Response:
    """``GET`` a stored response, or ``DELETE`` it."""
    rid = request.path_params["response_id"]
    store = served.responses
    if request.method == "DELETE":
        if not store.delete(rid):
            raise _not_found("Response", rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})
    record = store.get(rid)
    if record is None:
        raise _not_found("Response", rid)
    return JSONResponse(record["response"])
