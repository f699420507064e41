"""Who may talk to the server: the API key (``Authorization: Bearer`` or Anthropic's
``x-api-key``), the Host header (DNS rebinding) and the Origin header (cross-site pages)."""

from __future__ import annotations

import hmac

from starlette.requests import Request

from ..config import ServerConfig
from ..errors import RequestError


from .http import error_responder


def check_api_key(request: Request, api_key: str | None) -> None:
    if not api_key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer":
        token = request.headers.get("x-api-key", "")  # Anthropic's clients send the key here
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        raise RequestError(401, "a valid API key is required (Authorization: Bearer <key> or "
                           "x-api-key: <key>)", type="authentication_error",
                           code="invalid_api_key")


# -- exposure: Host and Origin checks -----------------------------------------------------------

LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")


def host_name(value: str) -> str | None:
    """The name in a Host header value (``name``, ``name:port``, ``[v6]``, ``[v6]:port``),
    lower-cased; None when the value is malformed."""
    v = value.strip().lower()
    if v.startswith("["):
        end = v.find("]")
        name, rest = v[1:end], v[end + 1:]
        if end < 0 or rest and not (rest.startswith(":") and rest[1:].isdigit()):
            return None
    else:
        name, sep, port = v.partition(":")
        if sep and not port.isdigit():
            return None
    name = name.removesuffix(".")
    return name or None


def allowed_hosts(config: ServerConfig) -> frozenset[str] | None:
    """Names a Host header may carry: loopback names, ``--host`` and ``--allowed-host``;
    None when ``--allowed-host '*'`` turns the check off."""
    extra = list(config.allowed_hosts)
    if "*" in extra:
        return None
    names = {*LOCAL_NAMES, config.host, *extra}
    return frozenset(n.strip().lower().removeprefix("[").removesuffix("]").removesuffix(".")
                     for n in names if n)


class RequestGuard:
    """ASGI middleware run before anything else: refuses (403, JSON) a request whose Host header
    names another server (a DNS-rebinding page reaching a loopback server under its own name) or
    that a browser sent from an origin not given with ``--cors-origin`` (a cross-site page's
    "simple" POST needs no CORS preflight, so CORS alone would not stop it from acting).

    The server's own page is same-origin: a browser sends ``Origin: http://<Host>`` with its
    POSTs and DELETEs. That origin is accepted while the Host check is on (the Host was one of
    the server's own names, so the page was served by this server under that name)."""

    def __init__(self, app, hosts: frozenset[str] | None, origins: frozenset[str]):
        self.app, self.hosts, self.origins = app, hosts, origins

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            error = self.refusal(scope)
            if error is not None:
                await error_responder(scope.get("path", ""))(error)(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def refusal(self, scope) -> RequestError | None:
        hosts = [v for k, v in scope.get("headers", ()) if k == b"host"]
        if self.hosts is not None:
            name = host_name(hosts[0].decode("latin-1")) if len(hosts) == 1 else None
            if name not in self.hosts:
                return RequestError(403, "this server answers only to its own names in the Host "
                                    "header (add more with --allowed-host)",
                                    type="permission_error", code="host_not_allowed")
        origins = [v for k, v in scope.get("headers", ()) if k == b"origin"]
        own = {f"{s}://{hosts[0].decode('latin-1').strip().lower()}" for s in ("http", "https")} \
            if self.hosts is not None and len(hosts) == 1 else set()
        if origins and "*" not in self.origins and any(
                o.decode("latin-1") not in self.origins | own for o in origins):
            return RequestError(403, "requests from this origin are not allowed (see "
                                "--cors-origin)", type="permission_error",
                                code="origin_not_allowed")
        return None
