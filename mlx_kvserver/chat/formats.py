"""What a model's chat template says about tools and reasoning: :class:`ChatFormat`.

:func:`detect` works it out once per model from the template's source, a trial render and the
vocabulary:

- the tool-call format: mlx-lm's own inference (``mlx_lm.tokenizer_utils._infer_tool_parser``,
  which names a module of ``mlx_lm/tool_parsers/``), then patterns of ours: Llama 3.x's bare
  JSON calls (``llama3_json``) and DeepSeek V3's ``<｜tool▁calls▁begin｜>`` (``deepseek_v3``),
  which mlx-lm has no parser for, and hermes-style ``<tool_call>`` templates that mlx-lm's test
  misses (``json_tools``). How each is read as it streams: :mod:`.calls`;
- whether the template renders a tool list (a trial render with a probe tool). A template that
  cannot, or whose call format we cannot parse, gets our documented fallback
  (:mod:`.render`): the tools in the system prompt, calls as ``<tool_call>{json}</tool_call>``.
  What the model is told and what we parse are then always the same format;
- the think markers (mlx-lm's ``_infer_thinking``: ``<think>``/``</think>`` and the like in the
  vocabulary, or both named in the template) and the template variable that switches thinking.

gpt-oss's Harmony format (a template that writes ``<|channel|>`` and ``<|message|>``, a
vocabulary with Harmony's special tokens) is its own format, ``harmony``: messages with headers
instead of call and think markers, parsed by :mod:`.harmony`, rendered as :mod:`.render` says.
"""

from __future__ import annotations

import importlib
import logging
import re
from dataclasses import dataclass, replace
from types import ModuleType, SimpleNamespace
from typing import Any

log = logging.getLogger(__name__)

FALLBACK = "fallback"
LLAMA3_JSON = "llama3_json"
HARMONY = "harmony"
_HARMONY_TOKENS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>",
                   "<|call|>")
DEEPSEEK_V3 = "deepseek_v3"
OWN_MARKERS = {DEEPSEEK_V3: ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>")}  # ours, not mlx-lm's
FALLBACK_START, FALLBACK_END = "<tool_call>", "</tool_call>"
_JSON_PAYLOAD = ("json_tools", FALLBACK)
_PROBE = "probe_tool_5f1c"


@dataclass(frozen=True)
class ChatFormat:
    """How one model's chat template renders tools and reasoning, and how its output marks them.

    ``tool_parser``: the mlx-lm tool-parser module (``json_tools``, ``qwen3_coder``, ``mistral``,
    ``pythonic``, ...), ``llama3_json`` (ours), ``harmony`` (gpt-oss: no markers here, its own
    parser) or ``fallback`` (ours: ``<tool_call>`` JSON).
    ``call_start``/``call_end``: the markers around a call (None where there is none: mistral
    has no end, llama3_json no start but the optional ``<|python_tag|>``).
    ``native_tools``: the template renders the tool list, calls and results itself.
    ``think_start``/``think_end``: reasoning markers (None: not a thinking model).
    ``thinking_kwarg``: the template variable that switches thinking (``enable_thinking``).
    ``call_payload``: ``"json"`` where a call is ``{"name": ..., "arguments": {...}}`` JSON
    between ``call_start`` and ``call_end`` (what a grammar can force), else None.
    ``markers_special``: some marker is a special token that ``decode(skip_special_tokens=True)``
    drops, so the output must be decoded with special tokens kept for the parser to see it.
    """

    tool_parser: str = FALLBACK
    call_start: str | None = FALLBACK_START
    call_end: str | None = FALLBACK_END
    native_tools: bool = False
    think_start: str | None = None
    think_end: str | None = None
    thinking_kwarg: str | None = None
    call_payload: str | None = "json"
    markers_special: bool = False

    @property
    def harmony(self) -> bool:
        """gpt-oss's Harmony format (:mod:`.harmony`)."""
        return self.tool_parser == HARMONY

    @property
    def markers(self) -> tuple[str, ...]:
        """The non-empty markers of this format."""
        return tuple(m for m in (self.call_start, self.call_end, self.think_start, self.think_end)
                     if m)


def detect(tok: Any) -> ChatFormat:
    """The :class:`ChatFormat` of ``tok`` (a ``ChatTokenizer``: ``.hf``, ``.chat_template``)."""
    hf, tpl = tok.hf, tok.chat_template or ""
    vocab = hf.get_vocab()
    if "<|channel|>" in tpl and "<|message|>" in tpl and all(t in vocab for t in _HARMONY_TOKENS):
        fmt = ChatFormat(tool_parser=HARMONY, call_start=None, call_end=None, native_tools=True,
                         markers_special=_dropped_by_decode(hf, "<|channel|>"))
        log.info("chat format: %s", fmt)
        return fmt
    parser = _tool_parser(tpl, vocab)
    native = parser is not None and _renders_tools(hf, tpl)
    fmt = format_for(parser if native else FALLBACK, _thinking(hf, tpl), native=native,
                     thinking_kwarg=_thinking_kwarg(tpl), python_tag="<|python_tag|>" in vocab)
    fmt = replace(fmt, markers_special=any(_dropped_by_decode(hf, m) for m in fmt.markers))
    log.info("chat format: %s", fmt)
    return fmt


def format_for(parser: str, think: tuple[str | None, str | None] | None, *,
               native: bool = True, thinking_kwarg: str | None = None,
               python_tag: bool = False) -> ChatFormat:
    """The :class:`ChatFormat` of tool-call format ``parser`` with think markers ``think``
    (``markers_special`` is the tokenizer's to say: :func:`detect`)."""
    if parser == FALLBACK:
        start, end, native = FALLBACK_START, FALLBACK_END, False
    elif parser == LLAMA3_JSON:
        start, end = ("<|python_tag|>" if python_tag else None), None
    elif parser in OWN_MARKERS:
        start, end = OWN_MARKERS[parser]
    else:
        mod = mlx_tool_parser(parser)
        start, end = mod.tool_call_start or None, mod.tool_call_end or None
    think_start, think_end = think or (None, None)
    return ChatFormat(tool_parser=parser, call_start=start, call_end=end, native_tools=native,
                      think_start=think_start, think_end=think_end,
                      thinking_kwarg=thinking_kwarg,
                      call_payload="json" if parser in _JSON_PAYLOAD else None)


def mlx_tool_parser(name: str) -> ModuleType:
    """mlx-lm's tool-parser module ``name`` (``mlx_lm/tool_parsers/<name>.py``: its markers
    ``tool_call_start``/``tool_call_end`` and ``parse_tool_call``); ImportError when mlx-lm has
    no such module."""
    return importlib.import_module(f"mlx_lm.tool_parsers.{name}")


def _tool_parser(tpl: str, vocab: dict) -> str | None:
    try:
        from mlx_lm.tokenizer_utils import _infer_tool_parser
        name = _infer_tool_parser(SimpleNamespace(chat_template=tpl, get_vocab=lambda: vocab))
    except ImportError:  # a private helper of mlx-lm: our own patterns still apply
        name = None
    if name is not None:
        try:
            mlx_tool_parser(name)
            return name
        except ImportError:
            log.warning("mlx-lm names tool parser %r but has no such module", name)
            return None
    if '"parameters": ' in tpl and "ipython" in tpl:  # Llama 3.1-3.3: bare JSON calls
        return LLAMA3_JSON
    if "<｜tool▁calls▁begin｜>" in tpl:  # DeepSeek V3 / R1 / V3.1
        return DEEPSEEK_V3
    if "<tool_call>" in tpl and "</tool_call>" in tpl and "arguments" in tpl:
        return "json_tools"
    return None


def _renders_tools(hf: Any, tpl: str) -> bool:
    tool = {"type": "function", "function": {
        "name": _PROBE, "description": "probe", "parameters": {"type": "object",
                                                               "properties": {}}}}
    for msgs in ([{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
                 [{"role": "user", "content": "u"}]):
        try:
            out = hf.apply_chat_template(msgs, chat_template=tpl, tools=[tool], tokenize=False,
                                         add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates raise anything; try the next shape
            continue
        return _PROBE in str(out)
    return bool(re.search(r"\btools\b", tpl))


def _thinking(hf: Any, tpl: str) -> tuple[str | None, str | None]:
    try:
        from mlx_lm.tokenizer_utils import _infer_thinking
        start, end = _infer_thinking(hf)[:2]
    except ImportError:
        start = end = None
    if start is None and "<think>" in tpl and "</think>" in tpl:
        start, end = "<think>", "</think>"
    if start is None and "[THINK]" in hf.get_vocab() and "[/THINK]" in hf.get_vocab():
        start, end = "[THINK]", "[/THINK]"  # Magistral, Devstral
    return start, end


def _thinking_kwarg(tpl: str) -> str | None:
    if re.search(r"\benable_thinking\b", tpl):
        return "enable_thinking"
    if re.search(r"\{%-?\s*(?:el)?if\b[^%]*\bthinking\b", tpl):
        return "thinking"
    return None


def _dropped_by_decode(hf: Any, marker: str) -> bool:
    ids = hf.encode(marker, add_special_tokens=False)
    return hf.decode(ids, skip_special_tokens=True) != marker
