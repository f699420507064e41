"""The tools a forcing tool_choice lets the output call, and its 400s."""

from __future__ import annotations

import pytest

from mlx_kvserver.chat.conversation import Tool, ToolChoice
from mlx_kvserver.chat.tool_choice import chosen_tools
from mlx_kvserver.errors import RequestError

TOOLS = [Tool("a"), Tool("b")]


def test_a_named_tool_or_all_of_them():
    assert chosen_tools(TOOLS, ToolChoice("function", "b")) == [TOOLS[1]]
    assert chosen_tools(TOOLS, ToolChoice("required")) == TOOLS


@pytest.mark.parametrize("tools,choice,says", [
    (TOOLS, ToolChoice("function", "c"), "not among the tools"),
    ([], ToolChoice("required"), "at least one tool"),
    ([Tool("a", parameters=["not", "a", "schema"])], ToolChoice("required"), "JSON Schema"),
])
def test_a_bad_choice_is_a_400_that_says_why(tools, choice, says):
    with pytest.raises(RequestError, match=says) as e:
        chosen_tools(tools, choice)
    assert e.value.status == 400


def test_a_choice_that_does_not_force_is_a_caller_error():
    with pytest.raises(ValueError):
        chosen_tools(TOOLS, ToolChoice("auto"))
