"""Constrained decoding (mlx_kvserver/chat/constraints.py) driven by a random "model".

The model is random logits each step (plus a bonus on JSON punctuation tokens, so that strings
and arrays end in a few steps), masked by the matcher, then argmax: whatever it picks, the text
must parse and validate. Runs with the tiny test tokenizer and the default model's (49k tokens).
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

from mlx_kvserver.chat.constraints import Grammar, Grammars, apply_rows
from mlx_kvserver.chat.conversation import ResponseFormat, Tool, ToolChoice
from mlx_kvserver.errors import RequestError
from mlx_kvserver.models.tokenizer import ChatTokenizer

from harness.agent_tools import agent_tool_objects  # noqa: E402

EXTRA = 7  # logits wider than the tokenizer: ids past it must never be allowed

SCHEMAS = {
    "nested": {
        "type": "object", "additionalProperties": False,
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "kind": {"type": "string", "enum": ["cat", "dog", "bird"]},
            "owner": {"type": "object", "additionalProperties": False, "required": ["id"],
                      "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                     "email": {"type": "string", "maxLength": 20}}},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                     "maxItems": 3},
            "score": {"type": "number"},
            "ok": {"type": "boolean"}},
        "required": ["name", "kind", "owner"]},
    "array_of_objects": {
        "type": "array", "minItems": 1, "maxItems": 4,
        "items": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                  "properties": {"x": {"type": "integer"},
                                 "y": {"type": ["string", "null"], "maxLength": 5}}}},
    "refs_anyof": {
        "$defs": {"pt": {"type": "object", "additionalProperties": False, "required": ["x", "y"],
                         "properties": {"x": {"type": "number"}, "y": {"type": "number"}}}},
        "type": "object", "additionalProperties": False, "required": ["shape", "n"],
        "properties": {
            "shape": {"anyOf": [{"$ref": "#/$defs/pt"}, {"type": "string", "enum": ["none"]}]},
            "n": {"type": "integer", "minimum": -5, "maximum": 5},
            "points": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}}},
}


# -- a small JSON Schema check (jsonschema is used too when it is installed) ------------------

def _validate(inst: Any, schema: dict, root: dict | None = None) -> None:
    root = root or schema
    if "$ref" in schema:
        node: Any = root
        for part in schema["$ref"].lstrip("#/").split("/"):
            node = node[part]
        return _validate(inst, node, root)
    if "anyOf" in schema:
        errors = []
        for sub in schema["anyOf"]:
            try:
                return _validate(inst, sub, root)
            except AssertionError as e:
                errors.append(e)
        raise AssertionError(f"{inst!r} matches no anyOf branch: {errors}")
    types = schema.get("type")
    types = [types] if isinstance(types, str) else types
    py = {"object": dict, "array": list, "string": str, "boolean": bool, "null": type(None),
          "integer": int, "number": (int, float)}
    if types:
        assert any(isinstance(inst, py[t]) and not (t in ("integer", "number")
                   and isinstance(inst, bool)) for t in types), f"{inst!r} is not {types}"
    if "enum" in schema:
        assert inst in schema["enum"], f"{inst!r} not in {schema['enum']}"
    if isinstance(inst, dict):
        props = schema.get("properties", {})
        for k in schema.get("required", []):
            assert k in inst, f"missing required {k!r} in {inst!r}"
        for k, v in inst.items():
            if k in props:
                _validate(v, props[k], root)
            else:
                assert schema.get("additionalProperties", True) is not False, f"extra key {k!r}"
    if isinstance(inst, list):
        assert len(inst) <= schema.get("maxItems", len(inst))
        assert len(inst) >= schema.get("minItems", 0)
        for v in inst:
            _validate(v, schema.get("items", {}), root)
    if isinstance(inst, str):
        assert len(inst) <= schema.get("maxLength", len(inst))
        assert len(inst) >= schema.get("minLength", 0)
        if "pattern" in schema:
            assert re.search(schema["pattern"], inst), f"{inst!r} !~ {schema['pattern']}"
    if isinstance(inst, (int, float)) and not isinstance(inst, bool):
        assert schema.get("minimum", inst) <= inst <= schema.get("maximum", inst)


def validate(inst: Any, schema: dict) -> None:
    _validate(inst, schema)
    try:
        import jsonschema
    except ImportError:
        return
    jsonschema.validate(inst, schema)


# -- tokenizers, grammars and the random model ------------------------------------------------

@pytest.fixture(scope="module", params=["tiny", "default"])
def grammars(request: pytest.FixtureRequest) -> Grammars:
    if request.param == "tiny":
        from transformers import PreTrainedTokenizerFast

        from harness.tiny_model import CHAT_TEMPLATE, make_tiny_tokenizer
        hf = PreTrainedTokenizerFast(tokenizer_object=make_tiny_tokenizer(),
                                     eos_token="<|im_end|>")
        tok = ChatTokenizer(hf, chat_template=CHAT_TEMPLATE)
    else:
        from mlx_kvserver.models.gguf import build_tokenizer
        from mlx_kvserver.models.loading import default_model_path
        path = default_model_path()  # installed by the set-up (scripts/setup.sh)
        _, meta = mx.load(str(path), return_metadata=True)
        hf, eos = build_tokenizer(meta)
        tok = ChatTokenizer(hf, eos_token_ids=eos)
    return Grammars(tok, tok.vocab_size + EXTRA)


_bonus_cache: dict[int, np.ndarray] = {}


def _bonus(g: Grammars) -> np.ndarray:
    """+4 on tokens made only of JSON punctuation: the random walk closes what it opens."""
    if id(g) not in _bonus_cache:
        b = np.zeros(g.vocab_size, np.float32)
        for i in range(g.tokenizer_vocab):
            text = g.tok.decode([i], skip_special_tokens=False)
            if text.strip() and all(c in '{}[]",: ' for c in text):
                b[i] = 4.0
        _bonus_cache[id(g)] = b
    return _bonus_cache[id(g)]


def walk(g: Grammars, grammar: Grammar, seed: int, max_steps: int = 1500) -> str:
    """Generate with random logits + the mask, argmax; check the mask's invariants every step."""
    rng = np.random.default_rng(seed)
    bonus, eos = _bonus(g), sorted(g.eos_ids)
    m, ids = grammar.matcher(), []
    for _ in range(max_steps):
        logits = mx.array(rng.standard_normal(g.vocab_size).astype(np.float32) + bonus)
        masked = np.array(m.apply(logits))
        allowed = np.isfinite(masked)
        assert allowed.any()
        assert not allowed[g.tokenizer_vocab:].any(), "an id past the tokenizer was allowed"
        assert all(allowed[e] == m.accepting for e in eos), "EOS allowed iff accepting"
        t = int(masked.argmax())
        m.advance(t)
        if t in g.eos_ids:
            assert m.finished and m.accepting
            break
        ids.append(t)
        if m.finished:
            assert m.accepting
            break
    else:
        pytest.fail(f"no end after {max_steps} steps: {g.tok.decode(ids)[:300]!r}")
    return g.tok.decode(ids, skip_special_tokens=False)


def tools() -> list[Tool]:
    return agent_tool_objects()


CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


def parse_calls(text: str, parallel: bool) -> list[dict]:
    bodies = CALL.findall(text)
    assert text == "\n".join(f"<tool_call>{b}</tool_call>" for b in bodies), text
    assert bodies and (parallel or len(bodies) == 1)
    calls = [json.loads(b) for b in bodies]
    for c, b in zip(calls, bodies):
        assert list(c) == ["name", "arguments"]
        assert b.startswith('{"name": ')
    return calls


# -- tests ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_outputs_validate(grammars: Grammars, name: str) -> None:
    schema = SCHEMAS[name]
    grammar = grammars.compile_response_format(ResponseFormat("json_schema", schema=schema))
    assert grammar is not None
    for seed in range(4):
        validate(json.loads(walk(grammars, grammar, seed)), schema)


def test_json_object_gives_an_object(grammars: Grammars) -> None:
    grammar = grammars.compile_response_format(ResponseFormat("json_object"))
    assert grammar is not None
    texts = [walk(grammars, grammar, seed) for seed in range(4)]
    for text in texts:
        assert isinstance(json.loads(text), dict), text
    assert grammars.compile_response_format(ResponseFormat("text")) is None


@pytest.mark.parametrize("parallel", [False, True])
def test_tool_calls_name_a_tool_with_valid_arguments(grammars: Grammars, parallel: bool) -> None:
    ts = tools()
    params = {t.name: t.parameters for t in ts}
    grammar = grammars.compile_tool_calls(ts, ToolChoice("required"), "<tool_call>",
                                          "</tool_call>", parallel)
    for seed in range(4):
        for call in parse_calls(walk(grammars, grammar, seed), parallel):
            assert call["name"] in params
            validate(call["arguments"], params[call["name"]])


def test_named_tool_choice_forces_the_name(grammars: Grammars) -> None:
    ts = tools()
    todo = next(t for t in ts if t.name == "TodoWrite")
    grammar = grammars.compile_tool_calls(ts, ToolChoice("function", "TodoWrite"),
                                          "<tool_call>", "</tool_call>", False)
    for seed in range(3):
        (call,) = parse_calls(walk(grammars, grammar, seed), False)
        assert call["name"] == "TodoWrite"
        validate(call["arguments"], todo.parameters)


def test_special_tokens_in_call_markers_are_the_tokens(grammars: Grammars) -> None:
    """A marker that is a special token (a template's <tool_call>) must be that token."""
    grammar = grammars.compile_tool_calls(
        [Tool("f", parameters={"type": "object", "properties": {"a": {"type": "boolean"}},
                               "required": ["a"], "additionalProperties": False})],
        ToolChoice("required"), "<|im_start|>", "\n", False)
    m = grammar.matcher()
    start = grammars.tok.hf.get_vocab()["<|im_start|>"]
    assert np.flatnonzero(m.mask()).tolist() == [start]
    m.advance(start)
    for t in grammars.tok.encode('{"name": "f", "arguments": {"a": true}}\n'):
        m.advance(t)
    assert m.finished and m.accepting


WEATHER = {"type": "object", "required": ["location"], "properties": {
    "location": {"type": "string", "description": "The city"},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "opts": {"type": "object", "properties": {"days": {"type": "integer"}}}}}
HEAD = '<tool_call>{"name": "get_weather", "arguments": {"location": "Paris", '


def taken(grammars: Grammars, grammar: Grammar, text: str) -> str:
    """The part of ``text`` (as the tokenizer splits it) that the grammar takes."""
    ids = grammars.tok.encode(text)
    n = grammar.matcher().valid_prefix(ids)
    return text if n == len(ids) else grammars.tok.decode(ids[:n], skip_special_tokens=False)


@pytest.mark.parametrize("choice", [ToolChoice("function", "get_weather"),
                                    ToolChoice("required")])
def test_a_forced_call_takes_only_declared_keys_and_enum_values(grammars: Grammars,
                                                               choice: ToolChoice) -> None:
    """Issue 54: a schema that says nothing of ``additionalProperties`` gets no undeclared key
    (the small model copied "description", "type", ... into its calls), at any depth; an enum
    gets only its values (no ``null``)."""
    tool = Tool("get_weather", parameters=WEATHER)
    grammar = grammars.compile_tool_calls([tool], choice, "<tool_call>", "</tool_call>", False)
    good = HEAD + '"unit": "celsius", "opts": {"days": 2}}}</tool_call>'
    assert taken(grammars, grammar, good) == good
    for bad, refused in [(HEAD + '"description": "The city"}}</tool_call>', '"description"'),
                         (HEAD + '"type": "string"}}</tool_call>', '"type"'),
                         (HEAD + '"opts": {"days": 2, "required": []}}}</tool_call>',
                          '"required"'),
                         (HEAD + '"unit": "kelvin"}}</tool_call>', "kelvin"),
                         (HEAD + '"unit": null}}</tool_call>', "null")]:
        got = taken(grammars, grammar, bad)
        assert bad.startswith(got) and refused not in got and HEAD[:-2] in got, (bad, got)
    assert tool.parameters == WEATHER  # the tool itself (what the prompt shows) is untouched
    # a schema that allows undeclared keys keeps them
    open_ = Tool("get_weather", parameters={**WEATHER, "additionalProperties": True})
    grammar = grammars.compile_tool_calls([open_], choice, "<tool_call>", "</tool_call>", False)
    extra = HEAD + '"description": "The city"}}</tool_call>'
    assert taken(grammars, grammar, extra) == extra


def test_bad_schemas_are_400_with_the_reason(grammars: Grammars) -> None:
    cases = [({"type": "strin"}, "strin"), ({"type": "object", "properties": 5}, "properties"),
             ({"type": "string", "pattern": "(("}, "unclosed group"),
             ({"$ref": "#/$defs/missing"}, "missing"),
             ({"type": "object", "propertyNames": {"pattern": "^a"}}, "propertyNames")]
    for schema, reason in cases:
        with pytest.raises(RequestError) as e:
            grammars.compile_response_format(ResponseFormat("json_schema", schema=schema))
        assert e.value.status == 400 and e.value.param == "response_format", schema
        assert reason in e.value.message, (schema, e.value.message)
    # not strict: keywords that cannot be enforced are ignored, not refused
    assert grammars.compile_response_format(ResponseFormat(
        "json_schema", schema=cases[-1][0], strict=False)) is not None


def test_bad_tool_schema_is_400_naming_the_tool(grammars: Grammars) -> None:
    ts = tools()[:3] + [Tool("Broken", parameters={"type": "object", "properties": {
        "x": {"type": "integr"}}})]
    with pytest.raises(RequestError) as e:
        grammars.compile_tool_calls(ts, ToolChoice("required"), "<tool_call>", "</tool_call>",
                                    True)
    assert e.value.status == 400 and e.value.param == "tools"
    assert "'Broken'" in e.value.message and "integr" in e.value.message
    with pytest.raises(RequestError) as e:
        grammars.compile_tool_calls(ts, ToolChoice("function", "Nope"), "<tool_call>",
                                    "</tool_call>", False)
    assert e.value.param == "tool_choice"


def test_compile_cache_hits_on_the_second_call(grammars: Grammars) -> None:
    args = (ToolChoice("required"), "<tool_call>", "</tool_call>", True)
    first = grammars.compile_tool_calls(tools(), *args)
    hits = grammars.cache_hits
    t0 = time.perf_counter()
    second = grammars.compile_tool_calls(tools(), *args)  # equal content, new objects
    elapsed = time.perf_counter() - t0
    assert second is first and grammars.cache_hits == hits + 1
    assert elapsed < 0.05, elapsed
    # what changes the grammar changes the key
    assert grammars.compile_tool_calls(tools(), *args[:3], False) is not first
    fmt = ResponseFormat("json_schema", schema=SCHEMAS["nested"])
    assert grammars.compile_response_format(fmt) is grammars.compile_response_format(fmt)


def test_eos_only_once_accepting(grammars: Grammars) -> None:
    grammar = grammars.compile_response_format(ResponseFormat("json_schema", schema={
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
        "additionalProperties": False}))
    assert grammar is not None
    eos = min(grammars.eos_ids)
    m = grammar.matcher()
    with pytest.raises(ValueError):
        m.advance(eos)
    ids = grammars.tok.encode('{"a": 12')
    for t in ids:
        assert not m.mask()[eos]
        m.advance(t)
    assert not m.accepting and not m.finished  # more digits may follow; "}" is still missing
    with pytest.raises(ValueError):
        m.advance(grammars.tok.encode('"')[0])  # not allowed here
    for t in grammars.tok.encode("}"):
        m.advance(t)
    assert m.accepting and m.finished and m.mask()[eos]
    assert np.flatnonzero(m.mask()).tolist() == sorted(grammars.eos_ids)
    m.advance(eos)  # raises nothing
    assert m.finished and m.error is None


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_apply_keeps_dtype_and_never_allows_ids_past_the_tokenizer(grammars: Grammars,
                                                                    dtype: mx.Dtype) -> None:
    m = grammars.compile_response_format(ResponseFormat("json_object")).matcher()
    out = m.apply(mx.zeros((grammars.vocab_size,), dtype=dtype))
    assert out.dtype == dtype and out.shape == (grammars.vocab_size,)
    row = np.array(out.astype(mx.float32))
    assert np.isneginf(row[grammars.tokenizer_vocab:]).all()
    assert np.isfinite(row).sum() >= 1
    row2 = mx.zeros((1, grammars.vocab_size), dtype=dtype)
    assert m.apply(row2).shape == (1, grammars.vocab_size)
    with pytest.raises(ValueError):
        m.apply(mx.zeros((grammars.vocab_size - 1,)))


def test_apply_rows_masks_each_row_of_a_batch(grammars: Grammars) -> None:
    obj = grammars.compile_response_format(ResponseFormat("json_object")).matcher()
    arr = grammars.compile_response_format(ResponseFormat("json_schema", schema={
        "type": "array"})).matcher()
    logits = mx.array(np.random.default_rng(0).standard_normal((3, grammars.vocab_size)),
                      dtype=mx.float16)
    out = apply_rows(logits, [obj, None, arr])
    assert out.dtype == mx.float16
    for row, m in ((0, obj), (2, arr)):
        assert mx.array_equal(out[row], m.apply(logits[row])).item()
    assert mx.array_equal(out[1], logits[1]).item()
    first = {grammars.tok.decode([int(i)], skip_special_tokens=False)[:1]
             for i in np.flatnonzero(np.isfinite(np.array(out[2].astype(mx.float32))))}
    assert first == {"["}


# -- gpt-oss's Harmony --------------------------------------------------------------------------

HARMONY_CALL = re.compile(r"(?:<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>assistant)?"
                          r"<\|channel\|>commentary to=functions\.(\w+) <\|constrain\|>json"
                          r"<\|message\|>(.*)", re.S)


@pytest.fixture(scope="module")
def harmony() -> Grammars:
    from tests.chat.templates import make_chat_tokenizer
    tok = make_chat_tokenizer("gpt_oss")
    g = Grammars(tok, tok.vocab_size + EXTRA)
    _bonus(g)[tok.hf.get_vocab()["<|end|>"]] = 6.0  # the random walk's analysis ends soon
    return g


@pytest.mark.parametrize("choice", [ToolChoice("required"), ToolChoice("function", "TodoWrite")])
def test_harmony_forced_call_is_one_call_in_the_models_own_shape(harmony: Grammars,
                                                                 choice: ToolChoice) -> None:
    """An optional analysis, then one call with arguments that fit, ending where <|call|> (an
    end token) is the only thing allowed; what the parser reads back is that call."""
    from mlx_kvserver.chat.harmony import HarmonyParser

    ts = tools()
    params = {t.name: t.parameters for t in ts}
    analysed = 0
    for seed in range(4):
        text = walk(harmony, harmony.compile_harmony_call(ts, choice), seed)
        m = HARMONY_CALL.fullmatch(text)
        assert m, text
        name, args = m.group(1), json.loads(m.group(2))
        assert name == (choice.name or name) and name in params
        validate(args, params[name])
        analysed += text.startswith("<|channel|>analysis")
        p = HarmonyParser(0, ts)
        p.feed(text)
        p.finish()
        assert [(c.name, json.loads(c.arguments), c.problem) for c in p.tool_calls] == \
            [(name, args, None)]
    assert 0 < analysed < 4  # both ways were taken
    assert harmony.compile_harmony_call(ts, choice) is harmony.compile_harmony_call(ts, choice)


def test_harmony_grammar_takes_the_special_tokens(harmony: Grammars) -> None:
    ts = [Tool("f", parameters={"type": "object", "properties": {"a": {"type": "boolean"}},
                                "required": ["a"], "additionalProperties": False})]
    vocab = harmony.tok.hf.get_vocab()
    m = harmony.compile_harmony_call(ts, ToolChoice("required")).matcher()
    assert np.flatnonzero(m.mask()).tolist() == [vocab["<|channel|>"]]
    for t in harmony.tok.encode("<|channel|>analysis<|message|>a < b<|end|>"):
        m.advance(t)
    assert np.flatnonzero(m.mask()).tolist() == [vocab["<|start|>"]]
    for t in harmony.tok.encode("<|start|>assistant<|channel|>commentary to=functions.f "
                                '<|constrain|>json<|message|>{"a": true}'):
        m.advance(t)
    assert m.finished and m.accepting
    assert np.flatnonzero(m.mask()).tolist() == sorted(harmony.eos_ids)  # <|call|> among them
    m.advance(vocab["<|call|>"])


def test_harmony_json_answer_is_the_final_message(harmony: Grammars) -> None:
    """response_format for gpt-oss: its header and an optional analysis, then the JSON as the
    final message, which the parser reads as the answer."""
    from mlx_kvserver.chat.harmony import HarmonyParser

    schema = SCHEMAS["nested"]
    grammar = harmony.compile_response_format(ResponseFormat("json_schema", schema=schema),
                                              harmony=True)
    assert grammar is not harmony.compile_response_format(ResponseFormat("json_schema",
                                                                         schema=schema))
    for seed in range(3):
        text = walk(harmony, grammar, seed)
        assert re.fullmatch(r"(<\|channel\|>analysis<\|message\|>.*?<\|end\|><\|start\|>"
                            r"assistant)?<\|channel\|>final<\|message\|>\{.*\}", text, re.S), text
        p = HarmonyParser(0, [])
        p.feed(text)
        p.finish()
        validate(json.loads(p.text), schema)
