"""Exposure: loopback by default, the API key on every route but /health, DNS-rebinding and
cross-site protection through the Host and Origin headers, CORS off unless origins are given."""

from __future__ import annotations

import socket
import urllib.parse

import httpx
import pytest

from mlx_kvserver import cli, flags
from mlx_kvserver.api import host_name
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.api.openapi import openapi_spec
from harness.server_utils import running_server

KEY = "s3cret-key"
HELLO = [{"role": "user", "content": "hello", "message_id": "exp-u0"}]
OPERATIONS = sorted((path, method.upper()) for path, ops in openapi_spec()["paths"].items()
                    for method in ops)
PUBLIC = {(path, method.upper()) for path, ops in openapi_spec(api_key=True)["paths"].items()
          for method, op in ops.items() if op.get("security") == []}  # /health, the chat page


# -- binding ---------------------------------------------------------------------------------------


def test_cli_binds_loopback_unless_told_otherwise(tiny_model_dir, monkeypatch):
    assert ServerConfig().host == "127.0.0.1"
    args = flags.build_parser().parse_args([])
    assert args.host == "127.0.0.1" and flags.config_from_args(args).host == "127.0.0.1"
    assert flags.config_from_args(flags.build_parser().parse_args(
        ["--host", "0.0.0.0", "--allowed-host", "box.lan"])).allowed_hosts == ["box.lan"]
    # Through main(): what uvicorn is asked to bind.
    import uvicorn

    bound = []
    monkeypatch.setenv("MLX_KVSERVER_NO_BLAS", "1")
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: bound.append(kw))
    cli.main(["--model", str(tiny_model_dir), "--no-disk-cache", "--port", "8181"])
    cli.main(["--model", str(tiny_model_dir), "--no-disk-cache", "--host", "::1"])
    assert [(b["host"], b["port"]) for b in bound] == [("127.0.0.1", 8181), ("::1", 8080)]


# -- API key ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def keyed(tiny_lm, tmp_path_factory):
    config = ServerConfig(api_key=KEY, max_tokens=3, page_size=8,
                          kv_cache_dir=tmp_path_factory.mktemp("kv"))
    with running_server([tiny_lm], config) as url:
        r = httpx.post(f"{url}/chat/completions", json={"messages": HELLO},
                       headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200
        export = httpx.get(f"{url}/kv_cache/export/exp-u0",
                           headers={"Authorization": f"Bearer {KEY}"}).content
        yield url.removesuffix("/v1"), export


BODIES = {"/v1/chat/completions": {"messages": HELLO, "max_tokens": 2},
          "/v1/completions": {"prompt": "hi", "max_tokens": 2},
          "/v1/messages": {"model": "default", "messages": HELLO, "max_tokens": 2},
          "/v1/messages/count_tokens": {"model": "default", "messages": HELLO},
          "/v1/responses": {"input": "hi", "max_output_tokens": 2}}
# the prompts as token ids, for a router (api/tokenize.py): the same bodies, nothing generated
BODIES |= {f"{path}/render": BODIES[path] for path in
           ("/v1/chat/completions", "/v1/completions", "/v1/responses")}
BODIES |= {"/tokenize": {"model": "default", "prompt": "hi"},
           "/detokenize": {"model": "default", "tokens": [1, 2]}}


def call(base: str, path: str, method: str, export: bytes, **headers) -> httpx.Response:
    if "{response_id}" in path:  # a stored response of its own (a DELETE takes it away)
        made = httpx.post(f"{base}/v1/responses", json=BODIES["/v1/responses"], timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"})
        path = path.replace("{response_id}", made.json()["id"])
    path = path.replace("{message_id}", "exp-u0").replace("{path}", "app.js")
    kw: dict = {}
    if path in BODIES:
        kw["json"] = BODIES[path]
    elif path.endswith("/import"):
        kw["content"] = export
    return httpx.request(method, base + path, headers=headers, timeout=60, **kw)


def test_only_the_health_routes_and_the_chat_page_are_public():
    assert PUBLIC == {("/health", "GET"), ("/health_generate", "GET"), ("/", "GET"),
                      ("/static/{path}", "GET")}


def test_the_description_declares_401_where_the_key_is_required(keyed):
    base, _ = keyed
    spec = httpx.get(f"{base}/openapi.json", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert spec["security"] == [{"bearer": []}]
    for path, method in OPERATIONS:
        op = spec["paths"][path][method.lower()]
        assert ("401" in op["responses"]) == ((path, method) not in PUBLIC), (path, method)
    assert all(spec["paths"][path][method.lower()]["security"] == [] for path, method in PUBLIC)
    # Without a key nothing answers 401, and the description says so.
    open_spec = openapi_spec()
    assert "security" not in open_spec
    assert not any("401" in op["responses"] for ops in open_spec["paths"].values()
                   for op in ops.values())


@pytest.mark.parametrize("path,method", OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_every_route_but_health_requires_the_api_key(keyed, path, method):
    base, export = keyed
    if (path, method) in PUBLIC:
        assert call(base, path, method, export).status_code == 200
        return
    for auth in (None, "Bearer wrong", f"Basic {KEY}", f"Bearer {KEY}x", "Bearer", KEY):
        headers = {} if auth is None else {"Authorization": auth}
        r = call(base, path, method, export, **headers)
        assert r.status_code == 401, (auth, r.text)
        if path.startswith("/v1/messages"):  # Anthropic's error shape
            assert r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json()["error"]["code"] == "invalid_api_key"
    if method == "DELETE":  # delete a copy, so the other routes still find the entry
        httpx.post(f"{base}/v1/kv_cache/import?message_id=exp-copy", content=export,
                   headers={"Authorization": f"Bearer {KEY}"}, timeout=60).raise_for_status()
        path = path.replace("{message_id}", "exp-copy")
    r = call(base, path, method, export, Authorization=f"Bearer {KEY}")
    assert r.status_code == 200, r.text


def test_anthropic_clients_send_the_key_as_x_api_key(keyed):
    base, _ = keyed
    body = BODIES["/v1/messages"]
    ok = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert ok.status_code == 200, ok.text
    wrong = httpx.post(f"{base}/v1/messages", json=body, headers={"x-api-key": KEY + "x"})
    assert wrong.status_code == 401 and wrong.json()["type"] == "error"


# -- Host header (DNS rebinding) -------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(tiny_lm):
    with running_server([tiny_lm], ServerConfig(max_tokens=2)) as url:
        yield url.removesuffix("/v1")


ALLOWED = ["localhost", "localhost:8080", "LOCALHOST:1", "127.0.0.1", "127.0.0.1:9", "[::1]",
           "[::1]:8080", "localhost."]
REFUSED = ["evil.example", "evil.example:8080", "127.0.0.1.evil.example", "localhost.evil",
           "127.0.0.2", "0.0.0.0", "[::2]:80", "[::1", "localhost:http", "::1", "",
           "user@localhost", "localhost:8080:1", "10.0.0.1"]


@pytest.mark.parametrize("path,method", OPERATIONS, ids=[f"{m} {p}" for p, m in OPERATIONS])
def test_a_foreign_host_header_is_refused_on_every_route(plain, path, method):
    r = call(plain, path, method, b"", Host="rebound.example:8080")
    assert r.status_code == 403, r.text
    if path.startswith("/v1/messages"):  # Anthropic's error shape
        assert r.json()["error"]["type"] == "permission_error"
        assert "Host header" in r.json()["error"]["message"]
    else:
        assert r.json()["error"]["code"] == "host_not_allowed"


def test_loopback_names_pass_and_others_are_refused(plain):
    for host in ALLOWED:
        r = httpx.get(f"{plain}/v1/models", headers={"Host": host})
        assert r.status_code == 200, (host, r.text)
    for host in REFUSED:
        r = httpx.get(f"{plain}/v1/models", headers={"Host": host})
        assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host


def raw_request(base: str, request: bytes) -> bytes:
    u = urllib.parse.urlsplit(base)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(request)
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return data


def test_no_host_or_two_host_headers_are_refused(plain):
    no_host = raw_request(plain, b"GET /health HTTP/1.0\r\n\r\n")
    assert no_host.startswith(b"HTTP/1.1 403") and b"host_not_allowed" in no_host
    two = raw_request(plain, b"GET /health HTTP/1.1\r\nHost: localhost\r\nHost: evil.example\r\n"
                             b"Connection: close\r\n\r\n")
    assert two.split(b" ")[1] in (b"400", b"403")  # the HTTP parser or our check refuses it


def test_host_and_allowed_hosts_flags(tiny_lm):
    config = ServerConfig(host="0.0.0.0", allowed_hosts=["box.lan", "10.1.2.3"], max_tokens=2)
    with running_server([tiny_lm], config) as url:
        for host, status in [("box.lan", 200), ("BOX.LAN:8080", 200), ("10.1.2.3:1", 200),
                             ("0.0.0.0:8080", 200), ("localhost", 200), ("other.lan", 403)]:
            assert httpx.get(f"{url}/models", headers={"Host": host}).status_code == status, host
    with running_server([tiny_lm], ServerConfig(allowed_hosts=["*"], max_tokens=2)) as url:
        assert httpx.get(f"{url}/models", headers={"Host": "any.example"}).status_code == 200


def test_host_name_parsing():
    assert host_name("Example.COM:80") == "example.com"
    assert host_name("[::1]:8080") == "::1" and host_name("[::1]") == "::1"
    for bad in ("[::1", "[::1]x", "a:b", "a:", ":80", "", "[]"):
        assert host_name(bad) is None, bad


# -- Origin and CORS -------------------------------------------------------------------------------


def preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(f"{base}/v1/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type,authorization"})


def test_cors_is_off_by_default_and_cross_site_requests_are_refused(plain):
    r = preflight(plain, "http://evil.example")
    assert "access-control-allow-origin" not in r.headers and r.status_code >= 400
    # A "simple" cross-site POST (text/plain, no preflight in a browser) must not run a job.
    before = httpx.get(f"{plain}/v1/kv_cache/stats").json()
    r = httpx.post(f"{plain}/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Content-Type": "text/plain"},
        content=b'{"messages": [{"role": "user", "content": "hi"}]}')
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in r.headers
    assert httpx.get(f"{plain}/v1/kv_cache/stats").json() == before
    for origin in ("null", "http://localhost:3000"):
        r = httpx.get(f"{plain}/v1/models", headers={"Origin": origin})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers


def test_cors_for_a_configured_origin(tiny_lm):
    app_origin = "http://app.example:3000"
    config = ServerConfig(cors_origins=[app_origin], api_key=KEY, max_tokens=2)
    with running_server([tiny_lm], config) as url:
        base = url.removesuffix("/v1")
        r = preflight(base, app_origin)  # no API key on a preflight
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == app_origin
        assert "POST" in r.headers["access-control-allow-methods"]
        r = httpx.post(f"{url}/chat/completions", json={"messages": HELLO}, headers={
            "Origin": app_origin, "Authorization": f"Bearer {KEY}"}, timeout=60)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == app_origin
        r = httpx.get(f"{url}/models", headers={"Origin": app_origin})  # still needs the key
        assert r.status_code == 401
        r = httpx.get(f"{url}/models", headers={"Origin": "http://evil.example",
                                                 "Authorization": f"Bearer {KEY}"})
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
        assert preflight(base, "http://evil.example").headers.get(
            "access-control-allow-origin") is None


def test_the_servers_own_page_is_same_origin(plain, tiny_lm):
    """A browser sends ``Origin`` with the page's POSTs and DELETEs: the server's own origin
    (scheme and the Host it was reached by) passes while the Host check is on; any other
    origin, a look-alike included, is still refused."""
    host = plain.removeprefix("http://")
    body = {"messages": HELLO, "max_tokens": 2}
    for origin in (f"http://{host}", f"https://{host}"):
        r = httpx.post(f"{plain}/v1/chat/completions", json=body, headers={"Origin": origin},
                       timeout=60)
        assert r.status_code == 200, (origin, r.text)
    port = host.rsplit(":", 1)[1]
    for origin, h in [(f"http://localhost:{port}", host), (f"http://{host}.evil", host),
                      (f"http://{host}:1", host), (f"ftp://{host}", host), ("null", host),
                      (f"http://evil.example:{port}", f"evil.example:{port}")]:
        r = httpx.post(f"{plain}/v1/chat/completions", json=body, timeout=60,
                       headers={"Origin": origin, "Host": h})
        assert r.status_code == 403, (origin, h)
    # with the Host check off, the Host proves nothing: only --cors-origin origins pass
    with running_server([tiny_lm], ServerConfig(allowed_hosts=["*"], max_tokens=2)) as url:
        own = url.removesuffix("/v1")
        r = httpx.post(f"{url}/chat/completions", json=body, headers={"Origin": own}, timeout=60)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
