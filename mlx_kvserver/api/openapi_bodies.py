"""The request bodies of the generating APIs as JSON Schema, for the OpenAPI description
(``openapi.py``): what each API's parser requires, taken from the parsers' own constants.

A body these schemas call valid is one the parsers accept, and one they call invalid the parsers
refuse (a 400), apart from the rules JSON Schema cannot state, which the descriptions say in
words: a tool result answers a call made earlier in the history and not answered yet; call ids
are unique; the history does not end with an unanswered call; ``tool_choice`` names one of
``tools``, whose names are unique; a tool's parameters (a response format's schema) are valid JSON
Schema; a completion's token ids are below the model's vocabulary size; the prompt fits the
model's context; the model is one the server serves; an image goes to a model that takes images,
its data is a whole image file of a format taken within the pixel limit, and a request has at
most ``--max-images`` images. An optional field may be null, which is an
absent one; no other value (``false``, ``0``, ``""``, ``[]``) is taken for absent. ``7.0`` is an
integer, as to JSON Schema. tests/test_fuzz_api.py puts a value of each JSON type in every field
of bodies drawn from these schemas; tests/api/test_openapi.py runs schemathesis against them.
"""

from __future__ import annotations

from ..chat.images import FORMATS, MAX_IMAGE_PIXELS, MEDIA_TYPES
from .anthropic import ROLES as ANTHROPIC_ROLES
from .completions import MAX_PROMPT_IDS
from .images import URL_FLAG
from .openai_chat import DETAILS, EFFORTS
from .responses import INPUT_ROLES, MAX_NAMESPACE, MAX_NAMESPACED, SUMMARIES, TEXT_PARTS
from .validate import MAX_STOP, MAX_TOOLS, NEUTRAL, RANGES, ROLES, TOOL_NAME

TEXT = {"type": "string"}
WORD = {"type": "string", "minLength": 1}
OBJECT = {"type": "object"}
BOOL = {"type": ["boolean", "null"]}
JSON_SCHEMA = {"type": "object", "description": "a JSON Schema (Draft 2020-12)"}
NAME = {"type": "string", "pattern": TOOL_NAME.pattern}
HISTORY = ("a tool result must answer a call made earlier in the history and not answered yet; "
           "call ids are unique; the history must not end with an unanswered call")
TOOLS = "tool names are unique; each parameters schema is valid JSON Schema"
CHOICE = "a named tool is one of the tools"


def _or_null(schema: dict) -> dict:
    """``schema`` or null: the server takes a null optional field as an absent one."""
    if isinstance(schema.get("type"), str):
        return {**schema, "type": [schema["type"], "null"]}
    return {"anyOf": [schema, {"type": "null"}]}


def _number(name: str, **bounds) -> dict:
    lo, hi, integer = RANGES[name]
    return {"type": "integer" if integer else "number", "minimum": lo, "maximum": hi, **bounds}


def _obj(required: list[str], note: str | None = None, /, **properties) -> dict:
    """An object with ``properties``, of which ``required``; ``note``: its description."""
    out = {"type": "object", "required": required, "properties": properties}
    return {**out, "description": note} if note else out


def _asks_with_tools(asks_none: dict, offered: dict) -> dict:
    """A ``tool_choice`` that asks for a tool call only with ``tools`` that offer one: either
    it asks for none (``asks_none``: its values that do not ask for a call, or it is absent), or
    ``tools`` holds ``offered``."""
    return {"anyOf": [{"properties": {"tool_choice": asks_none}},
                      {"required": ["tools"], "properties": {"tools": offered}}]}


def _text_or(parts: dict) -> dict:
    return {"oneOf": [TEXT, {"type": "array", "items": parts}]}


def model_field(models: list[str] | None, required: bool = False) -> dict:
    schema = {"type": ["string", "integer"] if required else ["string", "integer", "null"],
              "description": "a served model's name, its index, or \"default\" (the first "
                             "one, as when omitted); another name is a 404"}
    return {**schema, "examples": models} if models else schema


STOP = _or_null({"oneOf": [WORD, {"type": "array", "maxItems": MAX_STOP, "items": WORD}]})
SAMPLING = {"max_tokens": _or_null(_number("max_tokens")),
            "temperature": _or_null(_number("temperature")),
            "top_p": _or_null(_number("top_p")), "top_k": _or_null(_number("top_k")),
            "seed": _or_null({"type": "integer", "minimum": 0, "maximum": 2**63 - 1}),
            "stop": STOP, **{name: _or_null({
                "type": "integer" if name == "priority" else "number", "minimum": value,
                "maximum": value, "description": "not implemented: only the value that changes "
                                                 "nothing"}) for name, value in NEUTRAL.items()}}
COMMON = {"stream": BOOL, "use_kv_cache": {"type": ["boolean", "null"], "default": True},
          "speculate": {"type": ["boolean", "null"], "default": True,
                        "description": "drafts verified in the batch (never changes the answer)"}}
PREDICTION = {"type": ["object", "null"], "required": ["type", "content"],
              "properties": {"type": {"const": "content"},
                             "content": {"oneOf": [{"type": "string"}, {
                                 "type": "array", "items": {
                                     "type": "object", "required": ["type", "text"],
                                     "properties": {"type": {"const": "text"},
                                                    "text": {"type": "string"}}}}]}},
              "description": "the answer as you expect it (OpenAI's Predicted Outputs): a draft"}
NOT_EMPTY = {"type": "array", "minItems": 1}
STREAM_OPTIONS = _or_null({"type": "object", "properties": {"include_usage": BOOL}})
MESSAGE_ID = _or_null({"$ref": "#/components/schemas/MessageId"})


def images_rule(max_images: int) -> str:
    """The rules on images the schemas cannot state."""
    return (f"an image goes only to a model that takes images (capabilities.vision in /v1/models; "
            f"any other answers 400 images_not_supported); its data is a whole "
            f"{', '.join(FORMATS)} file of at most {MAX_IMAGE_PIXELS:,} pixels; at most "
            f"{max_images} images in a request (--max-images)")


# A data URL of an image file, as api/images.py reads it (the file's bytes in base64); the
# example is a 32 x 32 red PNG.
BASE64 = "[A-Za-z0-9+/=\\s]*$"
PNG_BASE64 = ("iVBORw0KGgoAAAANSUhEUgAAACAAAAAgCAIAAAD8GO2jAAAAKklEQVR42u3NMQEAAAQAMATRP4pYSvBtBZbTHZ8q"
              "ngkEAoFAIBAIBIIrC+AFAUQz669uAAAAAElFTkSuQmCC")
DATA_URL = {"type": "string", "pattern": "^data:(image/(png|jpeg|webp|gif))?(;[^;,]*)*;base64,"
            + BASE64, "description": "a data URL of the image file ('data:image/png;base64,...')",
            "examples": ["data:image/png;base64," + PNG_BASE64]}
HTTP_URL = {"type": "string", "pattern": "^[hH][tT][tT][pP][sS]?://",
            "description": "an http(s) URL, fetched by the server (never from its own machine)",
            "examples": ["https://example.com/picture.png"]}


def image_url(urls: bool) -> dict:
    """An image's URL: a data URL, or also an http(s) one where the server fetches them
    (``--allow-image-urls``)."""
    if urls:
        return {"oneOf": [DATA_URL, HTTP_URL]}
    return {**DATA_URL, "description": DATA_URL["description"] + f"; http(s) URLs are fetched "
            f"only by a server started with {URL_FLAG}"}


DETAIL = _or_null({"enum": list(DETAILS), "description": "taken, not used: the model reads the "
                   "image at its processor's size"})


# -- /v1/chat/completions -----------------------------------------------------------------------

CHAT_TEXT = _obj(["type", "text"], type={"const": "text"}, text=TEXT)
CHAT_CONTENT = {"oneOf": [TEXT, {"type": "null"}, {"type": "array", "items": CHAT_TEXT}]}


def chat_image(urls: bool) -> dict:
    return _obj(["type", "image_url"], type={"const": "image_url"}, image_url={"oneOf": [
        image_url(urls), _obj(["url"], url=image_url(urls), detail=DETAIL)]})


def chat_content(urls: bool) -> dict:
    """A user's or a tool's content: text, or text and image parts."""
    return {"oneOf": [*CHAT_CONTENT["oneOf"][:2], {"type": "array", "items": {
        "oneOf": [CHAT_TEXT, chat_image(urls)]}}]}


CHAT_CALL = _obj(["id", "function"], id=WORD, function=_obj(
    ["name"], name=WORD, arguments={"oneOf": [TEXT, OBJECT], "default": "{}"}))


def chat_message(urls: bool) -> dict:
    return {"oneOf": [
        _obj(["role"], role={"enum": [r for r in ROLES if r not in ("assistant", "tool", "user")]},
             content=CHAT_CONTENT, message_id=MESSAGE_ID),
        _obj(["role"], role={"const": "user"}, content=chat_content(urls),
             message_id=MESSAGE_ID),
        _obj(["role"], role={"const": "assistant"}, content=CHAT_CONTENT, message_id=MESSAGE_ID,
             reasoning_content=_or_null(TEXT), reasoning=_or_null(TEXT),
             tool_calls=_or_null({"type": "array", "items": CHAT_CALL})),
        _obj(["role", "tool_call_id"], "the result of the call tool_call_id names", role={
            "const": "tool"}, tool_call_id=WORD, content=chat_content(urls),
            message_id=MESSAGE_ID)]}

CHAT_TOOL = _obj(["function"], type={"const": "function"}, function=_obj(
    ["name"], name=NAME, description=_or_null(TEXT), parameters=_or_null(JSON_SCHEMA),
    strict=BOOL))
CHAT_CHOICE = _or_null({"oneOf": [{"enum": ["auto", "none", "required"]}, _obj(
    ["type", "function"], type={"const": "function"}, function=_obj(["name"], name=WORD))],
    "description": CHOICE})
FORMAT = {"oneOf": [_obj(["type"], type={"enum": ["text", "json_object"]}),
                    _obj(["type", "json_schema"], type={"const": "json_schema"},
                         json_schema=_obj(["schema"], schema=JSON_SCHEMA, name=_or_null(TEXT),
                                          strict=BOOL))]}


def chat(models: list[str] | None, urls: bool, max_images: int) -> dict:
    return {**_asks_with_tools({"enum": ["auto", "none", None]}, NOT_EMPTY), **_obj(
        ["messages"], f"{HISTORY}; {TOOLS}; {images_rule(max_images)}",
        messages={"type": "array", "minItems": 1, "items": chat_message(urls),
                  "description": "a last assistant message is continued"},
        model=model_field(models), **SAMPLING,
        **{n: _or_null(_number(n)) for n in ("max_completion_tokens", "n", "top_logprobs")},
        stream_options=STREAM_OPTIONS, **COMMON,
        tools=_or_null({"type": "array", "maxItems": MAX_TOOLS, "items": CHAT_TOOL}),
        tool_choice=CHAT_CHOICE, parallel_tool_calls=BOOL, response_format=_or_null(FORMAT),
        reasoning_effort=_or_null({"enum": list(EFFORTS)}), logprobs=BOOL,
        chat_template_kwargs=_or_null(OBJECT), prediction=PREDICTION,
        continue_final_message={**BOOL, "description": "true only after a last assistant "
                                "message without tool calls"})}


# -- /v1/completions ----------------------------------------------------------------------------

IDS = {"type": "array", "minItems": 1, "maxItems": MAX_PROMPT_IDS,
       "items": {"type": "integer", "minimum": 0},
       "description": "token ids, each below the model's vocabulary size"}


def completions(models: list[str] | None) -> dict:
    one = {"oneOf": [WORD, IDS]}
    return _obj(
        ["prompt"], prompt={"oneOf": [WORD, IDS, {"type": "array", "minItems": 1,
                                                  "maxItems": 1, "items": one}]},
        model=model_field(models), **SAMPLING, n=_or_null(_number("n")),
        logprobs=_or_null({"type": "integer", "minimum": 0, "maximum": 5}),
        echo=BOOL, suffix={"type": "null", "description": "not supported"},
        stream_options=STREAM_OPTIONS, **COMMON)


# -- /v1/messages and /v1/messages/count_tokens -------------------------------------------------

A_TEXT = _obj(["type", "text"], type={"const": "text"}, text=TEXT)
A_TEXTS = _text_or(A_TEXT)


def a_image(urls: bool) -> dict:
    """An ``image`` block: the file in base64, or its URL."""
    return _obj(["type", "source"], type={"const": "image"}, source={"oneOf": [
        _obj(["type", "media_type", "data"], type={"const": "base64"},
             media_type={"enum": list(MEDIA_TYPES)},
             data={"type": "string", "pattern": "^" + BASE64,
                   "description": "the image file in base64", "examples": [PNG_BASE64]}),
        _obj(["type", "url"], type={"const": "url"}, url=image_url(urls))]})


def a_user(urls: bool) -> dict:
    return {"oneOf": [A_TEXT, a_image(urls), _obj(
        ["type", "tool_use_id"], type={"const": "tool_result"}, tool_use_id=WORD,
        content=_or_null(_text_or({"oneOf": [A_TEXT, a_image(urls)]})), is_error=BOOL)]}


A_ASSISTANT = {"oneOf": [
    A_TEXT, _obj(["type", "thinking"], type={"const": "thinking"}, thinking=TEXT),
    _obj(["type"], type={"const": "redacted_thinking"}),
    _obj(["type", "id", "name"], type={"const": "tool_use"}, id=WORD, name=WORD, input=OBJECT)]}


def a_message(urls: bool) -> dict:
    return {"oneOf": [
        _obj(["role", "content"], role={"const": role}, content=_text_or(blocks),
             message_id=MESSAGE_ID)
        for role, blocks in zip(ANTHROPIC_ROLES, (a_user(urls), A_ASSISTANT, A_TEXT))]}


A_TOOL = _obj(["name", "input_schema"], type=_or_null({"const": "custom"}), name=NAME,
              description=_or_null(TEXT), input_schema=_or_null(JSON_SCHEMA), strict=BOOL)
A_CHOICE = _or_null({"oneOf": [
    _obj(["type"], type={"enum": ["auto", "any", "none"]}, disable_parallel_tool_use=BOOL),
    _obj(["type", "name"], type={"const": "tool"}, name=WORD, disable_parallel_tool_use=BOOL)],
    "description": CHOICE})
A_FORMAT = _or_null(_obj(["type", "schema"], type={"const": "json_schema"}, schema=JSON_SCHEMA))


def messages(models: list[str] | None, urls: bool, max_images: int,
             count_only: bool = False) -> dict:
    asks_none = {"anyOf": [{"type": "null"}, {"properties": {"type": {"enum": ["auto", "none"]}}}]}
    return {**_asks_with_tools(asks_none, NOT_EMPTY), **_obj(
        ["model", "messages"] + ([] if count_only else ["max_tokens"]),
        f"{HISTORY}; {TOOLS}; {images_rule(max_images)}",
        model=model_field(models, required=True),
        **({} if count_only else {"max_tokens": _number("max_tokens")}),
        messages={"type": "array", "minItems": 1, "items": a_message(urls),
                  "description": "a last assistant message is continued (a prefill)"},
        system=_or_null(A_TEXTS), temperature=_or_null(_number("temperature", maximum=1.0)),
        top_p=_or_null(_number("top_p")), top_k=_or_null(_number("top_k")),
        stop_sequences=STOP, **COMMON,
        tools=_or_null({"type": "array", "maxItems": MAX_TOOLS, "items": A_TOOL}),
        tool_choice=A_CHOICE, metadata=_or_null(OBJECT),
        mcp_servers={"type": ["array", "null"], "maxItems": 0,
                     "description": "MCP connectors are not served"},
        thinking=_or_null({"oneOf": [
            _obj(["type"], type={"const": "enabled"},
                 budget_tokens=_or_null({"type": "integer", "minimum": 0})),
            _obj(["type"], type={"enum": ["disabled", "adaptive"]})]}),
        output_config=_or_null({"type": "object", "properties": {
            "effort": _or_null(TEXT), "format": A_FORMAT}}),
        output_format={**A_FORMAT, "description": "the older beta's output_config.format"})}


# -- /v1/responses ------------------------------------------------------------------------------

R_PART = _obj(["type", "text"], type={"enum": list(TEXT_PARTS)}, text=TEXT)
R_TEXT = _text_or(R_PART)


def r_image(urls: bool) -> dict:
    return _obj(["type", "image_url"], "a file_id is not taken (this server has no Files API)",
                type={"const": "input_image"}, image_url=image_url(urls), detail=DETAIL)


def r_items(urls: bool) -> list[dict]:
    with_images = _text_or({"oneOf": [R_PART, r_image(urls)]})
    return [
        _obj(["role", "content"], type={"const": "message"},
             role={"enum": [r for r in INPUT_ROLES if r != "user"]}, content=R_TEXT),
        _obj(["role", "content"], type={"const": "message"}, role={"const": "user"},
             content=with_images),
        _obj(["type"], "its content's text, else its summary's", type={"const": "reasoning"},
             content=_or_null(R_TEXT), summary=_or_null({"type": "array", "items": R_PART})),
        _obj(["type", "call_id", "name"], type={"const": "function_call"}, call_id=WORD,
             name=WORD, namespace=_or_null(WORD), arguments={"oneOf": [TEXT, OBJECT]}),
        _obj(["type", "call_id", "output"], type={"const": "function_call_output"},
             call_id=WORD, output=with_images)]


# At least one item becomes a message: empty assistant messages and reasoning do not.
R_COUNTS = {"anyOf": [
    _obj(["role"], type={"const": "message"},
         role={"enum": [r for r in INPUT_ROLES if r != "assistant"]}),
    _obj(["type"], type={"enum": ["function_call", "function_call_output"]}),
    _obj(["role", "content"], type={"const": "message"}, role={"const": "assistant"},
         content={"anyOf": [WORD, {"type": "array", "contains": _obj(["text"], text=WORD)}]})]}
R_FUNCTION = _obj(["type", "name"], type={"const": "function"}, name=NAME,
                  description=_or_null(TEXT), parameters=_or_null(JSON_SCHEMA), strict=BOOL)
R_NAMESPACED = {**R_FUNCTION, "required": ["name"], "properties": {
    **R_FUNCTION["properties"], "name": {**NAME, "maxLength": MAX_NAMESPACED}}}
# A namespace's functions are offered as "<namespace>.<name>": the two fit one tool name.
R_NAMESPACE = _obj(["type", "name", "tools"], type={"const": "namespace"},
                   name={**NAME, "maxLength": MAX_NAMESPACE},
                   tools={"type": "array", "items": {"oneOf": [
                       R_NAMESPACED, _obj(["type"], type={"const": "custom"})]}})
# Tools that offer the model a function: a function tool, or a namespace with one.
R_OFFERED = {"type": "array", "contains": {"oneOf": [
    {"required": ["type"], "properties": {"type": {"const": "function"}}},
    {"required": ["type"], "properties": {"type": {"const": "namespace"},
                                          "tools": {"contains": R_NAMESPACED}}}]}}
R_HOSTED = _obj(["type"], "a hosted tool: accepted, not offered to the model", type={
    "type": "string", "not": {"enum": ["function", "namespace"]},
    "examples": ["web_search", "file_search", "code_interpreter", "custom"]})
R_CHOICE = _or_null({"oneOf": [{"enum": ["auto", "none", "required"]}, _obj(
    ["type", "name"], type={"const": "function"}, name=WORD, namespace=_or_null(WORD))],
    "description": CHOICE})


def responses(models: list[str] | None, urls: bool, max_images: int) -> dict:
    sampling = {k: v for k, v in SAMPLING.items() if k != "max_tokens"}
    # The history is not empty: input has an item that becomes a message, or instructions or
    # a previous response come before it.
    history = {"anyOf": [
        {"properties": {"input": {"anyOf": [WORD, {"type": "array", "contains": R_COUNTS}]}}},
        {"required": ["instructions"], "properties": {"instructions": WORD}},
        {"required": ["previous_response_id"],
         "properties": {"previous_response_id": {"type": "string"}}}]}
    asks = _asks_with_tools({"enum": ["auto", "none", None]}, R_OFFERED)
    return {"allOf": [history, asks], **_obj(
        ["input"], f"{HISTORY}; {TOOLS}; {images_rule(max_images)}",
        input={"oneOf": [WORD, {"type": "array", "minItems": 1,
                                "items": {"oneOf": r_items(urls)}}]},
        model=model_field(models), instructions=_or_null(TEXT),
        previous_response_id={**MESSAGE_ID, "description": "a stored response (else a 404); "
                              "its history comes before input"},
        max_output_tokens=_or_null(_number("max_tokens")), **sampling, **COMMON,
        tools=_or_null({"type": "array", "items": {"oneOf": [R_FUNCTION, R_NAMESPACE,
                                                             R_HOSTED]}}),
        tool_choice=R_CHOICE, parallel_tool_calls=BOOL, store=BOOL,
        include=_or_null({"type": "array", "items": TEXT}),
        top_logprobs=_or_null(_number("top_logprobs")), metadata=_or_null(OBJECT),
        chat_template_kwargs=_or_null(OBJECT),
        text=_or_null({"type": "object", "properties": {"format": _or_null(
            {"oneOf": [*FORMAT["oneOf"][:1], _obj(["type", "schema"], type={
                "const": "json_schema"}, schema=JSON_SCHEMA, name=_or_null(TEXT),
                strict=BOOL)]})}}),
        reasoning=_or_null({"type": "object", "properties": {
            "effort": _or_null({"enum": list(EFFORTS)}),
            "summary": {"enum": list(SUMMARIES)}}}),
        background={"enum": [False, None], "description": "background responses are not "
                    "supported"},
        conversation={"type": "null", "description": "not supported: use previous_response_id"})}
