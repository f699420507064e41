"""``POST /v1/chat/completions``: OpenAI's chat API, translated into and out of the one
conversation model (``chat/conversation.py``).

Beyond OpenAI's fields: ``message_id`` on messages (the cache's key), ``use_kv_cache``,
``speculate`` (drafts verified in the batch; ``false`` turns them off for this request),
``top_k``, ``chat_template_kwargs`` (handed to the chat template), ``continue_final_message``
(also implied by a history that ends with an assistant message: the answer continues it).
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import (Conversation, Message, Reasoning, ResponseFormat, Sampling, Text,
                                 ToolCall, ToolChoice, ToolResult, add_text)
from ..chat.images import ImageSource
from ..chat.output import (Error, Finish, ReasoningDelta, Start, TextDelta, TokenLogprob,
                           ToolCallDelta, ToolCallStart, Usage)
from ..chat.tool_choice import checked
from ..errors import bad_request
from .http import SSE_HEADERS, collect, job_events, openai_error_body, read_object, sse
from .validate import (ROLES, boolean, check_history, check_message_id, json_schema, model_name,
                       neutral_only, number, obj, one_of, optional_obj, seed_value, stop_list,
                       string, text_value, tool, tool_entries, tool_list, top_k)

EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
DETAILS = ("auto", "low", "high")  # an image part's detail


def _content(content: Any, where: str, images: bool = False) -> list:
    """A message's content as parts: its text (text parts joined) and, where ``images`` (a
    user or tool message), its ``image_url`` parts in their places."""
    if isinstance(content, str):
        text = text_value(content, f"{where}.content", f"{where}.content")
        return [Text(text)] if text else []
    if content is None:
        return []
    if not isinstance(content, list):
        raise bad_request(f"{where}.content must be a string or a list of content parts",
                          f"{where}.content")
    parts: list = []
    for i, part in enumerate(content):
        w, kind = f"{where}.content[{i}]", part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            if not images:
                raise bad_request(f"{w}: images are taken in user and tool messages only",
                                  f"{where}.content", code="unsupported_content")
            parts.append(image_part(part, w, f"{where}.content"))
            continue
        if kind in ("input_audio", "file"):
            raise bad_request(f"{w}: {kind} parts are not supported", f"{where}.content",
                              code="unsupported_content")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"{w} must be a text part ({{'type': 'text', 'text': ...}})"
                              + (" or an image_url part" if images else ""), f"{where}.content")
        add_text(parts, text_value(part["text"], f"{w}.text", f"{where}.content"))
    return parts


def image_part(part: dict, where: str, param: str) -> ImageSource:
    """An ``image_url`` part: ``{"image_url": {"url": ..., "detail": ...}}`` (or the URL as a
    string, as the Responses API's ``input_image`` has it): a data URL, or an http(s) URL (read
    in ``api/images.py``)."""
    raw = part.get("image_url")
    url = raw.get("url") if isinstance(raw, dict) else raw
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.image_url.url must be a data URL "
                          "('data:image/png;base64,...') or an http(s) URL", param)
    # OpenAI's detail (taken, not used: the model reads the image at its processor's size)
    detail = raw.get("detail") if isinstance(raw, dict) else part.get("detail")
    if detail is not None and detail not in DETAILS:
        raise bad_request(f"{where}: detail must be one of {', '.join(DETAILS)}", param)
    return ImageSource(where, param, url=url)


def _text(parts: list) -> str:
    return "".join(p.text for p in parts if isinstance(p, Text))


def _calls(raw: Any, where: str) -> list[ToolCall]:
    if raw is None:
        return []
    if not isinstance(raw, list):
        raise bad_request(f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    calls = []
    for k, c in enumerate(raw):
        w = f"{where}.tool_calls[{k}]"
        c = obj(c, w)
        fn = obj(c.get("function"), f"{w}.function")
        args = fn.get("arguments", "{}")
        if isinstance(args, dict):
            args = json.dumps(args, ensure_ascii=False)
        calls.append(ToolCall(string(c.get("id"), f"{w}.id"), string(fn.get("name"),
                                                                      f"{w}.function.name"),
                              string(args, f"{w}.function.arguments", empty=True) or "{}"))
    return calls


def _message(m: Any, i: int) -> Message:
    where = f"messages[{i}]"
    m = obj(m, where)
    role = m.get("role")
    if role not in ROLES:
        raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                          f"{where}.role")
    mid = check_message_id(m.get("message_id"), f"{where}.message_id")
    content = _content(m.get("content"), where, images=role in ("user", "tool"))
    if role == "tool":  # its text is the result, its images follow it
        call_id = string(m.get("tool_call_id"), f"{where}.tool_call_id")
        return Message("tool", [ToolResult(call_id, _text(content)),
                                *(p for p in content if isinstance(p, ImageSource))], mid)
    parts: list = []
    if role == "assistant":  # the reasoning under either name (both checked), the first given
        thoughts = [string(m[k], f"{where}.{k}", empty=True)
                    for k in ("reasoning_content", "reasoning") if m.get(k) is not None]
        if thoughts:
            parts.append(Reasoning(thoughts[0]))
    parts += content
    if role == "assistant":
        parts += _calls(m.get("tool_calls"), where)
    return Message(role, parts, mid)


def _tools(body: dict) -> list:
    out = []
    for w, t in tool_entries(body.get("tools")):
        if t.get("type", "function") != "function":
            raise bad_request(f"{w}: only function tools are supported, not "
                              f"{t.get('type')!r}", "tools")
        fn = obj(t.get("function"), f"{w}.function", "tools")
        out.append(tool(fn.get("name"), fn.get("description"), fn.get("parameters"),
                        fn.get("strict"), f"{w}.function"))
    return tool_list(out, "tools")


def tool_choice(raw: Any, tools: list, flat: bool = False) -> ToolChoice:
    """OpenAI's ``tool_choice``: chat's shape (the name under ``function``) or, ``flat``, the
    Responses API's (the name beside ``type``); checked against ``tools`` in ``chat/``."""
    if raw is None:
        return ToolChoice()
    param = "tool_choice"
    shape = "{'type': 'function', 'name': ...}" if flat else \
        "{'type': 'function', 'function': {'name': ...}}"
    if isinstance(raw, str):
        choice = ToolChoice(one_of(raw, ("auto", "none", "required"),  # type: ignore[arg-type]
                                   f"'{param}' must be 'auto', 'none', 'required' or {shape}",
                                   param))
    elif isinstance(raw, dict) and raw.get("type") == "function":
        fn = raw if flat else obj(raw.get("function"), f"{param}.function", param)
        where = f"{param}.name" if flat else f"{param}.function.name"
        choice = ToolChoice("function", string(fn.get("name"), where))
    else:
        raise bad_request(f"'{param}' must be 'auto', 'none', 'required' or {shape}", param)
    return checked(choice, tools)


def response_format(raw: Any, param: str = "response_format",
                    flat: bool = False) -> ResponseFormat:
    """A response format in chat's shape (the schema under ``json_schema``) or, ``flat``, in
    the Responses API's (``text.format``: name, schema and strict beside ``type``)."""
    if raw is None:
        return ResponseFormat()
    raw = obj(raw, f"'{param}'", param)
    kind = raw.get("type")
    if kind == "text":
        return ResponseFormat()
    if kind == "json_object":
        return ResponseFormat("json_object")
    if kind == "json_schema":
        spec = raw if flat else obj(raw.get("json_schema"), f"{param}.json_schema")
        where = param if flat else f"{param}.json_schema"
        name, strict = spec.get("name"), spec.get("strict")
        if name is not None:
            string(name, f"{where}.name", where, empty=True)
        if strict is not None and not isinstance(strict, bool):
            raise bad_request(f"'{where}.strict' must be a boolean", where)
        return ResponseFormat("json_schema", json_schema(spec.get("schema"), f"{where}.schema"),
                              name, strict is not False)
    raise bad_request(f"'{param}.type' must be 'text', 'json_object' or 'json_schema'", param)


def thinking_of(body: dict) -> bool | None:
    effort = body.get("reasoning_effort")
    if effort is None:
        return None
    if effort not in EFFORTS:
        raise bad_request(f"'reasoning_effort' must be one of {', '.join(EFFORTS)}",
                          "reasoning_effort")
    return effort not in ("none", "minimal")


def sampling(body: dict, config, max_name: str = "max_tokens") -> Sampling:
    neutral_only(body)
    return Sampling(max_tokens=number(body, max_name, config.max_tokens),
                    temperature=number(body, "temperature", config.temperature),
                    top_p=number(body, "top_p", 1.0), top_k=top_k(body),
                    seed=seed_value(body), stop=stop_list(body))


def parse(body: dict, config) -> Conversation:
    """A checked ``/v1/chat/completions`` body as a :class:`Conversation`."""
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages = [_message(m, i) for i, m in enumerate(raw)]
    tools = _tools(body)
    check_history(messages)
    continue_final = boolean(body, "continue_final_message", messages[-1].role == "assistant")
    if continue_final and (messages[-1].role != "assistant" or messages[-1].tool_calls):
        raise bad_request("continue_final_message needs a history that ends with an assistant "
                          "message without tool calls", "messages")
    s = sampling(body, config)
    s.max_tokens = number(body, "max_completion_tokens", s.max_tokens)
    s.logprobs = boolean(body, "logprobs", False)
    s.top_logprobs = number(body, "top_logprobs", 0)
    kwargs = optional_obj(body.get("chat_template_kwargs"), "'chat_template_kwargs'",
                          "chat_template_kwargs")
    return Conversation(
        messages=messages, sampling=s, tools=tools,
        tool_choice=tool_choice(body.get("tool_choice"), tools),
        parallel_tool_calls=boolean(body, "parallel_tool_calls", True),
        response_format=response_format(body.get("response_format")),
        thinking=thinking_of(body), template_kwargs=dict(kwargs),
        continue_final=continue_final, model=model_name(body), n=number(body, "n", 1),
        stream=boolean(body, "stream", False), use_kv_cache=boolean(body, "use_kv_cache", True),
        speculate=boolean(body, "speculate", True), prediction=_prediction(body))


def _prediction(body: dict) -> str | None:
    """OpenAI's ``prediction``: ``{"type": "content", "content": text or text parts}``."""
    raw = body.get("prediction")
    if raw is None:
        return None
    raw = obj(raw, "'prediction'", "prediction")
    if raw.get("type") != "content":
        raise bad_request("'prediction.type' must be 'content'", "prediction")
    if raw.get("content") is None:
        raise bad_request("'prediction.content' is required", "prediction.content")
    return _text(_content(raw["content"], "prediction")) or None


def include_usage(body: dict) -> bool:
    options = optional_obj(body.get("stream_options"), "'stream_options'", "stream_options")
    return boolean(options, "include_usage", False)


# -- answers ------------------------------------------------------------------------------------

def logprobs_body(lps) -> dict:
    def entry(text: str, lp: float) -> dict:
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}
    return {"content": [{**entry(t.token, t.logprob),
                         "top_logprobs": [entry(a, v) for a, _, v in t.top]} for t in lps]}


def tokens_details(u: Usage) -> dict:
    """The completion's tokens in detail (OpenAI's ``completion_tokens_details``; the Responses
    and Anthropic usage's ``output_tokens_details``): ``reasoning_tokens``; OpenAI's
    ``accepted_prediction_tokens`` / ``rejected_prediction_tokens``, the request's
    ``prediction`` tokens that appeared in the completion / that did not (0 without one,
    whether or not anything was drafted from it); and this server's
    ``accepted_draft_tokens`` / ``rejected_draft_tokens``, the draft tokens speculative decoding
    verified (from every source, a prediction among them) that the answer took / refused."""
    return {"reasoning_tokens": u.reasoning_tokens,
            "accepted_prediction_tokens": u.prediction_accepted,
            "rejected_prediction_tokens": u.prediction_rejected,
            "accepted_draft_tokens": u.draft_accepted,
            "rejected_draft_tokens": u.draft_rejected}


def usage_body(u: Usage) -> dict:
    body = {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
            "total_tokens": u.total_tokens,
            "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
            "completion_tokens_details": tokens_details(u),
            "decode_steps": u.decode_steps}
    if u.divergence is not None:  # this server's: why prompt tokens were read again
        body["kv_cache_divergence"] = u.divergence.as_dict()
    return body


def call_body(c: ToolCall) -> dict:
    return {"id": c.id, "type": "function",
            "function": {"name": c.name, "arguments": c.arguments}}


async def handle(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    conv = parse(body, served.config)
    usage_chunk = include_usage(body)
    job, accepted, watch = await served.start(request, conv)
    if conv.stream:
        return StreamingResponse(_stream(job, watch, usage_chunk), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    answers, usage = await collect(job, watch, accepted)  # an error: the guard answers it
    choices = []
    for i in sorted(answers):
        f = answers[i]
        msg: dict = {"role": "assistant", "content": f.text if f.text or not f.tool_calls
                     else None, "message_id": f.message_id}
        if f.reasoning:
            msg["reasoning_content"] = f.reasoning
        if f.tool_calls:
            msg["tool_calls"] = [call_body(c) for c in f.tool_calls]
        choices.append({"index": i, "message": msg, "finish_reason": f.reason,
                        "logprobs": logprobs_body(f.logprobs) if conv.sampling.logprobs
                        else None})
    return JSONResponse({
        "id": job.id, "object": "chat.completion", "created": job.created,
        "model": job.lm.name, "choices": choices,
        "message_id": choices[0]["message"]["message_id"] if choices else None,
        "usage": usage_body(usage)})


async def _stream(job, watch, include_usage: bool) -> AsyncIterator[str]:
    ids: dict[int, str] = {}

    def chunk(index: int | None, delta: dict | None, finish=None, usage=None,
              logprobs: tuple[TokenLogprob, ...] = ()) -> str:
        body: dict = {"id": job.id, "object": "chat.completion.chunk",
                      "created": job.created, "model": job.lm.name, "choices": []}
        if index is not None:
            body["message_id"] = ids[index]
            body["choices"] = [{"index": index, "delta": delta or {}, "finish_reason": finish,
                                "logprobs": logprobs_body(logprobs) if logprobs else None}]
        if usage is not None:
            body["usage"] = usage
        return sse(body)

    async for ev in job_events(job, watch):
        if isinstance(ev, Start):
            ids[ev.index] = ev.message_id
            yield chunk(ev.index, {"role": "assistant", "content": "",
                                   "message_id": ev.message_id})
        elif isinstance(ev, TextDelta):
            yield chunk(ev.index, {"content": ev.text}, logprobs=ev.logprobs)
        elif isinstance(ev, ReasoningDelta):
            yield chunk(ev.index, {"reasoning_content": ev.text})
        elif isinstance(ev, ToolCallStart):
            yield chunk(ev.index, {"tool_calls": [{"index": ev.call, "id": ev.id,
                                                   "type": "function", "function": {
                                                       "name": ev.name, "arguments": ""}}]})
        elif isinstance(ev, ToolCallDelta):
            yield chunk(ev.index, {"tool_calls": [{"index": ev.call, "function": {
                "arguments": ev.arguments}}]})
        elif isinstance(ev, Finish):
            yield chunk(ev.index, {}, finish=ev.reason)
        elif isinstance(ev, Usage) and include_usage:
            yield chunk(None, None, usage=usage_body(ev))
        elif isinstance(ev, Error):
            yield sse(openai_error_body(ev.error))
    yield "data: [DONE]\n\n"
