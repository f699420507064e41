"""Recorded and documented model outputs with tool calls and reasoning, one JSON file per family.

Each file: {"family", "reasoning_markers", "reasoning_source", "call_markers", "call_source",
"samples": [{"source", "kind", "note", "text", "tools"?, "prompt_ends_in_reasoning",
"expect": {"content", "reasoning", "tool_calls": [{"name", "arguments"}]}}]}.
See SOURCES.md next to this file for where every sample comes from.
"""

import json
from pathlib import Path

_DIR = Path(__file__).resolve().parent
KINDS = ("recorded", "documented example", "test fixture")


def families() -> list[str]:
    """The families with a corpus file, sorted."""
    return sorted(p.stem for p in _DIR.glob("*.json"))


def load(family: str) -> dict:
    """The corpus of ``family``, checked for the shape every sample must have."""
    path = _DIR / f"{family}.json"
    data = json.loads(path.read_text(encoding="utf-8"))
    if data.get("family") != family:
        raise ValueError(f"{path.name}: family is {data.get('family')!r}")
    for i, s in enumerate(data["samples"]):
        where = f"{path.name} sample {i}"
        if s.get("kind") not in KINDS or not s.get("source") or not isinstance(s.get("text"), str):
            raise ValueError(f"{where}: needs source, a known kind and a text")
        expect = s["expect"]
        if not isinstance(expect.get("content"), str) or not isinstance(expect.get("reasoning"), str):
            raise ValueError(f"{where}: expect.content and expect.reasoning must be strings")
        for call in expect["tool_calls"]:
            if not isinstance(call.get("name"), str) or not isinstance(call.get("arguments"), dict):
                raise ValueError(f"{where}: a tool call needs a name and an arguments object")
    return data
