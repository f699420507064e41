"""The chat page: ``GET /`` and its files under ``/static/`` (plain HTML, CSS and JavaScript
modules in ``mlx_kvserver/clients/page/``, shipped in the wheel; no build step, nothing from a
CDN). The page is a client; this module is only the HTTP side that serves its files.

The page and its files are public (a browser cannot send an API key when it opens a page; they
hold no data); everything the page fetches goes through the API and its key. The page is strict
about what it runs: a Content-Security-Policy allows only its own scripts and styles, no inline
script, no frames, and network requests to this server alone.
"""

from __future__ import annotations

from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Route
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).resolve().parent.parent / "clients" / "page"

HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; base-uri 'none'; "
                               "form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-cache",
}


async def index(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", media_type="text/html; charset=utf-8",
                        headers=HEADERS)


class StaticFilesNoSniff(StaticFiles):
    async def get_response(self, path: str, scope) -> Response:
        response = await super().get_response(path, scope)
        response.headers["X-Content-Type-Options"] = "nosniff"
        response.headers["Cache-Control"] = "no-cache"  # revalidated: a new server, new files
        return response


FILES = StaticFilesNoSniff(directory=STATIC)


async def static_file(request: Request) -> Response:
    """A file of the page: only names inside ``static/`` (StaticFiles refuses the rest)."""
    return await FILES.get_response(request.path_params["path"], request.scope)


def page_routes() -> list:
    return [Route("/", index, methods=["GET"]),
            Route("/static/{path:path}", static_file, methods=["GET"])]
