"""The output side of ``/v1/messages``: a message body from the engine's answer, Anthropic's
usage, and the whole streaming event sequence (``message_start`` ... ``message_stop``)."""

from __future__ import annotations

import json
from typing import AsyncIterator

from ..chat.conversation import ToolCall
from ..chat.jsonstream import JsonPrefix, as_object
from ..chat.output import (Error, Finish, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallEnd,
                           ToolCallStart, Usage)
from .http import anthropic_error_body, job_events, sse

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage_body(u: Usage) -> dict:
    """Anthropic's usage: input + cache read = the prompt; ``output_tokens`` includes thinking
    (as Anthropic counts it). This server's own: ``output_tokens_details`` (of the output, the
    thinking; draft tokens taken and refused), ``decode_steps`` (forward passes that wrote the
    output) and ``kv_cache_divergence`` when prompt tokens were read again."""
    body = {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": u.reasoning_tokens,
                                      "accepted_prediction_tokens": u.draft_accepted,
                                      "rejected_prediction_tokens": u.draft_rejected},
            "decode_steps": u.decode_steps}
    if u.divergence is not None:
        body["kv_cache_divergence"] = u.divergence.as_dict()
    return body


def tool_input(call: ToolCall) -> dict:
    """A call's ``input`` object. Arguments the model wrote badly (not JSON, or cut off) come
    back as their valid part closed, with the whole text as written under ``"INVALID_JSON"``
    (the convention of Anthropic's fine-grained tool streaming): never dropped, and never an
    object that passes for complete."""
    return as_object(call.arguments)


def input_closing(valid: str, written: str) -> str:
    """What completes a streamed ``input`` whose valid part was ``valid`` (the
    ``input_json_delta`` text so far) the way :func:`tool_input` does for ``written``."""
    jp = JsonPrefix(require_object=True)
    jp.feed(valid)
    return jp.closing(("INVALID_JSON", written))


def stop_of(f: Finish) -> tuple[str, str | None]:
    if f.stop_sequence is not None:
        return "stop_sequence", f.stop_sequence
    return STOP_REASONS.get(f.reason, "end_turn"), None


def message_body(msg_id: str, model: str, f: Finish | None, usage: Usage) -> dict:
    content: list[dict] = []
    if f is not None:
        if f.reasoning:
            content.append({"type": "thinking", "thinking": f.reasoning, "signature": ""})
        if f.text:
            content.append({"type": "text", "text": f.text})
        content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c)}
                    for c in f.tool_calls]
    reason, sequence = stop_of(f) if f is not None else (None, None)
    return {"id": msg_id, "type": "message", "role": "assistant", "model": model,
            "content": content, "stop_reason": reason, "stop_sequence": sequence,
            "usage": usage_body(usage)}


async def stream(job, watch, msg_id: str, model: str, usage: Usage) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, ping, per block content_block_start /
    _delta / _stop (thinking, then text, then tool_use blocks, indexed in order),
    message_delta, message_stop; an ``error`` event in place of the rest on failure."""
    start = message_body(msg_id, model, None, usage)
    yield sse({"type": "message_start", "message": start}, event="message_start")
    yield sse({"type": "ping"}, event="ping")
    index, kind = -1, None  # the open block: its index and type (None: none open)
    calls: dict[int, int] = {}  # call number -> block index
    valid: dict[int, str] = {}  # call number -> its input_json_delta text so far
    written: dict[int, str] = {}  # call number -> its arguments as written
    finish = None

    def delta(i: int, d: dict) -> str:
        return sse({"type": "content_block_delta", "index": i, "delta": d},
                   event="content_block_delta")

    def close() -> list[str]:
        nonlocal kind
        out = []
        if kind == "thinking":
            out.append(delta(index, {"type": "signature_delta", "signature": ""}))
        if kind is not None:
            out.append(sse({"type": "content_block_stop", "index": index},
                           event="content_block_stop"))
        kind = None
        return out

    def open_(block: dict) -> list[str]:
        nonlocal index, kind
        out = close()
        index, kind = index + 1, block["type"]
        out.append(sse({"type": "content_block_start", "index": index, "content_block": block},
                       event="content_block_start"))
        return out

    async for ev in job_events(job, watch):
        out: list[str] = []
        if isinstance(ev, ReasoningDelta) and ev.text:
            if kind != "thinking":
                out += open_({"type": "thinking", "thinking": "", "signature": ""})
            out.append(delta(index, {"type": "thinking_delta", "thinking": ev.text}))
        elif isinstance(ev, TextDelta) and ev.text:
            if kind != "text":
                out += open_({"type": "text", "text": ""})
            out.append(delta(index, {"type": "text_delta", "text": ev.text}))
        elif isinstance(ev, ToolCallStart):
            out += open_({"type": "tool_use", "id": ev.id, "name": ev.name, "input": {}})
            calls[ev.call] = index
        elif isinstance(ev, ToolCallDelta) and ev.arguments:
            written[ev.call] = written.get(ev.call, "") + ev.arguments
            if ev.valid:  # NOTE: what the client accumulates must stay a JSON prefix
                valid[ev.call] = valid.get(ev.call, "") + ev.arguments
                out.append(delta(calls.get(ev.call, index),
                                 {"type": "input_json_delta", "partial_json": ev.arguments}))
        elif isinstance(ev, ToolCallEnd) and ev.problem and ev.call in calls:
            text = written.get(ev.call, "")
            end = "" if isinstance(_loads(text), dict) else \
                input_closing(valid.get(ev.call, ""), text)
            if end:
                out.append(delta(calls[ev.call], {"type": "input_json_delta",
                                                  "partial_json": end}))
        elif isinstance(ev, Finish):
            finish = ev
            out += close()
        elif isinstance(ev, Usage):
            usage = ev
        elif isinstance(ev, Error):
            yield sse(anthropic_error_body(ev.error), event="error")
            return
        for s in out:
            yield s
    reason, sequence = stop_of(finish) if finish is not None else ("end_turn", None)
    yield sse({"type": "message_delta",
               "delta": {"stop_reason": reason, "stop_sequence": sequence},
               "usage": usage_body(usage)},
               event="message_delta")
    yield sse({"type": "message_stop"}, event="message_stop")


def _loads(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return None
