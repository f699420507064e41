"""A request's images read before the engine sees them (``mlx_kvserver/api/images.py``): counted,
URLs allowed only with the flag and never to this machine, refused for a model that takes none
(naming those that do), and, on a server, every such request a 400 in the API's shape."""

from __future__ import annotations

import asyncio
import base64
import copy
import ipaddress
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import httpx
import pytest

from mlx_kvserver.api import images
from mlx_kvserver.chat.conversation import Conversation, Image, Message, Text
from mlx_kvserver.chat.images import ImageSource
from mlx_kvserver.config import ServerConfig
from mlx_kvserver.errors import RequestError
from harness.server_utils import running_server
from tests.chat.pictures import data_url, png


def conv_of(*parts) -> Conversation:
    return Conversation(messages=[Message("user", list(parts))])


def refusal(call, *args) -> RequestError:
    with pytest.raises(RequestError) as e:
        call(*args)
    assert e.value.status == 400
    return e.value


# -- counting, URLs, the model -----------------------------------------------------------------

def test_too_many_images():
    conv = conv_of(*[ImageSource(f"messages[0].content[{i}]", "messages", url=data_url())
                     for i in range(3)])
    images.check_sources(conv, 3, False)
    e = refusal(images.check_sources, conv, 2, False)
    assert e.code == "too_many_images" and "3 images" in e.message and "--max-images" in e.message


def test_a_url_needs_the_flag():
    conv = conv_of(Text("what is this?"), ImageSource("messages[0].content[1]", "messages",
                                                       url="https://example.com/cat.png"))
    e = refusal(images.check_sources, conv, 16, False)
    assert e.code == "image_urls_not_allowed" and "--allow-image-urls" in e.message
    assert "messages[0].content[1]" in e.message
    images.check_sources(conv, 16, True)
    file_url = conv_of(ImageSource("x", url="file:///etc/passwd"))
    assert refusal(images.check_sources, file_url, 16, True).code == "invalid_image"


def test_an_image_to_a_model_that_takes_none_names_those_that_do():
    text_lm = SimpleNamespace(name="text")
    vision = SimpleNamespace(name="eyes", takes_images=True)
    conv = conv_of(Text("hi"), Image("d" * 64, 1, 1, b"\0\0\0"))
    e = refusal(images.refuse_unless_taken, conv, text_lm, [text_lm])
    assert e.code == "images_not_supported" and "no served model takes images" in e.message
    e = refusal(images.refuse_unless_taken, conv, text_lm, [text_lm, vision])
    assert "served models that take images: eyes" in e.message
    images.refuse_unless_taken(conv, vision, [text_lm, vision])
    images.refuse_unless_taken(conv_of(Text("hi")), text_lm, [text_lm])


def test_sources_are_read_into_images_in_their_places():
    a, b = png(color=(1, 2, 3)), png(color=(4, 5, 6))
    conv = Conversation(messages=[
        Message("user", [Text("one"), ImageSource("a", url=data_url(a)), Text("two"),
                         ImageSource("b", data=b)]),
        Message("user", [ImageSource("c", url=data_url(a))])])
    asyncio.run(images.read_images(conv))
    assert not images.sources(conv)
    first, second = conv.messages[0].images[0], conv.messages[0].images[1]
    assert conv.images == [first, second, conv.messages[1].images[0]]
    assert first == conv.messages[1].images[0] and first != second
    assert [type(p).__name__ for p in conv.messages[0].parts] == ["Text", "Image", "Text",
                                                                   "Image"]


def test_a_bad_image_is_a_400_naming_it():
    conv = conv_of(ImageSource("messages[0].content[0]", "messages",
                               url="data:image/png;base64," + base64.b64encode(
                                   b"not a picture").decode()))
    with pytest.raises(RequestError) as e:
        asyncio.run(images.read_images(conv))
    assert e.value.status == 400 and "messages[0].content[0]: not an image" in e.value.message


# -- fetching --------------------------------------------------------------------------------

@pytest.mark.parametrize("address", ["127.0.0.1", "127.8.9.1", "::1", "0.0.0.0", "::",
                                     "169.254.169.254", "fe80::1", "224.0.0.1",
                                     "::ffff:127.0.0.1"])
def test_addresses_of_this_machine_are_refused(address):
    assert images.refused_address(ipaddress.ip_address(address), set()) is not None


def test_own_interface_addresses_are_refused():
    own = images.own_addresses()
    assert ipaddress.ip_address("127.0.0.1") in own
    for ip in own:
        assert images.refused_address(ip, own) is not None
    assert images.refused_address(ipaddress.ip_address("93.184.215.14"), own) is None


@pytest.mark.parametrize("url", ["http://127.0.0.1:9/cat.png", "http://localhost/cat.png",
                                 "https://[::1]/cat.png", "http://0.0.0.0/cat.png"])
def test_a_fetch_to_this_machine_is_refused(url):
    with pytest.raises(RequestError) as e:
        asyncio.run(images.fetch(url, "messages[0].content[0]"))
    assert e.value.status == 400 and e.value.code == "image_url_refused"
    assert "may not point at this machine" in e.value.message


class Files(BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, dict, bytes]] = {}

    def do_GET(self):  # noqa: N802 - the handler's name
        status, headers, body = self.routes.get(self.path, (404, {}, b""))
        self.send_response(status)
        for k, v in {"Content-Length": str(len(body)), **headers}.items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture()
def files(monkeypatch):
    """An HTTP server on loopback, which the fetch is let reach (only) for these tests."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    real = images.refused_address
    monkeypatch.setattr(images, "refused_address",
                        lambda ip, own: None if str(ip) == "127.0.0.1" else real(ip, own))
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_a_fetch_reads_the_image_follows_redirects_and_stops_at_the_limits(files,
                                                                          monkeypatch):
    picture = png()
    Files.routes = {"/cat.png": (200, {"Content-Type": "image/png"}, picture),
                    "/moved": (302, {"Location": "/cat.png"}, b""),
                    "/to-v6": (302, {"Location": "http://[::1]/cat.png"}, b""),
                    "/loop": (302, {"Location": "/loop"}, b""),
                    "/big": (200, {}, b"x" * 2048),
                    "/gone": (404, {}, b"")}
    assert asyncio.run(images.fetch(f"{files}/cat.png", "x")) == picture
    assert asyncio.run(images.fetch(f"{files}/moved", "x")) == picture

    def fails(path: str, code: str) -> str:
        with pytest.raises(RequestError) as e:
            asyncio.run(images.fetch(f"{files}{path}", "x"))
        assert e.value.status == 400 and e.value.code == code, e.value.message
        return e.value.message

    assert "::1" in fails("/to-v6", "image_url_refused")  # a redirect is checked too
    assert "redirected more than" in fails("/loop", "image_fetch_failed")
    assert "HTTP 404" in fails("/gone", "image_fetch_failed")
    monkeypatch.setattr(images, "MAX_FETCH_BYTES", 1024)
    assert "larger than 1024 bytes" in fails("/big", "image_too_large")


# -- on a server: a text model and one said to take images --------------------------------------

@pytest.fixture(scope="module")
def served(tiny_lm, tmp_path_factory):
    """The tiny text model, and a copy of it under another name that says it takes images (its
    prompt is still rendered as text: what reaches the renderer shows no image is dropped)."""
    eyes = copy.copy(tiny_lm)
    eyes.name, eyes.takes_images = "tiny-eyes", True
    config = ServerConfig(max_tokens=4, kv_cache_dir=tmp_path_factory.mktemp("kv"),
                          allow_image_urls=True, max_images=2)
    with running_server([tiny_lm, eyes], config) as url:
        yield SimpleNamespace(url=url, text=tiny_lm.name, eyes=eyes.name)


def chat(served, model: str, *urls: str, **extra) -> httpx.Response:
    content = [{"type": "text", "text": "What is in the picture?"},
               *({"type": "image_url", "image_url": {"url": u}} for u in urls)]
    return httpx.post(f"{served.url}/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": content}], **extra})


def error_of(r: httpx.Response, code: str) -> str:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == code, err
    return err["message"]


def test_served_an_image_to_the_text_model_names_the_model_that_takes_images(served):
    for stream in (False, True):
        message = error_of(chat(served, served.text, data_url(), stream=stream),
                           "images_not_supported")
        assert f"served models that take images: {served.eyes}" in message


def test_served_too_many_images_and_a_url_to_this_machine(served):
    assert "--max-images" in error_of(chat(served, served.eyes, *[data_url()] * 3),
                                      "too_many_images")
    message = error_of(chat(served, served.eyes, "http://127.0.0.1:1/cat.png"),
                       "image_url_refused")
    assert "messages[0].content[1]" in message
    error_of(chat(served, served.eyes, data_url(b"GIF89a not really")), "invalid_image")


def test_served_an_image_never_vanishes_from_a_text_prompt(served):
    """A decoded image reaches a model whose prompt is text: refused, not rendered without it."""
    assert "does not take images" in error_of(chat(served, served.eyes, data_url()),
                                              "images_not_supported")
    r = httpx.post(f"{served.url}/chat/completions", timeout=60, json={
        "model": served.eyes, "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
