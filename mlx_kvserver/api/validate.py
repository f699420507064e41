"""Parsing and validation of request bodies: every bad input becomes a 4xx ``APIError``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .errors import APIError, bad_request

ROLES = ("system", "user", "assistant", "developer", "tool")
MAX_MESSAGE_ID_LEN = 256
MAX_N = 16
MAX_STOP = 4
MAX_TOKENS_LIMIT = 1 << 20
# Numeric request fields: (lowest, highest, integer). The OpenAPI description uses these too.
RANGES: dict[str, tuple[float, float, bool]] = {
    "max_tokens": (1, MAX_TOKENS_LIMIT, True),
    "max_completion_tokens": (1, MAX_TOKENS_LIMIT, True),
    "temperature": (0.0, 2.0, False),
    "top_p": (0.0, 1.0, False),
    "n": (1, MAX_N, True),
}


@dataclass
class Message:
    role: str
    content: str
    message_id: str | None = None

    def as_template_dict(self) -> dict:
        return {"role": "system" if self.role == "developer" else self.role,
                "content": self.content}


@dataclass
class SamplingParams:
    max_tokens: int | None = None
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)


@dataclass
class ChatRequest:
    messages: list[Message]
    params: SamplingParams
    model: str | None = None
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    use_kv_cache: bool = True


def _text(value: str, what: str, param: str | None) -> str:
    """``value`` if it is valid Unicode text (no lone UTF-16 surrogates, which JSON's ``\\ud800``
    escapes can smuggle in and which no tokenizer or UTF-8 encoder accepts)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{what} is not valid Unicode text (a lone surrogate)", param)
    return value


def _content_text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return _text(content, f"{where}.content", f"{where}.content")
    if isinstance(content, list):  # OpenAI content parts: only text parts are supported
        parts = []
        for i, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise bad_request(f"{where}.content[{i}] must be a text part "
                                  "({'type': 'text', 'text': ...})", f"{where}.content")
            parts.append(_text(part["text"], f"{where}.content[{i}].text", f"{where}.content"))
        return "".join(parts)
    if content is None:
        return ""
    raise bad_request(f"{where}.content must be a string or a list of text parts",
                      f"{where}.content")


def check_message_id(value: Any, param: str) -> str | None:
    """A valid client ``message_id`` (``param`` names it in errors) or None; ``APIError`` 400
    otherwise. It is only ever a key: the disk store hashes it, it never becomes a path."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    if len(value) > MAX_MESSAGE_ID_LEN:
        raise bad_request(f"{param} is longer than {MAX_MESSAGE_ID_LEN} characters", param)
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise bad_request(f"{param} contains control characters", param)
    return _text(value, param, param)


def _number(body: dict, name: str, default):
    lo, hi, integer = RANGES[name]
    value = body.get(name, default)
    if value is None:
        return default
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be {kind}", name)
    # NOTE: compare before any float conversion: a JSON integer may be far beyond float range.
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        shown = repr(value) if isinstance(value, float) or abs(value) < 10**30 else "a huge number"
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {shown}", name)
    if integer and isinstance(value, float) and not value.is_integer():
        raise bad_request(f"'{name}' must be {kind}", name)
    return int(value) if integer else float(value)


def _bool(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def parse_chat_request(body: Any, *, default_max_tokens: int | None = None,
                       default_temperature: float = 0.0) -> ChatRequest:
    """Validate a ``/v1/chat/completions`` body."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad_request("'messages' must be a non-empty list", "messages")
    messages = []
    for i, m in enumerate(raw):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad_request(f"{where} must be an object", where)
        role = m.get("role")
        if role not in ROLES:
            raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}; got {role!r}",
                              f"{where}.role")
        messages.append(Message(role, _content_text(m.get("content"), where),
                                check_message_id(m.get("message_id"), f"{where}.message_id")))
    if messages[-1].role == "assistant":
        raise bad_request("the last message must not be an assistant message", "messages")

    model = body.get("model")
    if model is not None and not isinstance(model, (str, int)) or isinstance(model, bool):
        raise bad_request("'model' must be a string", "model")
    if isinstance(model, str):
        _text(model, "'model'", "model")

    max_tokens = _number(body, "max_tokens", default_max_tokens)  # checked even if overridden
    max_tokens = _number(body, "max_completion_tokens", max_tokens)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise bad_request(f"'stop' must be a non-empty string or a list of at most {MAX_STOP} "
                          "non-empty strings", "stop")
    for s in stop:
        _text(s, "'stop'", "stop")
    seed = body.get("seed")
    if isinstance(seed, float) and seed.is_integer() and 0 <= seed < 2**63:
        seed = int(seed)  # 7.0 is an integer to JSON Schema, as to the other integer fields
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)
                             or not 0 <= seed < 2**63):
        raise bad_request("'seed' must be a non-negative integer", "seed")

    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise bad_request("'stream_options' must be an object", "stream_options")
    include_usage = _bool(stream_options or {}, "include_usage", False)

    return ChatRequest(
        messages=messages,
        params=SamplingParams(
            max_tokens=max_tokens,
            temperature=_number(body, "temperature", default_temperature),
            top_p=_number(body, "top_p", 1.0),
            seed=seed,
            stop=stop,
        ),
        model=None if model is None else str(model),
        n=_number(body, "n", 1),
        stream=_bool(body, "stream", False),
        include_usage=include_usage,
        use_kv_cache=_bool(body, "use_kv_cache", True),
    )


def unknown_model(name: str, available: list[str]) -> APIError:
    return APIError(404, f"model {name!r} not found; available: {', '.join(available)}",
                    type="not_found_error", param="model", code="model_not_found")
