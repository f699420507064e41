"""tool_choice checked against the tools (one check for every API), the tools a forcing choice
lets the output call, and its 400s."""

from __future__ import annotations

import pytest

from mlx_kvserver.chat.conversation import Tool, ToolChoice
from mlx_kvserver.chat.tool_choice import checked, chosen_tools
from mlx_kvserver.errors import RequestError

TOOLS = [Tool("a"), Tool("b")]


def test_a_named_tool_or_all_of_them():
    assert chosen_tools(TOOLS, ToolChoice("function", "b")) == [TOOLS[1]]
    assert chosen_tools(TOOLS, ToolChoice("required")) == TOOLS


@pytest.mark.parametrize("tools,choice,says", [
    (TOOLS, ToolChoice("function", "c"), "not in 'tools'"),
    ([], ToolChoice("required"), "'tools' is empty"),
    ([Tool("a", parameters=["not", "a", "schema"])], ToolChoice("required"), "JSON Schema"),
])
def test_a_bad_choice_is_a_400_that_says_why(tools, choice, says):
    with pytest.raises(RequestError, match=says) as e:
        chosen_tools(tools, choice)
    assert e.value.status == 400


def test_a_choice_that_does_not_force_is_a_caller_error():
    with pytest.raises(ValueError):
        chosen_tools(TOOLS, ToolChoice("auto"))


@pytest.mark.parametrize("tools,choice", [
    (TOOLS, ToolChoice()), (TOOLS, ToolChoice("none")), (TOOLS, ToolChoice("required")),
    (TOOLS, ToolChoice("function", "a")), ([], ToolChoice()), ([], ToolChoice("none")),
])
def test_a_choice_the_tools_satisfy_passes_as_it_is(tools, choice):
    assert checked(choice, tools) is choice


@pytest.mark.parametrize("tools,choice,says", [
    ([], ToolChoice("required"), "asks for a tool call but 'tools' is empty"),
    ([], ToolChoice("function", "a"), "asks for a tool call but 'tools' is empty"),
    (TOOLS, ToolChoice("function", "c"), "names 'c', which is not in 'tools'"),
])
def test_the_one_check_every_api_makes(tools, choice, says):
    with pytest.raises(RequestError, match=says) as e:
        checked(choice, tools)
    assert (e.value.status, e.value.param) == (400, "tool_choice")
