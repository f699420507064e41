"""The output side of ``/v1/responses``: output items built from the engine's events, the
stream events that announce them, and the usage body."""

from __future__ import annotations

import uuid

from ..chat.conversation import Message, Reasoning, Text
from ..chat.output import Finish, Usage
from .openai_chat import logprobs_body, tokens_details


def usage_body(u: Usage) -> dict:
    body = {"input_tokens": u.prompt_tokens,
            "input_tokens_details": {"cached_tokens": u.cached_tokens},
            "output_tokens": u.completion_tokens,
            "output_tokens_details": tokens_details(u),
            "decode_steps": u.decode_steps, "total_tokens": u.total_tokens}
    if u.divergence is not None:  # this server's: why prompt tokens were read again
        body["kv_cache_divergence"] = u.divergence.as_dict()
    return body


class Output:
    """The output items built from the engine's events, one open at a time, and the stream
    events that announce them (without ``sequence_number``)."""

    def __init__(self, names: dict[str, tuple[str, str]], logprobs: bool):
        self.items: list[dict] = []
        self.open: dict | None = None
        self.names, self.logprobs = names, logprobs
        self.calls: list[dict] = []
        self.index: dict[str, int] = {}  # item id -> output index
        self.thought = ""  # the open reasoning item's text

    def _where(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def _start(self, item: dict) -> list[dict]:
        events = self._close()
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        events.append({"type": "response.output_item.added", "output_index":
                       len(self.items) - 1, "item": dict(item, content=[]) if "content" in item
                       else dict(item)})
        if item["type"] == "message":
            events.append({"type": "response.content_part.added", **self._where(item),
                           "content_index": 0, "part": self._part()})
        elif item["type"] == "reasoning":
            events.append({"type": "response.reasoning_summary_part.added", **self._where(item),
                           "summary_index": 0, "part": {"type": "summary_text", "text": ""}})
        return events

    def _part(self) -> dict:
        part: dict = {"type": "output_text", "text": "", "annotations": []}
        if self.logprobs:
            part["logprobs"] = []
        return part

    def _close(self, status: str = "completed") -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"], at = status, self._where(item)
        if item["type"] == "message":
            part = item["content"][0]
            events = [{"type": "response.output_text.done", **at, "content_index": 0,
                       "text": part["text"], "logprobs": part.get("logprobs", [])},
                      {"type": "response.content_part.done", **at, "content_index": 0,
                       "part": part}]
        elif item["type"] == "reasoning":
            text, self.thought = self.thought, ""
            item["summary"] = [{"type": "summary_text", "text": text}]
            item["content"] = [{"type": "reasoning_text", "text": text}]
            events = [{"type": "response.reasoning_summary_text.done", **at, "summary_index": 0,
                       "text": text},
                      {"type": "response.reasoning_summary_part.done", **at, "summary_index": 0,
                       "part": item["summary"][0]}]
        else:
            events = [{"type": "response.function_call_arguments.done", **at,
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", **at, "item": item}]

    def text(self, delta: str, lps=()) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "message":
            events = self._start({"id": f"msg_{uuid.uuid4().hex}", "type": "message",
                                  "status": "in_progress", "role": "assistant",
                                  "content": [self._part()]})
        part = self.open["content"][0]
        part["text"] += delta
        new = logprobs_body(lps)["content"] if self.logprobs else []
        if self.logprobs:
            part["logprobs"] += new
        if delta or new:
            events.append({"type": "response.output_text.delta", **self._where(self.open),
                           "content_index": 0, "delta": delta, "logprobs": new})
        return events

    def reasoning(self, delta: str) -> list[dict]:
        events = []
        if self.open is None or self.open["type"] != "reasoning":
            events = self._start({"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning",
                                  "summary": []})
        self.thought += delta
        return events + [{"type": "response.reasoning_summary_text.delta",
                          **self._where(self.open), "summary_index": 0, "delta": delta}]

    def call(self, call_id: str, name: str, arguments: str = "") -> list[dict]:
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call",
                "status": "in_progress", "call_id": call_id, "arguments": arguments}
        ns, item["name"] = self.names.get(name, (None, name))
        if ns is not None:
            item["namespace"] = ns
        self.calls.append(item)
        return self._start(item)

    def arguments(self, k: int, delta: str) -> list[dict]:
        item = self.calls[k]
        item["arguments"] += delta
        return [{"type": "response.function_call_arguments.delta", **self._where(item),
                 "delta": delta}]

    def finish(self, f: Finish) -> list[dict]:
        events = self._close("incomplete" if f.reason == "length" else "completed")
        sent = {item["call_id"]: item for item in self.calls}
        for c in f.tool_calls:  # the parsed calls are the final word
            if c.id in sent:
                sent[c.id]["arguments"] = c.arguments
            else:
                events += self.call(c.id, c.name, c.arguments) + self._close()
        if not self.items:
            events += self.text("") + self._close()
        # a streamed call that is not the answer's (cut off, or not JSON) leaves the output
        kept = {c.id for c in f.tool_calls}
        self.items = [i for i in self.items if i["type"] != "function_call" or
                      i["call_id"] in kept]
        return events

    def output_text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")


def answer_message(f: Finish, response_id: str) -> Message:
    """The answer as the history of a follow-up holds it (cached under the response's id)."""
    parts: list = [Reasoning(f.reasoning)] if f.reasoning else []
    return Message("assistant", parts + ([Text(f.text)] if f.text else []) + list(f.tool_calls),
                   response_id)
