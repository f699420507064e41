"""The output side of ``/v1/messages``: a message body from the engine's answer, Anthropic's
usage, and the whole streaming event sequence (``message_start`` ... ``message_stop``)."""

from __future__ import annotations

import json
from typing import AsyncIterator

from ..chat.conversation import ToolCall
from ..chat.output import (Error, Finish, ReasoningDelta, TextDelta, ToolCallDelta,
                           ToolCallStart, Usage)
from .http import anthropic_error_body, job_events, sse
from .openai_chat import tokens_details

STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}


def usage_body(u: Usage) -> dict:
    """Anthropic's usage: input + cache read = the prompt; ``output_tokens`` includes thinking
    (as Anthropic counts it). This server's own: ``output_tokens_details`` (OpenAI's: of the
    output, the thinking; a prediction's tokens that appeared and not; draft tokens taken and
    refused: ``openai_chat.tokens_details``), ``decode_steps`` (forward passes that wrote the
    output) and ``kv_cache_divergence`` when prompt tokens were read again."""
    body = {"input_tokens": u.prompt_tokens - u.cached_tokens, "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": u.cached_tokens, "output_tokens": u.completion_tokens,
            "output_tokens_details": tokens_details(u),
            "decode_steps": u.decode_steps}
    if u.divergence is not None:
        body["kv_cache_divergence"] = u.divergence.as_dict()
    return body


def tool_input(call: ToolCall) -> dict:
    """A call's ``input`` object: its arguments as the model wrote them (an answer's calls are
    complete JSON objects, ``chat/call_events.py``; nothing is ever added to them)."""
    return json.loads(call.arguments)


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
        elif isinstance(ev, ToolCallDelta) and ev.arguments and ev.valid:
            # NOTE: what the client accumulates must stay a JSON prefix; a streamed call cut off
            # or broken stays one: nothing the model did not write completes it
            out.append(delta(calls.get(ev.call, index),
                             {"type": "input_json_delta", "partial_json": ev.arguments}))
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

