"""A request's prompt as token ids, in vLLM's shapes, for a router that scores servers by the KV
pages they hold: vLLM's router (``vllm-router``, its ``kv_aware`` policy) asks each server for a
request's token ids, cuts them in pages and looks those up among the pages each server announced
(``--kv-events``; docs/ROUTING.md). Thin by design: every id list is the engine's own prompt
(``engine/request.py``'s ``Prompt``), the body read as the generating route reads it.

- ``POST /v1/chat/completions/render``, ``/v1/completions/render``, ``/v1/responses/render``:
  the body the generating route takes; ``{"request_id", "model", "token_ids", "features"}``
  (vLLM's ``GenerateRequest``, without its sampling parameters). Nothing is generated or cached.
- ``POST /tokenize``: vLLM's ``TokenizeRequest``: ``messages`` (a chat's, with its other fields)
  or ``prompt`` (a completion's); ``{"count", "max_model_len", "tokens", "token_strs"}``.
- ``POST /detokenize``: ``{"tokens": [ids]}`` -> ``{"prompt": text}``.
"""

from __future__ import annotations

import uuid

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from ..chat.conversation import Conversation
from ..errors import RequestError, bad_request
from . import completions, openai_chat, responses
from .http import read_object
from .images import has_images, refuse_unless_taken
from .validate import boolean, integer, model_name


def prompt_ids(lm, conv: Conversation) -> list[int]:
    """The prompt's token ids as the engine runs them (a text chat rendered and encoded without
    the rest of the engine's checks; with images or a completion's prompt, the engine's
    ``Prompt``: each image's placeholder expanded to its tokens)."""
    from ..chat.render import encode
    from ..chat.support import chat_support

    if conv.prompt is not None or has_images(conv):
        from ..engine.request import Prompt

        return list(Prompt.of(conv, lm).tokens)
    return encode(lm.tokenizer, chat_support(lm).format, conv)[0]


async def prompt_of(served, request: Request, conv: Conversation):
    """``(model, token ids)`` of ``conv``: its images read, its model resolved, the volatile-line
    rules applied, as the generating route does before it submits it."""
    await served.read_images(request, conv)
    lm = await served.resolve_model(request, conv.model)
    refuse_unless_taken(conv, lm, served.registry)
    conv, _ = served.normalizer.apply(conv)
    return lm, await run_in_threadpool(prompt_ids, lm, conv)


def _render(parse, param: str = "messages"):
    async def handler(served, request: Request) -> Response:
        body = await read_object(request, served.config.max_body_bytes)
        try:
            lm, ids = await prompt_of(served, request, parse(served, body))
        except RequestError as e:
            if e.param == "messages":  # the engine's name for the conversation
                e.param = param
            raise
        return JSONResponse({"request_id": f"render-{uuid.uuid4().hex}", "model": lm.name,
                             "token_ids": ids, "features": None})
    return handler


def _chat(served, body: dict) -> Conversation:
    openai_chat.include_usage(body)  # checked, as the generating route checks it
    return openai_chat.parse(body, served.config)


def _completion(served, body: dict) -> Conversation:
    openai_chat.include_usage(body)
    return completions.parse(body, served.config)


render_chat = _render(_chat)
render_completion = _render(_completion, "prompt")
render_response = _render(responses.conversation, "input")


async def tokenize(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    if body.get("messages") is not None:
        if not boolean(body, "add_generation_prompt", True):
            raise bad_request("'add_generation_prompt': false is not supported (the prompt "
                              "always ends with the generation prompt)", "add_generation_prompt")
        conv = _chat(served, body)
    else:
        conv = _completion(served, body)
    lm, ids = await prompt_of(served, request, conv)
    return JSONResponse({"count": len(ids), "max_model_len": lm.context_length, "tokens": ids,
                         "token_strs": None})


async def detokenize(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    raw = body.get("tokens")
    ids = [integer(t) for t in raw] if isinstance(raw, list) else [None]
    if None in ids:
        raise bad_request("'tokens' must be a list of token ids", "tokens")
    lm = await served.resolve_model(request, model_name(body))
    from ..chat.support import chat_support

    vocab = chat_support(lm).vocab_size
    if any(not 0 <= t < vocab for t in ids):  # type: ignore[operator]
        raise bad_request(f"'tokens' has ids outside this model's vocabulary (0..{vocab - 1})",
                          "tokens")
    return JSONResponse({"prompt": await run_in_threadpool(lm.tokenizer.decode, ids)})


def tokenize_routes(served, guarded) -> list[Route]:
    """The routes, each wrapped by the app's ``guarded`` (the API key when the server has one)."""
    def route(path: str, handler) -> Route:
        return Route(path, guarded(lambda request: handler(served, request)), methods=["POST"])
    return [route("/v1/chat/completions/render", render_chat),
            route("/v1/completions/render", render_completion),
            route("/v1/responses/render", render_response),
            route("/tokenize", tokenize), route("/detokenize", detokenize)]
