"""Request bodies made from the OpenAPI description's own schemas, for tests that check that a body
the description calls valid is one the server accepts (tests/api/test_openapi_bodies.py,
tests/test_fuzz_api.py).

:func:`draw` walks a schema (``$ref``, ``oneOf``/``anyOf``, ``enum``/``const``, ``examples``,
types, ``required`` and optional properties, ``minItems``/``maxItems``/``contains``, numeric and
length bounds) and makes a body: the minimal one (required fields only, first branches, lowest
values) or a random one (optional fields at even odds); an object with rules beside its
properties (``anyOf``/``allOf``) is drawn again until they hold. Integers are drawn near their
minimum, so that a ``max_tokens`` or an ``n`` keeps generation short; a field with ``examples``
(the served model names) takes one of them. :func:`follow_rules` then applies what the
description says in words because JSON Schema cannot (``openapi_bodies.py``): each tool result
answers an earlier call, call ids are unique, every call is answered, tool names are unique, and
``tool_choice`` names one of the tools, a JSON Schema (a tool's parameters, a response format's
schema) is valid, and each image is a real picture, at most ``--max-images`` of them, sent to a
model that takes images where one is named.
"""

from __future__ import annotations

import copy
import random
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.exceptions import SchemaError

from mlx_kvserver.api.responses import flat_name
from mlx_kvserver.config import ServerConfig
from tests.chat.pictures import data_url, png

TEXT_CHARS = "abcdefghij klmnopqrstuvwxyz ABC 0123456789 .,!? é ß 中文 🙂 \n"
NAME_CHARS = "abcdefghijklmnopqrstuvwxyz_0123456789"  # fits every pattern the description has


class Document:
    """The OpenAPI document: its schemas resolved, and bodies checked against them."""

    def __init__(self, spec: dict):
        self.spec = spec

    def body_schema(self, path: str, method: str = "post") -> dict | None:
        content = self.spec["paths"][path][method].get("requestBody", {}).get("content", {})
        return content.get("application/json", {}).get("schema")

    def resolve(self, schema: dict) -> dict:
        while "$ref" in schema:
            node: Any = self.spec
            for part in schema["$ref"].removeprefix("#/").split("/"):
                node = node[part.replace("~1", "/").replace("~0", "~")]
            schema = node
        return schema

    def errors(self, schema: dict, value: Any) -> list[str]:
        """Why ``value`` is not valid by ``schema`` (none: it is)."""
        v = Draft202012Validator({**schema, "components": self.spec["components"]})
        return [f"{'/'.join(map(str, e.absolute_path))}: {e.message}"
                for e in v.iter_errors(value)]

    def draw(self, schema: dict, rng: random.Random | None) -> Any:
        """A value valid by ``schema``: the minimal one (``rng`` None) or a random one."""
        s = self.resolve(schema)
        pick = (lambda xs: xs[0]) if rng is None else rng.choice
        if "examples" in s:
            return pick(s["examples"])
        if "const" in s:
            return s["const"]
        if "enum" in s:
            return pick(s["enum"])
        for key in ("oneOf", "anyOf"):
            if key in s and "properties" not in s:  # (beside properties: a rule on them)
                return self.draw(pick(s[key]), rng)
        types = s.get("type", "object")
        if isinstance(types, list):
            types = types[0] if rng is None else rng.choice(types)
        return getattr(self, f"_{types}")(s, rng)

    def _object(self, s: dict, rng) -> dict:
        required = s.get("required", [])
        for _ in range(200):  # drawn again until the rules beside the properties hold
            out = {name: self.draw(sub, rng) for name, sub in s.get("properties", {}).items()
                   if name in required or (rng is not None and rng.random() < 0.5)}
            if not {"anyOf", "allOf", "oneOf"} & s.keys() or not self.errors(s, out):
                return out
        raise AssertionError(f"no object drawn keeps the rules of {s}")

    def _array(self, s: dict, rng) -> list:
        lo, hi = s.get("minItems", 0), s.get("maxItems", 1 << 30)
        n = lo if rng is None else rng.randint(lo, min(hi, lo + 3))
        items = [self.draw(s.get("items", {}), rng) for _ in range(n)]
        if "contains" in s and not any(not self.errors(s["contains"], x) for x in items):
            for _ in range(200):  # items drawn until one is what "contains" asks for
                x = self.draw(s.get("items", {}), rng or random.Random(0))
                if not self.errors(s["contains"], x):
                    return (items + [x])[-hi:]
            raise AssertionError(f"no item drawn matches {s['contains']}")
        return items

    def _string(self, s: dict, rng) -> str:
        lo, hi = s.get("minLength", 0), s.get("maxLength", 1 << 30)
        if rng is None:
            return "a" * max(lo, 1 if "pattern" in s else 0)
        chars = NAME_CHARS if "pattern" in s else TEXT_CHARS
        n = rng.randint(max(lo, 1 if "pattern" in s else 0), min(hi, lo + 12))
        return "".join(rng.choice(chars) for _ in range(n))

    def _integer(self, s: dict, rng) -> int:
        lo = s.get("minimum", 0)
        return lo if rng is None else rng.randint(lo, min(s.get("maximum", lo + 3), lo + 3))

    def _number(self, s: dict, rng) -> float:
        lo, hi = s.get("minimum", 0.0), s.get("maximum", 1.0)
        return float(lo) if rng is None else rng.uniform(lo, hi)

    def _boolean(self, s: dict, rng) -> bool:
        return False if rng is None else rng.random() < 0.5

    def _null(self, s: dict, rng) -> None:
        return None


# -- the rules the description gives in words ----------------------------------------------------

def _fresh(name: str, used: set[str]) -> str:
    while name in used:
        name += "x"
    used.add(name)
    return name


def _unique(names: list[str]) -> list[str]:
    used: set[str] = set()
    return [_fresh(n, used) for n in names]


def _chat(body: dict) -> None:
    out, open_, used = [], [], set()
    for m in body["messages"]:
        for c in (m.get("tool_calls") or []) if m["role"] == "assistant" else []:
            c["id"] = _fresh(c["id"], used)
            open_.append(c["id"])
        if m["role"] == "tool" and m.get("tool_call_id") in open_:
            open_.remove(m["tool_call_id"])
        elif m["role"] == "tool" and "tool_call_id" in m:  # (a missing one is not made up)
            m["tool_call_id"] = _fresh(m["tool_call_id"], used)
            out.append({"role": "assistant", "tool_calls": [
                {"id": m["tool_call_id"], "function": {"name": "f"}}]})
        out.append(m)
    body["messages"] = out + [{"role": "tool", "tool_call_id": c} for c in open_]
    last = body["messages"][-1]
    if last["role"] != "assistant" or last.get("tool_calls"):
        body.pop("continue_final_message", None)
    fns = [t["function"] for t in body.get("tools") or []]
    for f, name in zip(fns, _unique([f["name"] for f in fns])):
        f["name"] = name
    choice = body.get("tool_choice")
    if not fns and (choice == "required" or isinstance(choice, dict)):
        body["tool_choice"] = "auto"
    elif isinstance(choice, dict):
        choice["function"]["name"] = fns[0]["name"]


def _messages(body: dict) -> None:
    out, open_, used = [], [], set()
    for m in body["messages"]:
        blocks = m["content"] if isinstance(m["content"], list) else []
        missing = []
        for b in blocks:
            if b["type"] == "tool_use":
                b["id"] = _fresh(b["id"], used)
                open_.append(b["id"])
            elif b["type"] == "tool_result" and b["tool_use_id"] in open_:
                open_.remove(b["tool_use_id"])
            elif b["type"] == "tool_result":
                b["tool_use_id"] = _fresh(b["tool_use_id"], used)
                missing.append({"type": "tool_use", "id": b["tool_use_id"], "name": "f"})
        out += [{"role": "assistant", "content": missing}] if missing else []
        out.append(m)
    if open_:
        out.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": c}
                                                for c in open_]})
    body["messages"] = out
    tools = body.get("tools") or []
    for t, name in zip(tools, _unique([t["name"] for t in tools])):
        t["name"] = name
    choice = body.get("tool_choice")
    if choice and choice["type"] in ("any", "tool"):
        if not tools:
            body["tool_choice"] = {"type": "auto"}
        elif choice["type"] == "tool":
            choice["name"] = tools[0]["name"]


def _responses(body: dict) -> None:
    if isinstance(body["input"], list):
        out, open_, used = [], [], set()
        for item in body["input"]:
            kind = item.get("type", "message")
            if kind == "function_call":
                item["call_id"] = _fresh(item["call_id"], used)
                open_.append(item["call_id"])
            elif kind == "function_call_output" and item["call_id"] in open_:
                open_.remove(item["call_id"])
            elif kind == "function_call_output":
                item["call_id"] = _fresh(item["call_id"], used)
                out.append({"type": "function_call", "call_id": item["call_id"], "name": "f"})
            out.append(item)
        body["input"] = out + [{"type": "function_call_output", "call_id": c, "output": ""}
                               for c in open_]
    offered, used = [], set()  # (namespace or None, the function), by flat names made unique
    for t in body.get("tools") or []:
        fns = [(None, t)] if t["type"] == "function" else [
            (t["name"], f) for f in t["tools"] if f.get("type", "function") == "function"] \
            if t["type"] == "namespace" else []
        for ns, f in fns:
            while (flat_name(ns, f["name"]) if ns else f["name"]) in used:
                f["name"] += "x"
            used.add(flat_name(ns, f["name"]) if ns else f["name"])
            offered.append((ns, f))
    choice = body.get("tool_choice")
    if choice == "required" or isinstance(choice, dict):
        if not offered:
            body["tool_choice"] = "auto"
        elif isinstance(choice, dict):
            ns, f = offered[0]
            body["tool_choice"] = {"type": "function", "name": f["name"], "namespace": ns}


RULES = {"/v1/chat/completions": _chat, "/v1/messages": _messages,
         "/v1/messages/count_tokens": _messages, "/v1/responses": _responses}
# Where each API's body holds a JSON Schema ("*": every item of a list).
SCHEMAS = {"/v1/chat/completions": [("tools", "*", "function", "parameters"),
                                    ("response_format", "json_schema", "schema")],
           "/v1/messages": [("tools", "*", "input_schema"), ("output_config", "format", "schema"),
                            ("output_format", "schema")],
           "/v1/responses": [("tools", "*", "parameters"), ("text", "format", "schema"),
                             ("tools", "*", "tools", "*", "parameters")]}
SCHEMAS["/v1/messages/count_tokens"] = SCHEMAS["/v1/messages"]


def _holders(node: Any, keys: tuple) -> list[tuple[dict, str]]:
    """The objects under ``node`` that hold a value at the path ``keys``, with its key."""
    if len(keys) == 1:
        return [(node, keys[0])] if isinstance(node, dict) else []
    if keys[0] == "*":
        items = node if isinstance(node, list) else []
    else:
        items = [node.get(keys[0])] if isinstance(node, dict) else []
    return [h for item in items for h in _holders(item, keys[1:])]


def _valid_schemas(path: str, body: dict) -> None:
    """Each JSON Schema in ``body`` kept if it is valid JSON Schema, else a plain object's."""
    for keys in SCHEMAS.get(path, []):
        for holder, key in _holders(body, keys):
            if isinstance(holder.get(key), dict):
                try:
                    Draft202012Validator.check_schema(holder[key])
                except SchemaError:
                    holder[key] = {"type": "object"}


PICTURE = png(16, 16)  # a real image file: what each image of a body becomes
IMAGE_TYPES = ("image_url", "image", "input_image")  # each API's image part
TEXT_PART = {"/v1/responses": "input_text"}  # what an image past --max-images becomes


def _image_parts(node: Any) -> list[tuple[list, int]]:
    """The image parts under ``node`` (a body's messages or input), as (list, index)."""
    out = []
    for value in node.values() if isinstance(node, dict) else node if isinstance(node, list) \
            else ():
        if isinstance(value, list):
            out += [(value, i) for i, v in enumerate(value)
                    if isinstance(v, dict) and v.get("type") in IMAGE_TYPES]
        out += _image_parts(value)
    return out


def _pictures(path: str, body: dict, vision: str | None) -> None:
    """Each image a real picture; those past ``--max-images`` become empty text parts; a body
    with images names ``vision`` (a served model that takes images) where one is given."""
    parts = _image_parts(body.get("messages" if "messages" in body else "input"))
    for n, (holder, i) in enumerate(parts):
        part = holder[i]
        if n >= ServerConfig.max_images:
            holder[i] = {"type": TEXT_PART.get(path, "text"), "text": ""}
        elif part["type"] == "image" and part["source"].get("type") == "base64":
            part["source"].update(media_type="image/png",
                                  data=data_url(PICTURE).partition(",")[2])
        elif part["type"] == "image":
            part["source"]["url"] = data_url(PICTURE)
        elif isinstance(part["image_url"], dict):
            part["image_url"]["url"] = data_url(PICTURE)
        else:
            part["image_url"] = data_url(PICTURE)
    if parts and vision is not None:
        body["model"] = vision


# The routes that take another route's body (api/tokenize.py): the same rules.
RENDERED = {"/v1/chat/completions/render": "/v1/chat/completions",
            "/v1/completions/render": "/v1/completions",
            "/v1/responses/render": "/v1/responses"}


def follow_rules(path: str, body: dict, vision: str | None = None) -> dict:
    """``body`` changed to keep the rules the description states in words (see the module);
    ``vision``: a served model that takes images, for the bodies with images."""
    path = RENDERED.get(path, path)
    if path == "/tokenize":  # a chat's body or a completion's
        path = "/v1/chat/completions" if body.get("messages") is not None else "/v1/completions"
    if path in RULES:
        RULES[path](body)
        _valid_schemas(path, body)
        _pictures(path, body, vision)
    return body


# -- wrong types -----------------------------------------------------------------------------

# A value of every JSON type (empty and not; 1.0 is an integer to JSON Schema), for
# :func:`locations` of a valid body to take.
WRONG_TYPES = [None, False, 0, 1.0, -1.5, "", "x", [], [0], {}, {"x": {}}]


def locations(value: Any, at: tuple = ()):
    """Every place below the root of a JSON ``value``, as a path of keys and indices."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        yield at + (key,)
        yield from locations(item, at + (key,))


def kind_of(value: Any, at: tuple) -> tuple:
    """The field ``at`` names, whatever the indices: its keys, each with the ``type`` and
    ``role`` of the object holding it (the branch of a ``oneOf`` it is in)."""
    out, node = [], value
    for key in at:
        tags = (node.get("type"), node.get("role")) if isinstance(node, dict) else ()
        out.append(("#" if isinstance(key, int) else key,
                    tuple(t if isinstance(t, str) else None for t in tags)))
        node = node[key]
    return tuple(out)


def replaced(value: Any, at: tuple, new: Any) -> Any:
    """A copy of ``value`` with ``new`` at ``at``."""
    out = copy.deepcopy(value)
    node = out
    for key in at[:-1]:
        node = node[key]
    node[at[-1]] = new
    return out


def property_names(doc: Document, schema: dict) -> set[str]:
    """Every property name a schema declares, at any depth, in any branch."""
    s, out = doc.resolve(schema), set()
    for name, sub in s.get("properties", {}).items():
        out |= {name} | property_names(doc, sub)
    for sub in [*s.get("oneOf", []), *s.get("anyOf", []), *s.get("allOf", []),
                *([s["items"]] if isinstance(s.get("items"), dict) else [])]:
        out |= property_names(doc, sub)
    return out


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string in ``value`` has a lone surrogate (outside I-JSON, RFC 7493)."""
    if isinstance(value, str):
        return not value.isascii() and any(0xD800 <= ord(c) <= 0xDFFF for c in value)
    if isinstance(value, dict):
        return any(has_lone_surrogate(k) or has_lone_surrogate(v) for k, v in value.items())
    if isinstance(value, list):
        return any(has_lone_surrogate(v) for v in value)
    return False


def not_about_shape(r) -> bool:
    """Whether a refusal is for what the description cannot know, as it says: a model it does
    not serve or a response it does not hold (the generating APIs' 404s), a prompt longer than
    the model's context (a 400 saying so), images to a model that takes none, a body over the
    size limit or a full queue."""
    if r.status_code in (404, 413, 429):
        return True
    message = r.json()["error"]["message"] if r.status_code == 400 else ""
    return "this model's context is" in message or " does not take images (" in message
