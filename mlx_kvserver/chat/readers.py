"""The call reader of each tool-call format (:mod:`.calls`, :mod:`.xml_calls`): :func:`reader_for`."""

from __future__ import annotations

from .calls import (HERMES_HEAD, OBJECT_TAIL, CallReader, JsonCallsReader, MistralReader,
                    WholeReader, deepseek_calls, json_objects, mlx_parser, JNAME)
from .gemma_calls import Gemma4Reader
from .xml_calls import XML_FORMATS, XmlCallsReader


def reader_for(parser: str, tools: list[dict]) -> CallReader:
    """A fresh reader for one block of format ``parser`` (a :class:`.formats.ChatFormat`'s
    ``tool_parser``); ``tools`` in Hugging Face's shape (XML formats type values by them)."""
    if parser in ("fallback", "json_tools"):
        return JsonCallsReader(HERMES_HEAD, OBJECT_TAIL, json_objects)
    if parser == "llama3_json":
        head = r"\s*;?\s*\{\s*" + JNAME + r'\s*,\s*"(?:parameters|arguments)"\s*:\s*'
        return JsonCallsReader(head, OBJECT_TAIL, json_objects, multi=True, rest=r"[\s;]*")
    if parser == "mistral":
        return MistralReader(tools)
    if parser == "kimi_k2":
        head = (r"\s*<\|tool_call_begin\|>\s*(?:functions\.)?(?P<name>[^:<]+?)(?::\d+)?\s*"
                r"<\|tool_call_argument_begin\|>\s*")
        return JsonCallsReader(head, r"\s*<\|tool_call_end\|>", mlx_parser("kimi_k2", tools),
                               multi=True)
    if parser == "deepseek_v3":
        head = (r"\s*<｜tool▁call▁begin｜>(?:function<｜tool▁sep｜>(?P<name>[^\n<]+)\n```"
                r"(?:json)?\n|(?!function<｜tool▁sep｜>)(?P<name2>[^<\n]+?)<｜tool▁sep｜>)")
        head = head.replace("(?P<name2>", "(?P<name>")  # one name group in either branch
        return JsonCallsReader(head, r"\s*(?:```)?\s*<｜tool▁call▁end｜>", deepseek_calls,
                               multi=True)
    if parser in XML_FORMATS:
        return XmlCallsReader(parser, tools)
    if parser == "gemma4":
        return Gemma4Reader(tools)
    return WholeReader(mlx_parser(parser, tools))
