"""A tool's parameters schema closed for its forced-call grammar: :func:`closed`.

JSON Schema lets an object have keys its ``properties`` do not declare unless it says
``additionalProperties: false``, and most tool schemas say nothing. Under a grammar that allows
any extra key, a small model copies the schema into the call (``"description"``, ``"type"``,
``"properties"``, ...) until ``max_tokens``; an agent then runs a call with keys its tool never
declared. llama.cpp's grammar treats an unset ``additionalProperties`` as false for this
reason; llguidance has no option for it (its ``x-guidance`` options are separators, whitespace,
``coerce_one_of``, ``lenient`` and escapes), so the schema the grammar is built from is
rewritten here, and only here. The tool's own schema is not touched: it is what the prompt
shows and what a call is checked against.

An object schema is closed only where closing cannot refuse what the schema allows together
with another part of it: it declares ``properties``; it says nothing of
``additionalProperties`` / ``unevaluatedProperties``; nothing is combined with it (no ``allOf``,
``anyOf``, ``oneOf``, ``$ref``, ``if``/``then``/``else``, ``not`` or ``dependentSchemas`` beside
it; it is not an ``allOf`` member, nor an ``anyOf`` / ``oneOf`` alternative of a schema that
says more than its type, nor the target of a ``$ref`` used so); and every name in its
``required`` is declared (else no call could be written). The alternatives of a bare
``anyOf`` / ``oneOf`` are closed one by one (each is a whole answer); nothing under ``not`` or
``if`` is touched.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords beside ``properties`` that make an object schema the intersection of several
_COMBINED = ("allOf", "anyOf", "oneOf", "$ref", "$dynamicRef", "if", "then", "else",
             "dependentSchemas", "not")
# keywords that say what undeclared keys may be
_OPEN_KEYS = ("additionalProperties", "unevaluatedProperties")
# subschemas by keyword: one schema, a list of schemas, or a map of names to schemas
_ONE = ("additionalProperties", "items", "contains", "propertyNames")
_LIST = ("prefixItems", "anyOf", "oneOf", "allOf")
_MAP = ("properties", "patternProperties", "$defs", "definitions")
_UNTOUCHED = ("not", "if", "then", "else", "dependentSchemas")
# keywords that constrain nothing
_ANNOTATIONS = {"title", "description", "$comment", "default", "examples", "deprecated",
                "readOnly", "writeOnly", "type"}
_VALUES = ("enum", "const", "default", "examples")  # JSON values, not schemas


def closed(schema: Any) -> Any:
    """A copy of ``schema`` with ``additionalProperties: false`` added to each object schema
    that declares its ``properties``, says nothing of undeclared keys, and is not combined with
    another schema (see the module's notes); ``schema`` itself is not changed."""
    if not isinstance(schema, dict):
        return schema
    out = copy.deepcopy(schema)
    _close(out, "#", _combined_targets(out), joined=False)
    return out


def _close(node: Any, where: str, combined: set[str], joined: bool) -> None:
    """``joined``: ``node`` is intersected with a schema beside it (an ``allOf`` member, an
    alternative of an ``anyOf`` whose schema says more): it stays open."""
    if not isinstance(node, dict):
        return
    if not joined and where not in combined and _closable(node):
        node["additionalProperties"] = False
    for key in _ONE:
        if isinstance(node.get(key), dict):
            _close(node[key], f"{where}/{key}", combined, False)
    subs = [("items", node.get("items"))] + [(k, node.get(k)) for k in _LIST]
    for key, sub in subs:
        if isinstance(sub, list):  # ("items" as a list: draft 4's tuple)
            for i, s in enumerate(sub):
                _close(s, f"{where}/{key}/{i}", combined, _joins(node, key))
    for key in _MAP:
        if isinstance(node.get(key), dict):
            for name, s in node[key].items():
                _close(s, f"{where}/{key}/{_escape(name)}", combined, False)


def _joins(node: dict, key: str) -> bool:
    """Whether the members of ``node[key]`` are each intersected with more than ``node``'s
    type: always for ``allOf``; for ``anyOf`` / ``oneOf`` when ``node`` says more."""
    if key == "allOf":
        return True
    return key in ("anyOf", "oneOf") and bool(set(node) - _ANNOTATIONS - {key})


def _closable(node: dict) -> bool:
    props = node.get("properties")
    if not isinstance(props, dict) or any(k in node for k in _OPEN_KEYS + _COMBINED):
        return False
    kind = node.get("type", "object")
    if not (kind == "object" or isinstance(kind, list) and "object" in kind):
        return False
    required = node.get("required", [])
    return isinstance(required, list) and all(r in props for r in required)


def _combined_targets(root: dict) -> set[str]:
    """The local ``$ref`` targets (as ``#/...`` pointers) that some schema combines with
    another: a ``$ref`` with constraints beside it, or in a joined member (:func:`_joins`),
    or beneath ``not`` / ``if`` / ``then`` / ``else`` / ``dependentSchemas``; followed through
    targets that are themselves a ``$ref``."""
    found: set[str] = set()

    def walk(node: Any, joined: bool, under: bool) -> None:
        if isinstance(node, list):
            for sub in node:
                walk(sub, joined, under)
            return
        if not isinstance(node, dict):
            return
        ref = node.get("$ref")
        if isinstance(ref, str) and (joined or under or set(node) - _ANNOTATIONS - {"$ref"}):
            found.add(ref)
        for key, sub in node.items():
            if key not in _VALUES:
                walk(sub, isinstance(sub, list) and _joins(node, key),
                     under or key in _UNTOUCHED)

    walk(root, False, False)
    todo, seen = list(found), set()
    while todo:  # a target that is itself a reference passes the combination on
        ref = todo.pop()
        if ref in seen:
            continue
        seen.add(ref)
        target = _resolve(root, ref)
        if isinstance(target, dict) and isinstance(target.get("$ref"), str):
            todo.append(target["$ref"])
    return {r.rstrip("/") or "#" for r in seen}


def _resolve(root: dict, ref: str) -> Any:
    if not ref.startswith("#"):
        return None  # not a local reference: llguidance refuses it anyway
    node: Any = root
    for part in [p for p in ref[1:].split("/") if p]:
        part = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            return None
    return node


def _escape(name: str) -> str:
    return name.replace("~", "~0").replace("/", "~1")
