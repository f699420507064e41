"""What every API module shares: reading a bounded JSON body, errors in each API's own shape,
submitting a conversation to the engine and reading its events, server-sent events."""

from __future__ import annotations

import asyncio
import json
from typing import Any, AsyncIterator, Callable

from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse

from ..chat.output import Done, Error, Event, Finish, Usage
from ..errors import RequestError, bad_request

# Anthropic's error types by HTTP status (https://docs.anthropic.com/en/api/errors)
ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                   403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                   429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                   529: "overloaded_error"}


def openai_error_body(e: RequestError) -> dict:
    return {"error": {"message": e.message, "type": e.type, "param": e.param, "code": e.code}}


def anthropic_error_body(e: RequestError) -> dict:
    kind = ANTHROPIC_TYPES.get(e.status, "invalid_request_error" if e.status < 500
                               else "api_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def is_anthropic_path(path: str) -> bool:
    return path == "/v1/messages" or path.startswith("/v1/messages/")


def error_body(e: RequestError, path: str = "") -> dict:
    """``e`` in the shape of the API that ``path`` belongs to."""
    return anthropic_error_body(e) if is_anthropic_path(path) else openai_error_body(e)


def error_responder(path: str) -> Callable[[RequestError], JSONResponse]:
    def respond(e: RequestError) -> JSONResponse:
        headers = {"Retry-After": str(int(max(1, e.retry_after)))} \
            if e.retry_after is not None else None
        return JSONResponse(error_body(e, path), status_code=e.status, headers=headers)
    return respond


def sse(data: Any, event: str | None = None) -> str:
    """One server-sent event (``event:`` line only when named, as Anthropic's stream does)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {json.dumps(data, ensure_ascii=False)}\n\n"


SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def body_chunks(request: Request, limit: int, what: str = "the request body"):
    """The body's chunks; 413 past ``limit`` bytes (declared or sent), 400 if the client leaves."""
    too_large = RequestError(413, f"{what} is larger than {limit} bytes", code="body_too_large")
    declared = request.headers.get("content-length")
    if declared is not None and (not declared.isdigit() or int(declared) > limit):
        raise too_large
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            yield chunk
    except ClientDisconnect:
        raise RequestError(400, f"the client went away while sending {what}")


async def read_json(request: Request, limit: int) -> Any:
    body = bytearray()
    async for chunk in body_chunks(request, limit):
        body.extend(chunk)
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}")
    except RecursionError:
        raise bad_request("the request body is not valid JSON: nested too deeply")


async def read_object(request: Request, limit: int) -> dict:
    body = await read_json(request, limit)
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    return body


async def first_event(request: Request, job) -> Event:
    """``job``'s first event (``Accepted`` once its prompt starts, or an ``Error``). It may
    wait long (a queue has no time limit: ``engine/backlog.py``), so a client that hangs up
    meanwhile cancels it and leaves the queue."""
    get = asyncio.ensure_future(job.events.get())
    gone = asyncio.ensure_future(_hung_up(request))
    try:
        await asyncio.wait({get, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not get.done():
            get.cancel()
    if get.done() and not get.cancelled():
        return get.result()
    job.cancel()
    raise RequestError(400, "the client went away while its request waited to start")


async def _hung_up(request: Request) -> None:
    """Returns once the client has gone (its request body was read whole before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def job_events(job, watch) -> AsyncIterator[Event]:
    """A job's events after ``Accepted`` until ``Done`` (the ``chat/output.py`` types); the job
    is cancelled when the reader stops early (a client that went away cancels its
    generation)."""
    try:
        while True:
            event = await job.events.get()
            if isinstance(event, Done):
                return
            watch.event(event)
            yield event
    finally:
        watch.close()
        job.cancel()


async def collect(job, watch, accepted) -> tuple[dict, Any]:
    """A whole answer for a body that is not streamed: ``({index: Finish}, Usage)``; raises
    the job's ``RequestError`` when it failed."""
    answers: dict = {}
    usage = Usage(accepted.prompt_tokens, 0, accepted.cached_tokens)
    async for ev in job_events(job, watch):
        if isinstance(ev, Error):
            raise ev.error
        if isinstance(ev, Finish):
            answers[ev.index] = ev
        elif isinstance(ev, Usage):
            usage = ev
    return answers, usage
