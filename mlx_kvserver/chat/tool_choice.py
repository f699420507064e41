"""``tool_choice`` against the tools it chooses among, checked in one place: each API translates
its wire shape into a :class:`.conversation.ToolChoice` and has it checked here (a 400 with
param ``tool_choice``, in the shape of the API it came through); a forcing choice (``required``,
``function``) gives the tools the forced-call grammar (``constraints.py``) is built over."""

from __future__ import annotations

from ..errors import RequestError, bad_request
from .conversation import Tool, ToolChoice

FORCING = ("required", "function")


def checked(choice: ToolChoice, tools: list[Tool]) -> ToolChoice:
    """``choice``, once ``tools`` can satisfy it: a 400 when it asks for a call and there are no
    tools, or names a tool that is not among them."""
    if choice.mode in FORCING and not tools:
        raise bad_request("'tool_choice' asks for a tool call but 'tools' is empty",
                          "tool_choice")
    if choice.mode == "function" and choice.name not in {t.name for t in tools}:
        raise bad_request(f"'tool_choice' names {choice.name!r}, which is not in 'tools'",
                          "tool_choice")
    return choice


def chosen_tools(tools: list[Tool], choice: ToolChoice) -> list[Tool]:
    """The tools ``choice`` (``required`` or ``function``) lets the output call, each with a
    parameters schema that is an object; a 400 otherwise (:func:`checked`)."""
    if choice.mode not in FORCING:
        raise ValueError(f"tool_choice {choice.mode!r} does not constrain the output")
    checked(choice, tools)
    chosen = [t for t in tools if choice.mode == "required" or t.name == choice.name]
    for t in chosen:
        if not isinstance(t.parameters, dict):
            raise RequestError(400, f"tool {t.name!r}: parameters must be a JSON Schema "
                               "object", param="tools", code="invalid_schema")
    return chosen
