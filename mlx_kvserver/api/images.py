"""A request's images read before the engine sees it, for every API: the :class:`ImageSource`
parts the API modules put where the wire had an image become :class:`Image` parts.

In order, so that a request that will be refused costs nothing: the images are counted
(``--max-images``), URLs are checked (``http(s)`` only, and only with ``--allow-image-urls``),
a model served now that takes no images refuses them (:func:`refuse_unless_taken`, which names
the served models that take images), and only then are URLs fetched and every image decoded
(``chat/images.py``, in a worker thread).

A fetch goes only to an address outside this machine: the host is resolved first, and a
loopback, link-local, unspecified or multicast address, or one of this machine's own interface
addresses, is refused (a request must not read what only the server can reach); the connection
then goes to the address that was checked (no second lookup), without proxies, following at most
:data:`MAX_REDIRECTS` redirects, each checked the same way, within :data:`MAX_FETCH_BYTES` and
:data:`FETCH_TIMEOUT_S` seconds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from typing import Any, Iterable

import httpx
from starlette.concurrency import run_in_threadpool

from ..chat.conversation import Conversation, Image
from ..chat.images import ImageSource, data_url_bytes, decode_image
from ..errors import RequestError, bad_request

MAX_FETCH_BYTES = 20 << 20  # an image fetched from a URL, at most
FETCH_TIMEOUT_S = 10.0  # the whole fetch of one image, redirects included
MAX_REDIRECTS = 3
URL_FLAG = "--allow-image-urls"


def sources(conv: Conversation) -> list[ImageSource]:
    """The images of ``conv`` not read yet, in order."""
    return [p for m in conv.messages for p in m.parts if isinstance(p, ImageSource)]


def has_images(conv: Conversation) -> bool:
    return any(isinstance(p, (Image, ImageSource)) for m in conv.messages for p in m.parts)


def takes_images(lm: Any) -> bool:
    """Whether a served model reads images (a text model does not)."""
    return bool(getattr(lm, "takes_images", False))


def refuse_unless_taken(conv: Conversation, lm: Any, served: Iterable[Any]) -> None:
    """A 400 when ``conv`` has images and ``lm`` takes none, naming the ``served`` models
    that do."""
    if not has_images(conv) or takes_images(lm):
        return
    vision = [m.name for m in served if takes_images(m)]
    which = f"served models that take images: {', '.join(vision)}" if vision \
        else "no served model takes images"
    raise bad_request(f"model {lm.name!r} does not take images ({which})", "messages",
                      code="images_not_supported")


def check_sources(conv: Conversation, max_images: int, allow_urls: bool) -> None:
    """The images counted against ``max_images`` and their URLs checked (nothing is read)."""
    found = sources(conv)
    if len(found) > max_images:
        raise bad_request(f"{len(found)} images in one request, more than the {max_images} "
                          "this server takes (--max-images)", found[max_images].param,
                          code="too_many_images")
    for s in found:
        if s.url is None or s.url[:5].lower() == "data:":
            continue
        scheme = s.url.partition(":")[0].lower()
        if scheme not in ("http", "https"):
            raise bad_request(f"{s.where}: an image URL must be a data URL or an http(s) URL",
                              s.param, code="invalid_image")
        if not allow_urls:
            raise bad_request(f"{s.where}: image URLs are not fetched by this server (it "
                              f"fetches them only when started with {URL_FLAG}); send the "
                              "image as a data URL ('data:image/png;base64,...')", s.param,
                              code="image_urls_not_allowed")


async def read_images(conv: Conversation) -> None:
    """Every :class:`ImageSource` of ``conv`` replaced by its decoded :class:`Image` (checked
    first with :func:`check_sources`)."""
    where: list[tuple[list, int, ImageSource]] = [
        (m.parts, i, p) for m in conv.messages for i, p in enumerate(m.parts)
        if isinstance(p, ImageSource)]
    files = [await _bytes(s) for _, _, s in where]
    images = await run_in_threadpool(
        lambda: [decode_image(data, s.where, s.param) for data, (_, _, s) in zip(files, where)])
    for (parts, i, _), image in zip(where, images):
        parts[i] = image


async def _bytes(s: ImageSource) -> bytes:
    if s.data is not None:
        return s.data
    assert s.url is not None
    if s.url[:5].lower() == "data:":
        return data_url_bytes(s.url, s.where, s.param)
    try:
        return await asyncio.wait_for(fetch(s.url, s.where, s.param), FETCH_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise bad_request(f"{s.where}: fetching the image took longer than {FETCH_TIMEOUT_S:g} "
                          "s", s.param, code="image_fetch_failed") from None


# -- fetching ------------------------------------------------------------------------------------

def own_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """This machine's interface addresses."""
    import psutil

    out = set()
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                try:
                    out.add(ipaddress.ip_address(a.address.split("%")[0]))
                except ValueError:
                    pass
    return out


def refused_address(ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
                    own: set) -> str | None:
    """Why a fetch may not go to ``ip``; None when it may."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    for why, hit in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                     ("unspecified", ip.is_unspecified), ("multicast", ip.is_multicast),
                     ("this machine's own", ip in own)):
        if hit:
            return f"{why} address {ip}"
    return None


async def checked_address(host: str, port: int, where: str, param: str | None) -> str:
    """An address of ``host`` that a fetch may go to; 400 when any of them may not (a name
    that resolves to both an outside and an inside address is refused whole)."""
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except OSError as e:
        raise bad_request(f"{where}: the image URL's host {host!r} does not resolve ({e})",
                          param, code="image_fetch_failed") from None
    own = own_addresses()
    ips = [ipaddress.ip_address(str(info[4][0]).split("%")[0]) for info in infos]
    for ip in ips:
        why = refused_address(ip, own)
        if why is not None:
            raise bad_request(f"{where}: image URLs may not point at this machine ({host!r} is "
                              f"a {why})", param, code="image_url_refused")
    if not ips:
        raise bad_request(f"{where}: the image URL's host {host!r} has no address", param,
                          code="image_fetch_failed")
    return str(ips[0])


async def fetch(url: str, where: str, param: str | None = None) -> bytes:
    """The body of ``url`` (``http(s)``), fetched from an address outside this machine, within
    :data:`MAX_FETCH_BYTES`; 400 for anything else."""
    def failed(why: str, code: str = "image_fetch_failed") -> RequestError:
        return bad_request(f"{where}: {why}", param, code=code)

    async with httpx.AsyncClient(trust_env=False, follow_redirects=False,
                                 timeout=FETCH_TIMEOUT_S) as client:
        for _ in range(MAX_REDIRECTS + 1):
            try:
                target = httpx.URL(url)
            except (httpx.InvalidURL, ValueError) as e:
                raise failed(f"not a valid URL ({e})", "invalid_image") from None
            if target.scheme not in ("http", "https") or not target.host:
                raise failed("an image URL must be an http(s) URL with a host", "invalid_image")
            port = target.port or (443 if target.scheme == "https" else 80)
            ip = await checked_address(target.host, port, where, param)
            request = client.build_request(
                "GET", target.copy_with(host=ip),
                headers={"Host": target.netloc.decode("ascii"), "Accept": "image/*"},
                extensions={"sni_hostname": target.host})
            try:
                response = await client.send(request, stream=True)
            except httpx.HTTPError as e:
                raise failed(f"fetching the image failed ({type(e).__name__}: {e})") from None
            try:
                if response.is_redirect and "location" in response.headers:
                    url = str(target.join(response.headers["location"]))
                    continue
                if response.status_code != 200:
                    raise failed(f"fetching the image answered HTTP {response.status_code}")
                return await _body(response, failed)
            finally:
                await response.aclose()
    raise failed(f"fetching the image was redirected more than {MAX_REDIRECTS} times")


async def _body(response: httpx.Response, failed) -> bytes:
    too_large = f"the image is larger than {MAX_FETCH_BYTES} bytes"
    declared = response.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_FETCH_BYTES:
        raise failed(too_large, "image_too_large")
    body = bytearray()
    try:
        async for chunk in response.aiter_bytes():
            body += chunk
            if len(body) > MAX_FETCH_BYTES:
                raise failed(too_large, "image_too_large")
    except httpx.HTTPError as e:
        raise failed(f"fetching the image failed ({type(e).__name__}: {e})") from None
    return bytes(body)
