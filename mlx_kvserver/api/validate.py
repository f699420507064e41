"""Validation helpers every API module shares: every bad input becomes a 400 ``RequestError``
that names the offending field."""

from __future__ import annotations

import json
import math
import re
from collections import OrderedDict
from typing import Any

import jsonschema

from ..chat.conversation import Message, Tool
from ..errors import bad_request

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
    "top_k": (-1, 1 << 20, True),  # -1 and 0: off (-1 is vLLM's and SGLang's "off")
    "top_logprobs": (0, 20, True),
}
# Sampling fields this server does not implement, taken only at the value that changes nothing
# (SGLang's router adds them so to every /v1/responses body); any other value is a 400.
NEUTRAL: dict[str, float] = {"min_p": 0.0, "repetition_penalty": 1.0, "priority": 0}


def text_value(value: str, what: str, param: str | None) -> str:
    """``value`` if it is valid Unicode text (no lone UTF-16 surrogates, which JSON's ``\\ud800``
    escapes can smuggle in and which no tokenizer or UTF-8 encoder accepts)."""
    if not value.isascii():
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise bad_request(f"{what} is not valid Unicode text (a lone surrogate)", param)
    return value


def check_message_id(value: Any, param: str) -> str | None:
    """A valid client ``message_id`` (``param`` names it in errors) or None; ``RequestError`` 400
    otherwise. It is only ever a key: the disk store hashes it, it never becomes a path."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(f"{param} must be a non-empty string", param)
    if len(value) > MAX_MESSAGE_ID_LEN:
        raise bad_request(f"{param} is longer than {MAX_MESSAGE_ID_LEN} characters", param)
    if any(ord(c) < 32 or ord(c) == 127 for c in value):
        raise bad_request(f"{param} contains control characters", param)
    return text_value(value, param, param)


def integer(value: Any) -> int | None:
    """``value`` as an int when JSON Schema calls it an integer (``7``, ``7.0``; never ``true``),
    else None."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def one_of(value: Any, allowed, message: str, param: str) -> str:
    """``value`` if it is one of the strings ``allowed``; a 400 (``message``) for anything else,
    whatever its type: a list or an object from the body is never looked up (unhashable)."""
    if isinstance(value, str) and value in allowed:
        return value
    raise bad_request(message, param)


def number(body: dict, name: str, default):
    lo, hi, whole = RANGES[name]
    value = body.get(name, default)
    if value is None:
        return default
    kind = "an integer" if whole else "a number"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"'{name}' must be {kind}", name)
    # NOTE: compare before any float conversion: a JSON integer may be far beyond float range.
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        shown = repr(value) if isinstance(value, float) or abs(value) < 10**30 else "a huge number"
        raise bad_request(f"'{name}' must be between {lo} and {hi}, got {shown}", name)
    if whole and isinstance(value, float) and not value.is_integer():
        raise bad_request(f"'{name}' must be {kind}", name)
    return int(value) if whole else float(value)


def top_k(body: dict) -> int:
    """``top_k``: 0 (or absent) when off, which -1 also means (as vLLM and SGLang read it)."""
    return max(number(body, "top_k", 0), 0)


def neutral_only(body: dict) -> None:
    """A 400 for a :data:`NEUTRAL` field at any value other than its neutral one (or null)."""
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value != neutral:
            raise bad_request(f"'{name}' is not supported: this server takes only {neutral!r}, "
                              "which changes nothing", name)


def boolean(body: dict, name: str, default: bool) -> bool:
    value = body.get(name, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"'{name}' must be a boolean", name)
    return value


def stop_list(body: dict, name: str = "stop") -> list[str]:
    """A stop string or list of them (at most ``MAX_STOP``, non-empty, valid text)."""
    stop = body.get(name)
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or len(stop) > MAX_STOP or \
            not all(isinstance(s, str) and s for s in stop):
        raise bad_request(f"'{name}' must be a non-empty string or a list of at most {MAX_STOP} "
                          "non-empty strings", name)
    for s in stop:
        text_value(s, f"'{name}'", name)
    return stop


def seed_value(body: dict) -> int | None:
    seed = body.get("seed")
    if seed is None:
        return None
    value = integer(seed)  # 7.0 is an integer to JSON Schema, as to the other integer fields
    if value is None or not 0 <= value < 2**63:
        raise bad_request("'seed' must be a non-negative integer", "seed")
    return value


def model_name(body: dict) -> str | None:
    """A model's name or index (a string or an integer), or None."""
    model = body.get("model")
    if model is None:
        return None
    if isinstance(model, str):
        return text_value(model, "'model'", "model")
    if integer(model) is None:
        raise bad_request("'model' must be a string", "model")
    return str(integer(model))


def obj(value: Any, what: str, param: str | None = None) -> dict:
    if not isinstance(value, dict):
        raise bad_request(f"{what} must be an object", param or what)
    return value


def optional_obj(value: Any, what: str, param: str) -> dict:
    """An optional object field: ``{}`` when absent or null. Any other value that is not an
    object is a 400: ``false``, ``0``, ``""`` or ``[]`` is not taken for an absent one."""
    return {} if value is None else obj(value, what, param)


def string(value: Any, what: str, param: str | None = None, empty: bool = False) -> str:
    if not isinstance(value, str) or (not empty and not value):
        raise bad_request(f"{what} must be a{'' if empty else ' non-empty'} string",
                          param or what)
    return text_value(value, what, param or what)


TOOL_NAME = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
MAX_TOOLS = 512
_VALID_SCHEMAS: OrderedDict[str, None] = OrderedDict()  # canonical JSON of schemas checked
_KEEP_SCHEMAS = 2048


def check_schema(schema: dict) -> None:
    """Raise ``jsonschema.SchemaError`` unless ``schema`` is valid JSON Schema (Draft 2020-12).

    NOTE: agents send the same tool schemas every turn (25 tools took ~60 ms to check here);
    a schema already found valid is known by its canonical JSON (~1 ms for all 25)."""
    key = json.dumps(schema, sort_keys=True, ensure_ascii=False)
    if key in _VALID_SCHEMAS:
        _VALID_SCHEMAS.move_to_end(key)
        return
    jsonschema.Draft202012Validator.check_schema(schema)
    _VALID_SCHEMAS[key] = None
    while len(_VALID_SCHEMAS) > _KEEP_SCHEMAS:
        _VALID_SCHEMAS.popitem(last=False)


def tool(name: Any, description: Any, parameters: Any, strict: Any, where: str) -> Tool:
    """A checked function tool: a name of letters, digits and ``_.:-``, and a parameters object
    that is valid JSON Schema (Draft 2020-12)."""
    if not isinstance(name, str) or not TOOL_NAME.match(name):
        raise bad_request(f"{where}.name must be 1-128 letters, digits, '_', '.', ':' or '-'",
                          f"{where}.name")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.description must be a string", f"{where}.description")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise bad_request(f"{where}: the parameters schema must be a JSON Schema object",
                          where)
    try:
        check_schema(parameters)
    except jsonschema.SchemaError as e:
        raise bad_request(f"{where}: the parameters schema is not valid JSON Schema: "
                          f"{e.message}", where, code="invalid_schema")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict must be a boolean", f"{where}.strict")
    return Tool(name, text_value(description or "", f"{where}.description", where),
                parameters, bool(strict))


def tool_entries(raw: Any, param: str = "tools"):
    """``(where, entry)`` for each object of a ``tools`` list (None: none); a 400 for a list
    that is not one or an entry that is not an object."""
    if raw is None:
        return
    if not isinstance(raw, list):
        raise bad_request(f"'{param}' must be a list of tools", param)
    for i, t in enumerate(raw):
        yield f"{param}[{i}]", obj(t, f"{param}[{i}]", param)


def tool_list(tools: list[Tool], param: str) -> list[Tool]:
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"'{param}' has more than {MAX_TOOLS} tools", param)
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise bad_request(f"'{param}' names a tool twice", param)
    return tools


def json_schema(schema: Any, param: str) -> dict:
    """A response schema: a JSON object that is valid JSON Schema."""
    if not isinstance(schema, dict):
        raise bad_request(f"'{param}' must be a JSON Schema object", param)
    try:
        check_schema(schema)
    except jsonschema.SchemaError as e:
        raise bad_request(f"'{param}' is not valid JSON Schema: {e.message}", param,
                          code="invalid_schema")
    return schema


def check_history(messages: list[Message], param: str = "messages") -> None:
    """The order every API's history must keep: not empty; a tool result answers a call made
    by an earlier assistant message and not answered yet; a tool call's id is unique."""
    if not messages:
        raise bad_request(f"'{param}' must not be empty", param)
    open_calls: dict[str, str] = {}
    seen: set[str] = set()
    for i, m in enumerate(messages):
        for call in m.tool_calls:
            if call.id in seen:
                raise bad_request(f"{param}[{i}]: the tool call id {call.id!r} is used twice",
                                  param)
            seen.add(call.id)
            open_calls[call.id] = call.name
        for result in m.tool_results:
            if result.call_id not in open_calls:
                raise bad_request(f"{param}[{i}]: a tool result for {result.call_id!r}, which "
                                  "no earlier assistant message called (or which was answered "
                                  "already)", param, code="unknown_tool_call_id")
            del open_calls[result.call_id]
