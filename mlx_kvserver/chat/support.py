"""What serving chat needs to know about one model, worked out once: its chat format (tool-call
and reasoning markers), its grammars, its vocabulary size, and which output constraint a
conversation asks for."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import RequestError
from .conversation import Conversation
from .formats import ChatFormat, detect

_lock = threading.Lock()


class ChatSupport:
    """The chat side of one loaded model (``chat_support(lm)`` builds it once per model)."""

    def __init__(self, lm: Any):
        tok = lm.tokenizer
        self.format: ChatFormat = detect(tok)
        args = getattr(lm.model, "args", None)
        size = getattr(args, "vocab_size", None) or \
            getattr(getattr(args, "text_config", None), "vocab_size", None)
        self.vocab_size = int(size) if isinstance(size, int) and size > 0 else tok.vocab_size
        # a marker that is a special token vanishes from a plain decode: keep them then
        self.markers_special = self.format.markers_special
        self._tok = tok
        self._grammars = None

    @property
    def grammars(self):
        if self._grammars is None:  # the grammar library loads only when a request needs it
            from .constraints import Grammars
            self._grammars = Grammars(self._tok, self.vocab_size)
        return self._grammars

    def output_parser(self, index: int, tools: list, in_reasoning: bool, parallel: bool):
        """A parser for the output of choice ``index`` (``tools``: those it may call):
        :class:`.harmony.HarmonyParser` for gpt-oss's Harmony format, else
        :class:`.parse.OutputParser`."""
        if self.format.harmony:
            from .harmony import HarmonyParser
            return HarmonyParser(index, tools, in_reasoning=in_reasoning, parallel=parallel)
        from .parse import OutputParser
        return OutputParser(self.format, index, tools, in_reasoning=in_reasoning,
                            parallel=parallel)

    def grammar_for(self, conv: Conversation):
        """The grammar that constrains ``conv``'s answer, or None (a 400 when it cannot be
        built: a schema that does not compile, a forced call in a format we cannot force)."""
        choice = conv.tool_choice
        if conv.tools and choice.mode in ("required", "function"):
            f = self.format
            if f.harmony:  # one call per message: parallel_tool_calls is moot
                return self.grammars.compile_harmony_call(conv.tools, choice)
            if f.call_payload != "json" or not f.call_start:
                raise RequestError(400, f"this model's tool-call format ({f.tool_parser}) "
                                   "cannot be forced; use tool_choice 'auto'",
                                   param="tool_choice", code="unsupported_tool_choice")
            return self.grammars.compile_tool_calls(
                conv.tools, choice, f.call_start, f.call_end,
                conv.parallel_tool_calls and choice.mode != "function")
        if conv.response_format.type != "text":
            return self.grammars.compile_response_format(conv.response_format,
                                                         harmony=self.format.harmony)
        return None


def chat_support(lm: Any) -> ChatSupport:
    """``lm``'s :class:`ChatSupport`, built on first use and kept on the model."""
    if lm.chat is None:
        with _lock:
            if lm.chat is None:
                lm.chat = ChatSupport(lm)
    return lm.chat
