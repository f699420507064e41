"""The HTTP layer: one module per API (``openai_chat``, ``completions``, ``responses``,
``anthropic``, ``kv_routes``), each translating into the one conversation model; ``app`` holds the
route list, ``guard`` the key and Host/Origin checks, ``http`` what they share."""

from .app import build_app
from .guard import host_name

__all__ = ["build_app", "host_name"]
