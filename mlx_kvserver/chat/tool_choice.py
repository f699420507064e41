"""The tools a forcing ``tool_choice`` lets the output call, checked (a 400 for a bad choice):
what the forced-call grammar (``constraints.py``) is built over."""

from __future__ import annotations

from ..errors import RequestError
from .conversation import Tool, ToolChoice


def chosen_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools ``choice`` (``required`` or ``function``) lets the output call; a 400 when
    there are none or a schema is not an object."""
    if choice.mode == "function":
        chosen = [t for t in tools if t.name == choice.name]
        if not chosen:
            raise RequestError(400, f"tool_choice names {choice.name!r}, which is not among "
                               "the tools", param="tool_choice")
    elif choice.mode == "required":
        chosen = list(tools)
        if not chosen:
            raise RequestError(400, "tool_choice 'required' needs at least one tool",
                               param="tool_choice")
    else:
        raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output")
    for t in chosen:
        if not isinstance(t.parameters, dict):
            raise RequestError(400, f"tool {t.name!r}: parameters must be a JSON Schema "
                               "object", param="tools", code="invalid_schema")
    return chosen
