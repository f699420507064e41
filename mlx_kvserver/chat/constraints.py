"""Output constraints by grammar: JSON answers and forced tool calls, by constrained decoding.

``response_format`` ``json_object`` / ``json_schema`` and ``tool_choice`` ``required`` / a named
function compile to a :class:`Grammar` (through llguidance: an Earley parser over lazily built
lexer automata, so a 25-tool agent schema compiles in milliseconds and each step's token mask
costs a fraction of a millisecond; see ``benchmarks/grammar.py``). Each generated choice gets
its own :class:`Matcher`, which masks the logits of every decode step and follows the sampled
tokens::

    grammars = Grammars(tokenizer, vocab_size=logits_width)          # one per model
    grammar = grammars.compile_response_format(conv.response_format)  # RequestError on a bad schema
    m = grammar.matcher()                                             # one per choice
    while True:
        token = sample(m.apply(logits))
        m.advance(token)       # an EOS token is allowed (and ends m) only once m.accepting
        if token in eos_ids or m.finished: break

JSON comes out in one canonical layout: ``", "`` between items, ``": "`` after keys, no other
whitespace (a grammar that allows any whitespace lets a weak model pad forever).

NOTE (thinking models): the constraint applies from the first generated token. A thinking
template's reasoning is not part of the grammar, so the caller either turns thinking off for a
constrained request or starts the matcher only after the reasoning has ended.
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections import OrderedDict
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from ..errors import RequestError
from .closed_schema import closed
from .conversation import ResponseFormat, Tool, ToolChoice
from .tool_choice import chosen_tools

try:
    import llguidance as llg
except ImportError:  # pragma: no cover - a declared dependency; tests skip without it
    llg = None

_JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 32  # compiled grammars kept per model (agents resend the same tools every turn)


def _json_options(lenient: bool) -> dict[str, Any]:
    # lenient: keywords llguidance cannot enforce (propertyNames, not, ...) are ignored instead
    # of refused; used for non-strict schemas, which clients send without checking them.
    return {**_JSON_OPTIONS, "lenient": lenient}


class Grammar:
    """A compiled constraint for one request; :meth:`matcher` starts one per generated choice."""

    def __init__(self, owner: Grammars, proto: Any, kind: str) -> None:
        self._owner, self._proto, self.kind = owner, proto, kind

    def matcher(self) -> Matcher:
        """A fresh :class:`Matcher` at the start of the output (a cheap copy of the compiled
        one)."""
        return Matcher(self._proto.deep_copy(), self._owner)


class Matcher:
    """The grammar's state for one generated choice: masks logits, follows sampled tokens.

    EOS: the model's end tokens are allowed exactly when the output so far is complete
    (:attr:`accepting`); advancing with one then ends the matcher. :attr:`finished` is true once
    nothing but an end may follow (for example after the closing brace of a JSON answer, or after
    the last tool call when calls are not parallel): the caller then stops the choice.
    """

    def __init__(self, ll: Any, owner: Grammars) -> None:
        self._ll = ll
        self._eos = owner.eos_ids
        self._vocab = owner.vocab_size
        # bit i of the little-endian words is token i; the words past the tokenizer's stay 0
        self._bits = np.zeros((max(owner.tokenizer_vocab, owner.vocab_size) + 31) // 32, np.int32)
        self._eos_bits = np.zeros_like(self._bits)
        for i in owner.eos_ids:
            if i < owner.vocab_size:
                self._eos_bits.view(np.uint32)[i >> 5] |= np.uint32(1 << (i & 31))
        self._ll_bytes = (owner.tokenizer_vocab + 31) // 32 * 4
        self._ended = False
        self._fresh = False  # _bits holds the mask of the current position

    def _fill(self) -> np.ndarray:
        bits = self._bits
        if not self._ended and not self._ll.is_error():
            self._ll.unsafe_compute_mask_ptr(bits.ctypes.data, self._ll_bytes)
        if self._ended or self._ll.is_error() or not bits.any():
            bits[:] = self._eos_bits  # nothing else can follow: let the choice end
        self._fresh = True
        return bits

    def mask(self) -> np.ndarray:
        """The tokens allowed next, as a bool array ``[vocab_size]``."""
        return np.unpackbits(self._fill().view(np.uint8), count=self._vocab,
                             bitorder="little").view(np.bool_)

    def apply(self, logits: mx.array) -> mx.array:
        """``logits`` (``[vocab_size]``, or any shape ending in it) with every token the grammar
        does not allow next set to -inf; the dtype is kept. For a batch see :func:`apply_rows`."""
        if logits.shape[-1] != self._vocab:
            raise ValueError(f"logits have {logits.shape[-1]} columns, the model's vocabulary "
                             f"{self._vocab}")
        return mx.where(mx.array(self.mask()), logits, mx.array(-mx.inf, dtype=logits.dtype))

    def advance(self, token: int) -> None:
        """Follow the sampled ``token``. An EOS token while :attr:`accepting` ends the matcher;
        a token the grammar does not allow (a sampler that ignored :meth:`apply`) raises
        ``ValueError``."""
        token = int(token)
        if self._ended:
            raise ValueError("the constrained output has already ended")
        if token in self._eos:
            if not self._ll.is_accepting():
                raise ValueError("end of sequence before the constrained output is complete")
            self._ll.consume_token(token)
            self._ended = True
            return
        if not 0 <= token < self._vocab:
            raise ValueError(f"token {token} is outside the vocabulary")
        ok = (int(self._bits[token >> 5]) >> (token & 31)) & 1 if self._fresh else \
            self._ll.validate_tokens([token]) == 1
        if not ok:  # NOTE: checked first: a refused token would leave llguidance in error
            raise ValueError(f"token {token} is not allowed by the grammar here")
        self._fresh = False
        if not self._ll.consume_token(token):
            raise ValueError(f"token {token}: {_brief(self._ll.get_error())}")

    def forced_tokens(self) -> list[int]:
        """The tokens the grammar allows as the only continuation from here (none where more
        than one could follow): a draft that cannot be refused."""
        if self._ended or self._ll.is_error():
            return []
        return [int(t) for t in self._ll.compute_ff_tokens() if t not in self._eos]

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens``, from the first, the grammar would take from here."""
        if self._ended or self._ll.is_error() or not tokens:
            return 0
        return int(self._ll.validate_tokens([int(t) for t in tokens]))

    @property
    def accepting(self) -> bool:
        """Whether the output so far is complete (the grammar may end here)."""
        return self._ended or self._ll.is_accepting()

    @property
    def finished(self) -> bool:
        """Whether nothing but an end may follow (the caller stops the choice)."""
        return self._ended or self._ll.is_stopped()

    @property
    def error(self) -> str | None:
        """The matcher's internal error (a parser limit hit mid-output), if any."""
        return (self._ll.get_error() or "error") if self._ll.is_error() else None


def apply_rows(logits: mx.array, matchers: Sequence[Matcher | None]) -> mx.array:
    """A batch ``[B, vocab_size]`` of logits masked row by row (``None``: that row is not
    constrained), in one ``mx.where`` whatever B is."""
    if logits.ndim != 2 or logits.shape[0] != len(matchers):
        raise ValueError(f"logits {logits.shape} for {len(matchers)} rows")
    if all(m is None for m in matchers):
        return logits
    allow = np.ones(logits.shape, np.bool_)
    for i, m in enumerate(matchers):
        if m is not None:
            allow[i] = m.mask()
    return mx.where(mx.array(allow), logits, mx.array(-mx.inf, dtype=logits.dtype))


class Grammars:
    """Compiles output constraints for one model, with a cache of recent grammars.

    ``vocab_size`` is the width of the model's logits, which may exceed the tokenizer's
    vocabulary: ids past the tokenizer's are never allowed. The library's tokenizer is built on
    first use (~0.5 s for a 49k vocabulary). Meant for one thread (the engine's); the cache and
    the lazy build are locked all the same.
    """

    def __init__(self, tok: Any, vocab_size: int) -> None:
        self.tok = tok
        self.vocab_size = int(vocab_size)
        self.eos_ids: frozenset[int] = frozenset(int(i) for i in tok.eos_token_ids)
        self.tokenizer_vocab = max(tok.hf.get_vocab().values()) + 1
        self.cache_hits = self.cache_misses = 0
        self._ll_tok: Any = None
        self._specials: dict[str, int] = {}
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, Grammar] = OrderedDict()

    def _tokenizer(self, param: str) -> Any:
        with self._lock:
            if self._ll_tok is None:
                if llg is None:
                    raise RequestError(400, "constrained output needs the llguidance package, "
                                       "which is not installed", param=param,
                                       code="constraints_unavailable")
                backend = getattr(self.tok.hf, "backend_tokenizer", None)
                if backend is None:
                    raise RequestError(400, "constrained output needs a fast (Rust) tokenizer",
                                       param=param, code="constraints_unavailable")
                # NOTE: the eos ids go to llguidance, which allows them exactly when accepting
                self._ll_tok = llg.LLTokenizer(backend.to_str(), n_vocab=self.tokenizer_vocab,
                                               eos_token=sorted(self.eos_ids) or None)
                added = getattr(self.tok.hf, "get_added_vocab", dict)()
                self._specials = {t: i for t, i in added.items()
                                  if i < self.tokenizer_vocab and self._ll_tok.is_special_token(i)}
            return self._ll_tok

    def compile_response_format(self, fmt: ResponseFormat,
                                harmony: bool = False) -> Grammar | None:
        """The grammar of ``fmt`` (None for ``text``): ``json_object`` is any JSON object,
        ``json_schema`` an instance of ``fmt.schema`` (keywords that cannot be enforced are
        refused when ``fmt.strict``, ignored otherwise). A bad schema is a 400 that says why.
        ``harmony``: gpt-oss's answer, an optional analysis message and then the JSON as its
        final message (``<|channel|>final<|message|>{...}``)."""
        if fmt.type == "text":
            return None
        if fmt.type == "json_object":
            schema: Any = {"type": "object"}
        elif fmt.type == "json_schema":
            schema = fmt.schema
            if not isinstance(schema, dict):
                raise RequestError(400, "response_format json_schema needs a schema object",
                                   param="response_format", code="invalid_schema")
        else:
            raise RequestError(400, f"unknown response_format type {fmt.type!r}",
                               param="response_format")
        key = _canonical(["format", fmt.type, schema, fmt.strict] + (["harmony"] if harmony
                                                                      else []))

        def build() -> Grammar:
            tok = self._tokenizer("response_format")
            try:
                text = llg.LLMatcher.grammar_from_json_schema(
                    schema, overrides=_json_options(not fmt.strict))  # type: ignore[arg-type]
            except ValueError as e:
                raise RequestError(400, f"response_format schema: {e}", param="response_format",
                                   code="invalid_schema") from None
            if harmony:
                rule = {**schema, "x-guidance": _json_options(not fmt.strict)}
                final = self._lark_text("<|channel|>final<|message|>")
                text = llg.LLMatcher.grammar_from_lark("\n".join(self._harmony_lines(
                    [f"{final} %json {json.dumps(rule)}"])))
            m = llg.LLMatcher(tok, text, log_level=0)
            if m.is_error():
                raise RequestError(400, "response_format schema cannot be used: "
                                   f"{_brief(m.get_error())}", param="response_format",
                                   code="invalid_schema")
            return Grammar(self, m, fmt.type)

        return self._cached(key, build)

    def compile_tool_calls(self, tools: list[Tool], choice: ToolChoice, call_start: str,
                           call_end: str, parallel: bool) -> Grammar:
        """The grammar of an output made only of tool calls, each
        ``<call_start>{"name": "<tool>", "arguments": <instance of its parameters>}<call_end>``;
        with ``parallel``, one or more calls separated by ``"\\n"``. An object in the parameters
        that does not say ``additionalProperties`` allows only its declared keys
        (:func:`.closed_schema.closed`); values keep to their ``enum``. ``choice`` is ``required``
        (any of ``tools``) or ``function`` (the named one). A parameters schema that cannot
        compile is a 400 naming the tool. Compiled grammars are cached by their input."""
        chosen = chosen_tools(tools, choice)
        # NOTE: the key keeps property order (it is the order the JSON is generated in)
        key = _canonical(["tools", call_start, call_end, bool(parallel),
                          [[t.name, t.parameters, t.strict] for t in chosen]])
        return self._cached(key, lambda: self._build_tools(chosen, call_start, call_end, parallel))

    def compile_harmony_call(self, tools: list[Tool], choice: ToolChoice) -> Grammar:
        """gpt-oss's forced call in its Harmony format: an optional analysis message, then one
        ``<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}`` (after
        ``<|start|>assistant`` when the analysis came first), args an instance of the tool's
        parameters; the output ends there with ``<|call|>``, one of the model's end tokens.
        ``choice`` as for :meth:`compile_tool_calls`."""
        chosen = chosen_tools(tools, choice)
        key = _canonical(["harmony", [[t.name, t.parameters, t.strict] for t in chosen]])
        return self._cached(key, lambda: self._build_harmony(chosen))

    def _build_tools(self, tools: list[Tool], start: str, end: str, parallel: bool) -> Grammar:
        self._tokenizer("tools")  # NOTE: first: _lark_text writes special tokens as tokens
        rules = []
        for i, t in enumerate(tools):
            head = json.dumps({"name": t.name}, ensure_ascii=False)[:-1] + ', "arguments": '
            rules.append(f"t{i}: {_lark_str(head)} {_json_rule(t)} \"}}\"")
        body = " | ".join(f"t{i}" for i in range(len(tools)))
        call = " ".join(p for p in (self._lark_text(start), f"({body})", self._lark_text(end)) if p)
        more = ' ("\\n" call)*' if parallel else ""
        return self._tool_grammar(tools, [f"start: call{more}", f"call: {call}", *rules])

    def _build_harmony(self, tools: list[Tool]) -> Grammar:
        self._tokenizer("tools")  # the special tokens are known from here on
        text = self._lark_text
        return self._tool_grammar(tools, self._harmony_lines(
            [text(f'<|channel|>commentary to=functions.{t.name} <|constrain|>json<|message|>')
             + f" {_json_rule(t)}" for t in tools]))

    def _harmony_lines(self, answers: list[str]) -> list[str]:
        """Lark for gpt-oss's Harmony: an optional analysis message, then one of ``answers``
        (a message after its header's ``<|start|>assistant``)."""
        text = self._lark_text
        return ["start: analysis? answer",
                f"analysis: {text('<|channel|>analysis<|message|>')} ANALYSIS "
                f"{text('<|end|><|start|>assistant')}",
                "ANALYSIS: /(?s:.*)/",  # any text: special tokens are not text
                "answer: " + " | ".join(f"a{i}" for i in range(len(answers))),
                *(f"a{i}: {a}" for i, a in enumerate(answers))]

    def _tool_grammar(self, tools: list[Tool], lines: list[str]) -> Grammar:
        tok = self._tokenizer("tools")
        m = llg.LLMatcher(tok, llg.LLMatcher.grammar_from_lark("\n".join(lines)), log_level=0)
        if m.is_error():
            raise self._tool_error(tools, _brief(m.get_error()))
        return Grammar(self, m, "tool_calls")

    def _tool_error(self, tools: list[Tool], combined: str) -> RequestError:
        """The 400 for a tool grammar that failed: names the first tool whose schema fails alone."""
        for t in tools:
            try:
                text = llg.LLMatcher.grammar_from_json_schema(
                    _call_schema(t), overrides=_json_options(not t.strict))
                err = llg.LLMatcher.validate_grammar(text, self._ll_tok)
            except ValueError as e:
                err = str(e)
            if err and not err.startswith("WARNING"):
                return RequestError(400, f"tool {t.name!r}: parameters schema cannot be used: "
                                    f"{_brief(err)}", param="tools", code="invalid_schema")
        return RequestError(400, f"the tool-call grammar cannot compile: {combined}",
                            param="tools", code="invalid_schema")

    def _lark_text(self, text: str) -> str:
        """A Lark expression that matches ``text``: special tokens in it (``<|im_end|>``, a
        template's ``<tool_call>`` token) as the token itself, the rest as literal text."""
        if not self._specials:
            return _lark_str(text) if text else ""
        names = sorted(self._specials, key=len, reverse=True)
        pieces = re.split("(" + "|".join(map(re.escape, names)) + ")", text)
        return " ".join(f"<[{self._specials[p]}]>" if p in self._specials else _lark_str(p)
                        for p in pieces if p)

    def _cached(self, key: str, build: Callable[[], Grammar]) -> Grammar:
        with self._lock:
            g = self._cache.get(key)
            if g is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return g
            self.cache_misses += 1
        g = build()  # outside the lock: compiling drops the GIL and may take a while
        with self._lock:
            self._cache[key] = g
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return g


def _json_rule(t: Tool) -> str:
    """A Lark ``%json`` rule for ``t``'s arguments, in the canonical layout."""
    schema = {**_call_schema(t), "x-guidance": _json_options(not t.strict)}
    return f"%json {json.dumps(schema)}"


def _call_schema(t: Tool) -> dict:
    """The schema a forced call's arguments are generated from: ``t``'s parameters with its
    objects closed to undeclared keys (``closed_schema.py``: a small model copies the schema's
    own keys into the call otherwise); ``t.parameters`` itself is left as the client sent it."""
    return closed(t.parameters or {"type": "object"})


def _canonical(obj: Any) -> str:
    blob = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _lark_str(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a JSON string is a Lark string literal


def _brief(err: str) -> str:
    """A library error on one line (regex errors come on several), at most 400 characters."""
    return " ".join(err.split())[:400] or "unknown error"
