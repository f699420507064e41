"""The chat server's OpenAI-style API as the terminal chat uses it: a small httpx client, the
SSE parser for streamed answers, and :class:`Streamed`, one answer put together from its deltas
(text, reasoning, tool calls) as the server sent them, to go back in the history unchanged (the
next turn then renders the same tokens and comes from the cache)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator
from urllib.parse import urlparse

import httpx


class ChatError(Exception):
    """Something the user should read: an HTTP error from the server or a broken stream."""


def parse_sse(lines: Iterable[str]) -> Iterator[dict]:
    """JSON payloads of the ``data:`` events in SSE lines; stops at ``[DONE]``. An event that
    carries ``{"error": ...}`` raises :class:`ChatError`."""
    data: list[str] = []

    def dispatch() -> Any:
        payload = "\n".join(data)
        data.clear()
        if payload.strip() == "[DONE]":
            return None
        try:
            event = json.loads(payload)
        except ValueError:
            raise ChatError(f"the server sent a malformed event: {payload[:200]!r}")
        if isinstance(event, dict) and "error" in event:
            raise ChatError(describe_error(event))
        return event

    for line in lines:
        if line == "":
            if data:
                if (event := dispatch()) is None:
                    return
                yield event
        elif not line.startswith(":"):  # ':' starts a comment (keep-alive)
            name, _, value = line.partition(":")
            if name == "data":
                data.append(value[1:] if value.startswith(" ") else value)
    if data and (event := dispatch()) is not None:
        yield event


def describe_error(body: Any, status: int | None = None) -> str:
    err = body.get("error") if isinstance(body, dict) else None
    head = f"HTTP {status}" if status else "server error"
    if isinstance(err, dict):
        kind = f" {err['type']}" if err.get("type") else ""
        return f"{head}{kind}: {err.get('message', err)}"
    return f"{head}: {str(body)[:500]}"


class Client:
    """A small OpenAI-style client over httpx for the chat server (base URL ends with /v1)."""

    def __init__(self, base_url: str, api_key: str | None = None, model: str | None = None):
        base = base_url.rstrip("/")
        if urlparse(base).path in ("", "/"):
            base += "/v1"
        self.base_url, self.model = base, model
        self.root = base.removesuffix("/v1")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(headers=headers,
                                 timeout=httpx.Timeout(30.0, read=600.0, write=60.0))

    def close(self) -> None:
        self.http.close()

    def get(self, url: str) -> tuple[int, Any]:
        r = self.http.get(url)
        try:
            return r.status_code, r.json()
        except ValueError:
            return r.status_code, r.text

    def chat_stream(self, messages: list[dict], **params: Any) -> Iterator[dict]:
        """Stream a chat completion: yields the chunks; raises :class:`ChatError` on an HTTP
        error. Closing the generator closes the connection (the server cancels generation)."""
        body = {"messages": messages, "stream": True, "stream_options": {"include_usage": True},
                **{k: v for k, v in params.items() if v is not None}}
        if self.model:
            body["model"] = self.model
        with self.http.stream("POST", f"{self.base_url}/chat/completions", json=body) as r:
            if r.status_code >= 400:
                r.read()
                try:
                    body = r.json()
                except ValueError:
                    body = r.text
                raise ChatError(describe_error(body, r.status_code))
            yield from parse_sse(r.iter_lines())


@dataclass
class Streamed:
    """One choice's answer as its deltas arrive: ``content``, ``reasoning_content`` and the
    OpenAI-shaped ``tool_calls`` (a call's first delta has its id and name, later ones append
    to its arguments)."""

    text: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)

    def add(self, delta: dict) -> None:
        self.reasoning += _text(delta.get("reasoning_content"))
        self.text += _text(delta.get("content"))
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if not isinstance(call, dict):
                continue
            k = call.get("index")
            if not isinstance(k, int) or not 0 <= k < len(self.tool_calls):
                k = len(self.tool_calls)  # a new call (also when the index is missing or odd)
                self.tool_calls.append({"id": "", "type": "function",
                                        "function": {"name": "", "arguments": ""}})
            mine, fn = self.tool_calls[k], call.get("function")
            fn = fn if isinstance(fn, dict) else {}
            mine["id"] = _text(call.get("id")) or mine["id"]
            mine["function"]["name"] = _text(fn.get("name")) or mine["function"]["name"]
            mine["function"]["arguments"] += _text(fn.get("arguments"))

    def message(self, message_id: str | None) -> dict:
        """The assistant message for the history."""
        m: dict = {"role": "assistant", "content": self.text}
        if self.reasoning:
            m["reasoning_content"] = self.reasoning
        if self.tool_calls:
            m["tool_calls"] = json.loads(json.dumps(self.tool_calls))  # a copy
        if message_id:
            m["message_id"] = message_id
        return m


def _text(value: Any) -> str:
    return value if isinstance(value, str) else ""
