"""``POST /v1/completions``: OpenAI's legacy completions. The prompt (a string, or token ids)
runs as it is, with no chat template; it is reused by token prefix like any other prompt."""

from __future__ import annotations

import uuid
from typing import AsyncIterator

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from ..chat.conversation import Conversation
from ..chat.output import Error, Finish, Start, TextDelta, Usage
from ..errors import bad_request
from .http import SSE_HEADERS, collect, job_events, openai_error_body, read_object, sse
from .openai_chat import include_usage, sampling, usage_body
from .validate import boolean, integer, model_name, number, string

MAX_PROMPT_IDS = 1 << 20


def _prompt(raw) -> str | list[int]:
    if isinstance(raw, list) and len(raw) == 1 and isinstance(raw[0], (str, list)):
        raw = raw[0]  # a batch of one prompt
    if isinstance(raw, str):
        if not raw:
            raise bad_request("'prompt' must not be empty", "prompt")
        return string(raw, "'prompt'", "prompt")
    if isinstance(raw, list) and raw and len(raw) <= MAX_PROMPT_IDS:
        # NOTE: 7.0 is an integer to JSON Schema too; the plain list is the common case
        ids = list(raw) if all(type(t) is int for t in raw) else [integer(t) for t in raw]
        if None not in ids:
            return ids  # type: ignore[return-value]
    raise bad_request("'prompt' must be a string, a list of token ids or a list of one of "
                      "those (batches of several prompts are not supported)", "prompt")


def parse(body: dict, config) -> Conversation:
    s = sampling(body, config)
    raw = body.get("logprobs")  # completions take an integer: alternatives per token, 0-5
    if raw is not None:
        top = integer(raw)
        if top is None or not 0 <= top <= 5:
            raise bad_request("'logprobs' must be an integer from 0 to 5", "logprobs")
        s.logprobs, s.top_logprobs = True, top
    if body.get("suffix") is not None:
        raise bad_request("'suffix' is not supported", "suffix")
    return Conversation(prompt=_prompt(body.get("prompt")), sampling=s, model=model_name(body),
                        n=number(body, "n", 1), stream=boolean(body, "stream", False),
                        use_kv_cache=boolean(body, "use_kv_cache", True),
                        speculate=boolean(body, "speculate", True),
                        echo=boolean(body, "echo", False))


def _logprobs(lps, offset: int) -> dict:
    tokens, values, tops, offsets = [], [], [], []
    for t in lps:
        tokens.append(t.token)
        values.append(t.logprob)
        tops.append({a: v for a, _, v in t.top} if t.top else None)
        offsets.append(offset)
        offset += len(t.token)
    return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
            "text_offset": offsets}


async def handle(served, request: Request) -> Response:
    body = await read_object(request, served.config.max_body_bytes)
    conv = parse(body, served.config)
    usage_chunk = include_usage(body)
    job_id = f"cmpl-{uuid.uuid4().hex}"
    job, accepted, watch = await served.start(request, conv, job_id=job_id)
    echo = ""
    if conv.echo:
        tok = job.lm.tokenizer
        echo = conv.prompt if isinstance(conv.prompt, str) else tok.decode(conv.prompt)

    def choice(index: int, text: str, finish: str | None, lps=None) -> dict:
        return {"index": index, "text": text, "finish_reason": finish,
                "logprobs": _logprobs(lps, 0) if lps is not None else None}

    if conv.stream:
        async def stream() -> AsyncIterator[str]:
            def chunk(choices, usage=None) -> str:
                out = {"id": job.id, "object": "text_completion", "created": job.created,
                       "model": job.lm.name, "choices": choices}
                if usage is not None:
                    out["usage"] = usage
                return sse(out)
            async for ev in job_events(job, watch):
                if isinstance(ev, Start) and echo:
                    yield chunk([choice(ev.index, echo, None)])
                elif isinstance(ev, TextDelta):
                    yield chunk([choice(ev.index, ev.text, None,
                                        ev.logprobs if conv.sampling.logprobs else None)])
                elif isinstance(ev, Finish):
                    yield chunk([choice(ev.index, "", ev.reason)])
                elif isinstance(ev, Usage) and usage_chunk:
                    yield chunk([], usage_body(ev))
                elif isinstance(ev, Error):
                    yield sse(openai_error_body(ev.error))
            yield "data: [DONE]\n\n"
        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    answers, usage = await collect(job, watch, accepted)  # an error: the guard answers it
    choices = [choice(i, echo + f.text, f.reason,
                      f.logprobs if conv.sampling.logprobs else None)
               for i, f in sorted(answers.items())]
    return JSONResponse({"id": job.id, "object": "text_completion", "created": job.created,
                         "model": job.lm.name, "choices": choices,
                         "usage": usage_body(usage)})
