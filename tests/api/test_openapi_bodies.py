"""The OpenAPI description (``GET /openapi.json``) says what the validators require: a body it
calls valid is accepted, and the bodies the validators refuse for their shape it calls invalid.

For every operation with a JSON body, the minimal body (required fields only) and random ones are
drawn from the served description's own schema (tests/schema_bodies.py), checked valid by it
(jsonschema), kept to the rules it states in words (tool results answer earlier calls, unique
names, ``tool_choice`` naming a tool, images real pictures sent to the served model that takes
images, the tiny Qwen2.5-VL), and sent: each must be answered with a 2xx. Nothing is excused: ``model`` takes one of the names the description gives as examples (another name is a
404 it declares: the description cannot know the served names, and tests/test_fuzz_api.py sends
those), and a ``previous_response_id`` is one the server holds. The import's body is not JSON:
the description gives it a media type of its own, links it to the export's answer, and the file
that answer carries, sent as described, is accepted.
"""

from __future__ import annotations

import random

import httpx
import pytest

from mlx_kvserver.api.openapi import openapi_spec
from mlx_kvserver.config import ServerConfig
from tests.chat.pictures import data_url
from tests.schema_bodies import PICTURE, Document, follow_rules
from harness.server_utils import running_server

RANDOM = 24  # random bodies per operation
IMAGE_BODIES = 6  # random bodies with images per operation that takes them


def has_picture(body: dict) -> bool:
    return data_url(PICTURE).partition(",")[2] in repr(body)
SPEC = Document(openapi_spec(["m"]))
JSON_OPS = sorted(p for p, ops in SPEC.spec["paths"].items() if "post" in ops
                  and SPEC.body_schema(p))


IMAGES = ("/v1/chat/completions", "/v1/messages", "/v1/messages/count_tokens", "/v1/responses",
          "/v1/chat/completions/render", "/v1/responses/render", "/tokenize")


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    import huggingface_hub

    from harness.tiny_vlm import make_tiny_vlm_dir
    from mlx_kvserver.models.loading import resolve_and_load

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        yield resolve_and_load(str(make_tiny_vlm_dir(tmp_path_factory.mktemp("vlm") / "tiny-vlm")))


@pytest.fixture(scope="module")
def served(tiny_lm, vlm, tmp_path_factory):
    config = ServerConfig(max_tokens=4, page_size=8, kv_cache_dir=tmp_path_factory.mktemp("kv"))
    with running_server([tiny_lm, vlm], config) as url:
        base = url.removesuffix("/v1")
        stored = httpx.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2})
        assert stored.status_code == 200, stored.text
        yield base, Document(httpx.get(f"{base}/openapi.json").json()), stored.json()["id"], \
            vlm.name


def refusal(base: str, path: str, body: dict) -> tuple | None:
    r = httpx.post(base + path, json=body, timeout=60)
    return None if 200 <= r.status_code < 300 else (r.status_code, r.text[:300], body)


@pytest.mark.parametrize("path", JSON_OPS)
def test_bodies_the_description_calls_valid_are_accepted(served, path):
    base, doc, stored_response, vision = served
    schema = doc.body_schema(path)
    minimal = doc.draw(schema, None)
    assert not doc.errors(schema, minimal)
    assert refusal(base, path, minimal) is None
    rng, drawn = random.Random(path), []

    def draw() -> dict:
        body = doc.draw(schema, rng)
        assert not doc.errors(schema, body), (body, doc.errors(schema, body))
        follow_rules(path, body, vision)
        if body.get("previous_response_id") is not None:
            body["previous_response_id"] = stored_response
        assert not doc.errors(schema, body), (body, doc.errors(schema, body))
        return body

    drawn = [draw() for _ in range(RANDOM)]
    # the draws differ (bodies of token ids alone, /detokenize's, repeat some)
    assert len({repr(b) for b in drawn}) >= (RANDOM if path != "/detokenize" else RANDOM // 2)
    if path in IMAGES:  # and more until IMAGE_BODIES of them hold images
        more = (draw() for _ in range(500))
        drawn += [b for b in more if has_picture(b)][:IMAGE_BODIES - sum(map(has_picture, drawn))]
        assert sum(map(has_picture, drawn)) >= IMAGE_BODIES
    else:
        assert not any(map(has_picture, drawn))
    refused = [why for body in drawn if (why := refusal(base, path, body))]
    assert not refused, refused


def test_the_import_takes_the_file_the_export_link_gives(served):
    base, doc, *_ = served
    export_path = "/v1/kv_cache/export/{message_id}"
    link = doc.spec["paths"][export_path]["get"]["responses"]["200"]["links"]["import"]
    assert link["operationRef"] == "#/paths/~1v1~1kv_cache~1import/post"
    assert link["requestBody"] == "$response.body"
    body = doc.resolve({"$ref": link["operationRef"]})["requestBody"]
    (media,) = body["content"]
    # Not a type that any bytes are: a generator cannot make this body up, it must follow the link.
    assert media not in ("application/octet-stream", "*/*") and not media.startswith("text/")
    chat = httpx.post(f"{base}/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "export me"}], "max_tokens": 2}).json()
    file = httpx.get(base + export_path.format(message_id=chat["message_id"]))
    assert file.status_code == 200
    r = httpx.post(f"{base}/v1/kv_cache/import?message_id=imported", content=file.content,
                   headers={"Content-Type": media})
    assert r.status_code == 200 and r.json()["message_id"] == "imported", r.text


PNG = data_url(PICTURE)
REFUSED = {  # bodies each API's parser refuses for their shape
    "/v1/chat/completions": [{}, {"messages": []}, {"messages": [{"role": "tool"}]},
                             {"messages": [{"role": "tool", "tool_call_id": ""}]},
                             {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
                             {"messages": [{"role": "user", "content": [{
                                 "type": "image_url", "image_url": {"url": "x.png"}}]}]},
                             {"messages": [{"role": "user", "content": [{
                                 "type": "image_url", "image_url": {"url": PNG,
                                                                   "detail": "max"}}]}]},
                             {"messages": [{"role": "system", "content": [{
                                 "type": "image_url", "image_url": PNG}]}]}],
    "/v1/completions": [{}, {"prompt": ""}, {"prompt": []}, {"prompt": ["a", "b"]},
                        {"prompt": "a", "suffix": "b"}, {"prompt": [-1]}],
    "/v1/messages": [{}, {"model": "m", "messages": [{"role": "user", "content": "x"}]},
                     {"model": "m", "max_tokens": 1, "messages": []},
                     {"model": "m", "max_tokens": 1, "messages": [{"role": "user"}]},
                     {"model": "m", "max_tokens": 1, "temperature": 1.5,
                      "messages": [{"role": "user", "content": "x"}]},
                     {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [
                         {"type": "image", "source": {"type": "base64", "media_type": "image/bmp",
                                                      "data": PNG.partition(",")[2]}}]}]},
                     {"model": "m", "max_tokens": 1, "messages": [
                         {"role": "user", "content": "x"}, {"role": "assistant", "content": [
                             {"type": "image", "source": {"type": "url", "url": PNG}}]}]}],
    "/v1/messages/count_tokens": [{}, {"messages": [{"role": "user", "content": "x"}]},
                                  {"model": "m", "messages": [{"role": "tool", "content": "x"}]}],
    "/v1/responses": [{}, {"input": ""}, {"input": []}, {"input": [{"type": "reasoning"}]},
                      {"input": [{"role": "assistant", "content": ""}]},
                      {"input": "x", "background": True}, {"input": "x", "conversation": "c"},
                      {"input": [{"role": "user", "content": [{"type": "input_image",
                                                               "file_id": "file-1"}]}]},
                      {"input": [{"role": "system", "content": [{"type": "input_image",
                                                                 "image_url": PNG}]}]}],
}

REFUSED.update({f"{path}/render": REFUSED[path] for path in
                ("/v1/chat/completions", "/v1/completions", "/v1/responses")})
REFUSED["/tokenize"] = [{}, {"prompt": ""}, {"messages": []}, {"prompt": [-1]}]
REFUSED["/detokenize"] = [{}, {"tokens": ["a"]}, {"tokens": [-1]}]


@pytest.mark.parametrize("path", sorted(REFUSED))
def test_bodies_the_parsers_refuse_the_description_calls_invalid(served, path):
    assert set(REFUSED) == set(JSON_OPS)
    schema = SPEC.body_schema(path)
    for body in REFUSED[path]:
        assert SPEC.errors(schema, body), body
        r = httpx.post(served[0] + path, json=body, timeout=60)
        assert r.status_code == 400, (body, r.text)
