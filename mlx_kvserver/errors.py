"""The error a request can end in, whichever API it came through.

The engine and the parsers raise :class:`RequestError`; each API module turns it into its own
JSON shape (OpenAI's ``{"error": {...}}``, Anthropic's ``{"type": "error", "error": {...}}``).
``type`` is OpenAI's error type; the Anthropic module maps it to its own.
"""

from __future__ import annotations


class RequestError(Exception):
    """An error a client sees: HTTP status, message, error type, offending param, code."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status, message, type, param, code)
        self.retry_after = retry_after  # seconds, sent as Retry-After (429, 503)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> RequestError:
    return RequestError(400, message, param=param, code=code)
