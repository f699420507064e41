"""Fuzzing the HTTP API: over 1,000 generated requests on every route, none answered with a 5xx.

Requests come from hypothesis strategies shaped by the OpenAPI description the server serves
(``mlx_kvserver/api/openapi.py``): chat bodies valid or broken in one field or everywhere, raw bytes,
every described operation with hostile ``message_id``s and random methods, queries and headers,
and KV-cache imports (a real export, truncated, flipped or with a hostile header), plus one
well-formed request per described operation, so every route is reached by construction. The draws
are the same on every run (derandomized). Every answer must be a 2xx, or a 4xx with an
OpenAI-shaped JSON error, and a status the OpenAPI description declares for the operation the
request reached (404 or 405 when it reached none); a 200 stream must be well-formed SSE with no
error in it; a greedy 200 must equal the same request without the cache; a JSON body that the
served description calls valid must not be refused for its shape (tests/schema_bodies.py says
which refusals are not about it). Afterwards the server
must answer the probe conversation exactly as before, with no page held by a sequence, both
budgets kept and nothing written outside its cache directory.

And a value of the wrong type anywhere in a body (every field the description has, at every
depth, each JSON type in turn) is a 400 in the API's own shape, never a 5xx and never accepted.
"""

from __future__ import annotations

import json
import math
import random
import re
import struct
import urllib.parse
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from starlette.routing import Match

from mlx_kvserver.config import ServerConfig
from mlx_kvserver.api.openapi import openapi_spec
from mlx_kvserver.api.validate import MAX_MESSAGE_ID_LEN, MAX_STOP, RANGES, ROLES
from mlx_kvserver.api.http import is_anthropic_path
from tests.schema_bodies import (WRONG_TYPES, Document, follow_rules, has_lone_surrogate,
                                 kind_of, locations, not_about_shape, property_names, replaced)
from harness.server_utils import make_engine, running_server
from tests.test_load import assert_cache_at_rest, skip_fsync

EXAMPLES = 1400
PROBE = [{"role": "system", "content": "You are terse."},
         {"role": "user", "content": "Tell me about the sea.", "message_id": "probe-u0"}]
SPEC = openapi_spec()
OPERATIONS = sorted((path, method.upper()) for path, ops in SPEC["paths"].items()
                    for method in ops)
KNOWN_IDS = [f"fz-{i}" for i in range(8)]
HOSTILE_IDS = ["..", ".", "../x", "/etc/passwd", "a\\b", "a\u2215b", "a\uff0fb", "a\u2044b",
               "\u29f8x", "%2e%2e%2f", "C:\\x", " ", "entries/../../x", ".tmp.1.x", "pages/ab",
               "../" * 80, "x" * MAX_MESSAGE_ID_LEN]
INVALID_IDS = ["", "a\x00b", "\x7f", "k" * 10_000, "x" * (MAX_MESSAGE_ID_LEN + 1), "\ud800",
               "a\ndb"]
SMALL = {"max_tokens": 4, "max_completion_tokens": 4, "n": 2}  # keep generation quick

# -- strategies ------------------------------------------------------------------------------------

scalars = (st.none() | st.booleans() | st.integers() | st.integers(10**20, 10**300)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
junk = st.recursive(scalars, lambda c: st.lists(c, max_size=3)
                    | st.dictionaries(st.text(max_size=8), c, max_size=3), max_leaves=8)
plain_text = st.text(st.characters(exclude_categories=("Cs",)), max_size=40)
valid_ids = (st.sampled_from(KNOWN_IDS + HOSTILE_IDS)
             | st.text(st.characters(min_codepoint=32, exclude_categories=("Cs", "Cc")),
                       min_size=1, max_size=24))
any_ids = valid_ids | st.sampled_from(INVALID_IDS) | st.text(max_size=30)
contents = (plain_text | st.sampled_from(["", "word " * 2200, "sea " * 200])
            | st.lists(st.fixed_dictionaries({"type": st.just("text"), "text": plain_text}),
                       max_size=3))
bad_contents = (st.sampled_from(["\ud800", "a\udfffb", 5, [{"type": "image_url"}], [1], {}])
                | junk.filter(lambda v: v is not None and not isinstance(v, str)))


def number_field(name: str):
    lo, hi, integer = RANGES[name]
    top = SMALL.get(name, hi)
    if integer:
        valid = st.integers(lo, top) | st.just(float(lo))
        invalid = (st.integers(max_value=lo - 1) | st.integers(min_value=hi + 1)
                   | st.floats(lo, hi).filter(lambda v: not v.is_integer()))
    else:
        valid = st.floats(lo, hi) | st.sampled_from([lo, hi])
        invalid = (st.floats(max_value=lo, exclude_max=True)
                   | st.floats(min_value=hi, exclude_min=True))
    invalid |= st.sampled_from([math.nan, math.inf, -math.inf, True, "1", [1], {"v": 1}])
    return valid, invalid


FIELDS = {name: number_field(name) for name in RANGES}
FIELDS.update({
    "seed": (st.integers(0, 2**63 - 1), st.integers(max_value=-1) | st.integers(min_value=2**63)
             | st.sampled_from([1.5, "3", True])),
    "stop": (st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                        max_size=MAX_STOP),
             st.sampled_from(["", [""], ["a"] * (MAX_STOP + 1), 5, [5], ["\ud800"]])),
    "stream": (st.booleans(), st.sampled_from(["yes", 1, 0, [], "true"])),
    "use_kv_cache": (st.booleans(), st.sampled_from(["no", 1, 0, {}])),
    "stream_options": (st.fixed_dictionaries({"include_usage": st.booleans()}),
                       st.sampled_from([3, "x", [], {"include_usage": "yes"}])),
    "model": (st.sampled_from(["0", 0]), st.sampled_from(["nope", "9" * 5000, "-1", "7", 1.5,
                                                          True, [], "\ud800"])),
})


@st.composite
def chat_bodies(draw):
    messages = []
    count = draw(st.integers(1, 4))
    for i in range(count):
        roles = ROLES if i < count - 1 else [r for r in ROLES if r != "assistant"]
        m = {"role": draw(st.sampled_from(roles)), "content": draw(contents)}
        if draw(st.booleans()):
            m["message_id"] = draw(valid_ids)
        messages.append(m)
    body: dict = {"messages": messages}
    for name, (valid, _) in FIELDS.items():
        if draw(st.integers(0, 3)) == 0:
            body[name] = draw(valid)
    if "max_completion_tokens" not in body:
        body["max_tokens"] = draw(FIELDS["max_tokens"][0])
    mode = draw(st.sampled_from(["valid", "valid", "one field", "one message", "wild"]))
    if mode == "one field":
        name = draw(st.sampled_from(sorted(FIELDS)))
        body[name] = draw(FIELDS[name][1])
    elif mode == "one message":
        m = messages[draw(st.integers(0, count - 1))]
        what = draw(st.sampled_from(["role", "content", "message_id", "whole", "last"]))
        if what == "role":
            m["role"] = draw(st.sampled_from(["wizard", "", "USER"]) | junk)
        elif what == "content":
            m["content"] = draw(bad_contents)
        elif what == "message_id":
            m["message_id"] = draw(st.sampled_from(INVALID_IDS) | junk.filter(
                lambda v: v is not None and not isinstance(v, str)))
        elif what == "whole":
            messages[messages.index(m)] = draw(junk)
        else:
            messages.append({"role": "assistant", "content": "x"})
    elif mode == "wild":
        for key in draw(st.lists(st.sampled_from(["messages", *FIELDS, "extra", "tools"]),
                                 min_size=1, max_size=4)):
            body[key] = draw(junk)
        if draw(st.integers(0, 4)) == 0:
            body = draw(junk)
    return body


raw_bodies = st.one_of(
    st.binary(max_size=300),
    st.sampled_from([b"", b"{", b"[" * 50_000 + b"]" * 50_000, b'{"messages": NaN}',
                     b'{"messages": [{"role": "user", "content": "hi"}], "n": 1e999}',
                     b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                     + b"9" * 5000 + b"}", b"\xff\xfe{}", b'"just a string"', b"null"]),
    st.builds(lambda s, k: json.dumps(s)[:k].encode(), chat_bodies(), st.integers(0, 200)))

ascii_text = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=20).map(str.strip)
headers = st.fixed_dictionaries({}, optional={
    "X-Model-Id": st.sampled_from(["0", "1", "tinym", "nope", "9" * 300]) | ascii_text,
    "Content-Type": st.sampled_from(["application/json", "text/plain",
                                     "application/octet-stream"]) | ascii_text,
    "Authorization": st.sampled_from(["Bearer x", "Basic abc", "Bearer"]) | ascii_text,
})


def quote_id(value: str, raw_slash: bool) -> str:
    return urllib.parse.quote(value.encode("utf-8", "surrogatepass"),
                              safe="/" if raw_slash else "")


@st.composite
def route_requests(draw):
    if draw(st.integers(0, 9)) < 7:
        template, method = draw(st.sampled_from(OPERATIONS))
    else:
        template = draw(st.sampled_from([p for p, _ in OPERATIONS] + [
            "/", "/v1", "/v1/kv_cache", "/v1/kv_cache/", "/v1/kv_cache/export/", "/v1/chat",
            "/v1/models/x", "/docs", "/v1/kv_cache/export/{message_id}/more"]))
        method = draw(st.sampled_from(["GET", "POST", "DELETE", "PUT", "PATCH", "HEAD",
                                       "OPTIONS"]))
    path = template.replace("{message_id}", quote_id(draw(any_ids), draw(st.booleans())))
    query = draw(st.dictionaries(st.sampled_from(["message_id", "model", "x"]),
                                 any_ids | st.sampled_from(["0", "tinym"]), max_size=2))
    if query:
        path += "?" + urllib.parse.urlencode(
            {k: v.encode("utf-8", "surrogatepass") for k, v in query.items()})
    body = draw(st.none() | st.binary(max_size=64) | chat_bodies().map(
        lambda b: json.dumps(b).encode()))
    return {"kind": "route", "op": (template, method), "method": method, "path": path,
            "body": body, "headers": draw(headers)}


@st.composite
def chat_requests(draw):
    body = draw(chat_bodies())
    return {"kind": "chat", "op": ("/v1/chat/completions", "POST"), "method": "POST",
            "path": "/v1/chat/completions", "json": body, "headers": draw(headers.filter(
                lambda h: "Content-Type" not in h))}


def as_messages_body(chat: dict) -> dict:
    """A chat body in Anthropic's shape (system apart, blocks or strings)."""
    msgs = chat.get("messages") if isinstance(chat.get("messages"), list) else []
    system = [m.get("content") for m in msgs if isinstance(m, dict) and m.get("role") in
              ("system", "developer") and isinstance(m.get("content"), str)]
    out = {"model": "tinym", "max_tokens": chat.get("max_tokens", 4),
           "messages": [{"role": m.get("role"), "content": m.get("content")}
                        for m in msgs if isinstance(m, dict)
                        and m.get("role") not in ("system", "developer")]}
    if system:
        out["system"] = "\n".join(system)
    for k in ("stream", "temperature", "top_p", "stop"):
        if k in chat:
            out["stop_sequences" if k == "stop" else k] = chat[k]
    return out


def as_responses_body(chat: dict) -> dict:
    msgs = chat.get("messages") if isinstance(chat.get("messages"), list) else []
    out = {"input": [{"role": m.get("role"), "content": m.get("content")} for m in msgs
                     if isinstance(m, dict) and m.get("role") != "tool"] or "hi",
           "max_output_tokens": chat.get("max_tokens", 4)}
    for k in ("stream", "temperature", "top_p"):
        if k in chat:
            out[k] = chat[k]
    return out


def as_completions_body(chat: dict) -> dict:
    msgs = chat.get("messages") if isinstance(chat.get("messages"), list) else []
    text = " ".join(m["content"] for m in msgs if isinstance(m, dict)
                    and isinstance(m.get("content"), str))
    out = {"prompt": text or "hi", "max_tokens": chat.get("max_tokens", 4)}
    for k in ("stream", "temperature", "top_p", "stop", "seed", "n"):
        if k in chat:
            out[k] = chat[k]
    return out


OTHER_APIS = {"/v1/completions": as_completions_body, "/v1/messages": as_messages_body,
              "/v1/responses": as_responses_body}


@st.composite
def api_requests(draw):
    """Bodies for the other generating APIs, made from chat bodies (valid or broken)."""
    path = draw(st.sampled_from(sorted(OTHER_APIS)))
    chat = draw(chat_bodies())
    body = OTHER_APIS[path](chat) if isinstance(chat, dict) else chat
    if isinstance(body, dict) and draw(st.integers(0, 3)) == 0:
        body[draw(st.sampled_from(sorted(body) + ["tools", "tool_choice", "extra"]))] = \
            draw(junk)
    return {"kind": "api", "op": (path, "POST"), "method": "POST", "path": path, "json": body,
            "headers": {}}


@st.composite
def raw_requests(draw):
    return {"kind": "raw", "op": ("/v1/chat/completions", "POST"), "method": "POST",
            "path": "/v1/chat/completions", "body": draw(raw_bodies), "headers": {}}


HEADER_MUTATIONS = ["length past the end", "length 2**64-1", "huge header", "unknown dtype",
                    "offsets past the end", "metadata not strings", "no metadata", "no key",
                    "hostile key", "key too long", "tokens not JSON", "tokens out of range",
                    "not utf-8"]


@st.composite
def import_requests(draw):
    recipe = draw(st.sampled_from(["exact", "truncate", "flip", "header", "random", "empty"]))
    arg = {"truncate": st.integers(0, 10**6), "flip": st.lists(st.integers(0, 10**6),
                                                                min_size=1, max_size=4),
           "header": st.sampled_from(HEADER_MUTATIONS), "random": st.binary(max_size=200),
           }.get(recipe, st.none())
    query = draw(st.dictionaries(st.sampled_from(["message_id", "model"]),
                                 valid_ids | st.sampled_from(INVALID_IDS + ["0", "tinym",
                                                                            "nope"]),
                                 max_size=2))
    path = "/v1/kv_cache/import"
    if query:
        path += "?" + urllib.parse.urlencode(
            {k: v.encode("utf-8", "surrogatepass") for k, v in query.items()})
    return {"kind": "import", "op": ("/v1/kv_cache/import", "POST"), "method": "POST",
            "path": path, "recipe": (recipe, draw(arg)), "headers": {}}


requests = st.one_of(chat_requests(), chat_requests(), route_requests(), import_requests(),
                     raw_requests(), api_requests())


# -- materializing and checking --------------------------------------------------------------------


def split(raw: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def join(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def mutate_header(export: bytes, how: str) -> bytes:
    header, data = split(export)
    meta, kv = header["__metadata__"], header["kv.0"]  # the export of group 0's pages
    if how == "length past the end":
        return struct.pack("<Q", len(export) + 64) + export[8:]
    if how == "length 2**64-1":
        return struct.pack("<Q", 2**64 - 1) + export[8:]
    if how == "huge header":
        big = json.dumps({"__metadata__": {"x": "a" * (17 << 20)}}).encode()
        return struct.pack("<Q", len(big)) + big
    if how == "not utf-8":
        return struct.pack("<Q", 4) + b"\xff\xfe{}" + data
    if how == "unknown dtype":
        kv["dtype"] = "F128"
    elif how == "offsets past the end":
        kv["data_offsets"] = [0, kv["data_offsets"][1] + 4096]
    elif how == "metadata not strings":
        meta["num_layers"] = 2
    elif how == "no metadata":
        del header["__metadata__"]
    elif how == "no key":
        del meta["key"]
    elif how == "hostile key":
        meta["key"] = "a\x00/../b"
    elif how == "key too long":
        meta["key"] = "k" * 10_000
    elif how == "tokens not JSON":
        meta["tokens"] = "[1,"
    elif how == "tokens out of range":
        meta["tokens"] = json.dumps([2**70] * len(json.loads(meta["tokens"])))
    return join(header, data)


def body_of(req: dict, export: bytes) -> bytes | None:
    if "json" in req:
        return json.dumps(req["json"]).encode()
    if req["kind"] != "import":
        return req["body"]
    recipe, arg = req["recipe"]
    if recipe == "exact":
        return export
    if recipe == "truncate":
        return export[: arg % len(export)]
    if recipe == "flip":
        data = bytearray(export)
        for pos in arg:
            data[pos % len(data)] ^= 0x20
        return bytes(data)
    if recipe == "header":
        return mutate_header(export, arg)
    return arg or b""


def check(req: dict, r: httpx.Response, body: bytes | None) -> None:
    where = f"{req['method']} {req['path'][:120]} -> {r.status_code}: {r.text[:300]!r}"
    assert 200 <= r.status_code < 300 or 400 <= r.status_code < 500, where
    if r.status_code == 405:
        assert r.headers.get("allow"), where
    if r.status_code >= 400:
        if req["method"] != "HEAD":
            err = r.json()["error"]
            assert isinstance(err["message"], str) and err["message"], where
            assert isinstance(err["type"], str), where
        return
    if r.headers.get("content-type", "").startswith("text/event-stream"):
        check_stream(req["op"][0], r.text, where)


def check_stream(path: str, text: str, where: str) -> None:
    """A 200 stream is well-formed in its API's own shape, with no error in it."""
    lines = [ln for ln in text.split("\n") if ln]
    data = [json.loads(ln.removeprefix("data: ")) for ln in lines
            if ln.startswith("data: ") and ln != "data: [DONE]"]
    assert data, where
    if path in ("/v1/chat/completions", "/v1/completions"):
        assert lines[-1] == "data: [DONE]", where
        kind = "chat.completion.chunk" if path == "/v1/chat/completions" else "text_completion"
        assert all("error" not in c and c["object"] == kind for c in data), where
    elif path == "/v1/messages":
        types = [c["type"] for c in data]
        assert types[0] == "message_start" and types[-1] == "message_stop", where
        assert "error" not in types, where
    else:
        types = [c["type"] for c in data]
        assert types[0] == "response.created", where
        assert types[-1] in ("response.completed", "response.incomplete"), where
        assert [c["sequence_number"] for c in data] == list(range(len(data))), where


def greedy_twin(http: httpx.Client, base: str, req: dict, r: httpx.Response) -> int:
    """A greedy 200 must equal the same request without the cache; returns requests sent."""
    body = req.get("json")
    if req["kind"] != "chat" or r.status_code != 200 or not isinstance(body, dict) \
            or body.get("stream") or body.get("temperature") not in (None, 0, 0.0) \
            or body.get("use_kv_cache") is False:
        return 0
    twin = http.post(base + req["path"], content=json.dumps({**body, "use_kv_cache": False}),
                     headers=req["headers"])
    assert twin.status_code == 200, twin.text
    got = [c["message"]["content"] for c in r.json()["choices"]]
    want = [c["message"]["content"] for c in twin.json()["choices"]]
    assert got == want, (body, got, want)
    return 1


def described_valid(doc: Document, req: dict, r: httpx.Response) -> int:
    """A JSON body the description calls valid is not refused for its shape; returns 1 when the
    request had such a body (lone surrogates are outside JSON text the description speaks of)."""
    body, path = req.get("json"), req["path"]
    ops = doc.spec["paths"].get(path, {})
    schema = doc.body_schema(path) if req["method"] == "POST" and "post" in ops else None
    if schema is None or not isinstance(body, dict) or has_lone_surrogate(body) \
            or doc.errors(schema, body):
        return 0
    assert 200 <= r.status_code < 300 or not_about_shape(r), (path, body, r.text[:300])
    return 1


def reached(routes, r: httpx.Response) -> tuple[str, str] | int:
    """The described operation a request reached, as the app's router matched it (HEAD is GET's);
    404 or 405 when no route took it."""
    path = urllib.parse.unquote(r.request.url.raw_path.decode("ascii").partition("?")[0])
    scope = {"type": "http", "method": r.request.method, "path": path, "root_path": ""}
    partial = False
    for route in routes:
        match, _ = route.matches(scope)
        if match is Match.FULL:
            template = re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", route.path)
            return template, "GET" if r.request.method == "HEAD" else r.request.method
        partial |= match is Match.PARTIAL
    return 405 if partial else 404


def declared(spec: dict) -> dict[tuple[str, str], set[int]]:
    return {(path, method.upper()): {int(code) for code in op["responses"]}
            for path, ops in spec["paths"].items() for method, op in ops.items()}


def one_per_operation(export_id: str, victim_id: str) -> list[dict]:
    """A well-formed request for every described operation: each route is reached whatever the
    random draws are."""
    out = []
    for template, method in OPERATIONS:
        op = (template, method)
        if op == ("/v1/chat/completions", "POST"):
            out.append({"kind": "chat", "op": op, "method": method, "path": template, "headers": {},
                        "json": {"messages": [{"role": "user", "content": "hi",
                                               "message_id": "fz-0"}], "max_tokens": 2}})
        elif op == ("/v1/kv_cache/import", "POST"):
            out.append({"kind": "import", "op": op, "method": method, "headers": {},
                        "path": f"{template}?message_id=fz-imported", "recipe": ("exact", None)})
        else:
            key = victim_id if method == "DELETE" else export_id
            out.append({"kind": "route", "op": op, "method": method, "headers": {}, "body": None,
                        "path": template.replace("{message_id}", key)})
    return out


# -- the test --------------------------------------------------------------------------------------


def probe(http: httpx.Client, url: str) -> tuple[str, str]:
    answers = []
    for use in (True, False):
        r = http.post(f"{url}/chat/completions", json={"messages": PROBE, "max_tokens": 12,
                                                       "temperature": 0, "use_kv_cache": use})
        assert r.status_code == 200, r.text
        answers.append(r.json()["choices"][0]["message"]["content"])
    return tuple(answers)


def tree(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.lstat().st_size for p in root.rglob("*")}


@pytest.fixture()
def fuzz_server(tiny_lm, tmp_path, monkeypatch):
    skip_fsync(monkeypatch)
    page_bytes = tiny_lm.num_layers * 2 * tiny_lm.num_kv_heads * 8 * tiny_lm.head_dim * 4
    config = ServerConfig(max_tokens=4, page_size=8, kv_cache_dir=tmp_path / "kv",
                          max_body_bytes=256 << 10, max_import_bytes=1 << 20,
                          max_kv_ram_gb=3000 * page_bytes / (1 << 30),
                          max_kv_size_gb=2000 * page_bytes / (1 << 30))
    canary = tmp_path / "canary"
    canary.mkdir()
    (canary / "keep.txt").write_text("untouched")
    engine = make_engine([tiny_lm], config)
    with running_server([tiny_lm], config, engine=engine) as url:
        yield url, engine, tmp_path


def test_over_a_thousand_generated_requests_get_no_5xx(fuzz_server, tiny_lm):
    url, engine, tmp_path = fuzz_server
    base = url.removesuffix("/v1")
    http = httpx.Client(timeout=120)
    before = probe(http, url)
    assert before[0] == before[1]
    r = http.post(f"{url}/chat/completions", json={
        "messages": [{"role": "user", "content": "export me", "message_id": "fz-export"}],
        "max_tokens": 4})
    export_id = r.json()["message_id"]
    export = http.get(f"{url}/kv_cache/export/{export_id}").content
    assert export[:8] and len(export) > 1000
    victim = http.post(f"{url}/chat/completions", json={
        "messages": [{"role": "user", "content": "delete me"}], "max_tokens": 2})
    canary_before = tree(tmp_path / "canary")
    spec = http.get(f"{base}/openapi.json").json()
    doc = Document(spec)
    routes = engine_app(engine).routes
    statuses: Counter = Counter()
    seen: dict = {}
    covered: set = set()
    sent = Counter()

    def one(req):
        body = body_of(req, export)
        r = http.request(req["method"], base + req["path"], content=body,
                         headers=req["headers"])
        sent["generated"] += 1
        statuses[r.status_code] += 1
        seen.setdefault(reached(routes, r), set()).add(r.status_code)
        covered.add(req["op"])
        check(req, r, body)
        sent["no-cache twins"] += greedy_twin(http, base, req, r)
        sent["valid by the description"] += described_valid(doc, req, r)

    run = given(req=requests)(one)
    for req in one_per_operation(export_id, victim.json()["message_id"]):
        run = example(req=req)(run)
    settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
             suppress_health_check=list(HealthCheck))(run)()
    print(f"\nfuzz: {dict(sent)} requests; generated ones answered "
          f"{dict(sorted(statuses.items()))}")
    assert sent["generated"] >= 1000 and sent["no-cache twins"] >= 50
    assert sent["valid by the description"] >= 200
    assert set(OPERATIONS) <= covered, set(OPERATIONS) - covered
    assert set(OPERATIONS) <= seen.keys(), set(OPERATIONS) - seen.keys()
    assert statuses[200] >= 200 and sum(n for s, n in statuses.items() if s >= 400) >= 200
    # Every status is one the description declares for the operation reached.
    allowed = {**declared(spec), 404: {404}, 405: {405}}
    undeclared = {op: got - allowed[op] for op, got in seen.items() if got - allowed[op]}
    assert not undeclared, undeclared
    # The server is alive and answers as before; nothing leaked; nothing written elsewhere.
    assert http.get(f"{base}/health").json()["status"] == "ok"
    assert probe(http, url) == before
    assert_cache_at_rest(engine)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary", "kv"]
    assert tree(tmp_path / "canary") == canary_before
    (root,) = [p for p in (tmp_path / "kv").iterdir() if p.name != "responses"]
    assert {p.name for p in root.iterdir()} <= {".lock", "entries", "pages", "tails",
                                                "arrays", "model.json"}
    assert all(re.fullmatch(r"[0-9a-f]{64}\.safetensors", p.name)
               for p in (root / "entries").iterdir())
    assert all(re.fullmatch(r"[0-9a-f]{2}", p.name) for p in (root / "pages").iterdir())
    assert all(re.fullmatch(r"[0-9a-f]{2}", p.name) for p in (root / "tails").iterdir())
    http.close()


@pytest.mark.parametrize("name", sorted(RANGES))
def test_numeric_fields_are_range_checked_at_both_ends(fuzz_server, name):
    url = fuzz_server[0]
    lo, hi, integer = RANGES[name]
    step = 1 if integer else 1e-9
    base = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    for value in (lo - step, hi + step, hi * 10 + 1, -(2**80)):
        r = httpx.post(f"{url}/chat/completions", json={**base, name: value}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == name, (value, r.text)
    inside = [lo] if name in ("max_tokens", "max_completion_tokens") else [lo, hi]
    for value in inside:  # a max_tokens of 2**20 would run to the context's end: not here
        body = {**base, name: value}
        if name == "max_completion_tokens":
            del body["max_tokens"]
        r = httpx.post(f"{url}/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, (value, r.text)
        if name == "n":
            assert len(r.json()["choices"]) == value


def test_prompt_longer_than_the_context_is_refused_on_both_paths(fuzz_server, tiny_lm):
    url = fuzz_server[0]
    long = "word " * (tiny_lm.context_length + 1)
    for stream in (False, True):
        r = httpx.post(f"{url}/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": long, "message_id": "fz-long"}],
            "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    assert httpx.get(f"{url}/kv_cache/fz-long").status_code == 404  # nothing was stored


def test_import_larger_than_the_limit_is_413(fuzz_server):
    r = httpx.post(f"{fuzz_server[0]}/kv_cache/import", content=b"\0" * (1 << 20) + b"x",
                   timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large"


def test_the_openapi_description_covers_every_route(fuzz_server):
    url = fuzz_server[0]
    served = httpx.get(url.removesuffix("/v1") + "/openapi.json").json()
    assert served["paths"].keys() == SPEC["paths"].keys()
    routes = {re.sub(r"\{(\w+)(:\w+)?\}", r"{\1}", r.path): set(r.methods) - {"HEAD"}
              for r in engine_app(fuzz_server[1]).routes}
    described = {p: {m.upper() for m in ops} for p, ops in SPEC["paths"].items()}
    assert routes == described


WRONG_TYPE_BODIES = 60  # valid bodies drawn per operation, each field of each put wrong
JSON_OPS = sorted(p for p, ops in SPEC["paths"].items() if "post" in ops
                  and Document(SPEC).body_schema(p))


def assert_api_error(path: str, r: httpx.Response) -> None:
    """``r`` is a 400 in the shape of the API ``path`` belongs to."""
    body = r.json()
    if is_anthropic_path(path):
        assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    else:
        assert body["error"]["type"] == "invalid_request_error" and "param" in body["error"]
    assert r.status_code == 400 and isinstance(body["error"]["message"], str), r.text


@pytest.mark.parametrize("path", JSON_OPS)
def test_a_value_of_the_wrong_type_anywhere_in_a_body_is_a_400(fuzz_server, path):
    """Valid bodies are drawn from the served description; each field of them (every key and
    item, at every depth, once per kind of field) takes a value of each JSON type in turn. A body
    the description then calls invalid is a 400 in the API's own shape (never a 5xx, never
    accepted); one it still calls valid (kept to its rules in words) is accepted, or refused only
    for what the description cannot know."""
    base = fuzz_server[0].removesuffix("/v1")
    http = httpx.Client(timeout=60)
    doc = Document(http.get(f"{base}/openapi.json").json())
    schema = doc.body_schema(path)
    stored = http.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 1})
    rng, tried, named, counts, bad = random.Random(path), set(), set(), Counter(), []
    for i in range(WRONG_TYPE_BODIES):
        body = follow_rules(path, doc.draw(schema, rng if i else None))
        if body.get("previous_response_id") is not None:
            body["previous_response_id"] = stored.json()["id"]
        for at in locations(body):
            if kind_of(body, at) in tried:
                continue
            tried.add(kind_of(body, at))
            named.update(k for k in at if isinstance(k, str))
            for value in WRONG_TYPES:
                wrong = replaced(body, at, value)
                if doc.errors(schema, wrong):
                    r = http.post(base + path, json=wrong)
                    counts["invalid"] += 1
                    if r.status_code != 400:
                        bad.append(("invalid", at, value, r.status_code, r.text[:200]))
                    else:
                        assert_api_error(path, r)
                elif not doc.errors(schema, follow_rules(path, wrong)):
                    r = http.post(base + path, json=wrong)
                    counts["valid"] += 1
                    if not (200 <= r.status_code < 300 or not_about_shape(r)):
                        bad.append(("valid", at, value, r.status_code, r.text[:200]))
    print(f"\n{path}: {len(tried)} kinds of field, bodies sent: {dict(counts)}")
    assert not bad, "\n".join(map(repr, bad))
    assert property_names(doc, schema) <= named, property_names(doc, schema) - named
    assert counts["invalid"] >= 5 * len(tried) and counts["valid"] >= len(tried) // 2
    http.close()


def engine_app(engine):
    """An app like the fuzzed server's (for its routes; never started)."""
    from mlx_kvserver.api import build_app
    from mlx_kvserver.models.registry import ModelRegistry
    from mlx_kvserver.models.serving import OnDemand

    config = ServerConfig()
    return build_app(config, OnDemand(config, ModelRegistry(list(engine.models.values())), engine),
                     engine)
