"""An image's bytes read into an ``Image`` (``mlx_kvserver/chat/images.py``): its identity is its
pixels, and every file that is not a whole image of a taken format is a 400 before it costs
much; real images made with Pillow here."""

from __future__ import annotations

import base64
import struct
import zlib

import pytest
from PIL import Image as PILImage
from PIL import PngImagePlugin

from mlx_kvserver.chat.images import (MAX_IMAGE_PIXELS, data_url_bytes, decode_image,
                                      pixel_digest)
from mlx_kvserver.errors import RequestError
from tests.chat.pictures import file_of, picture


def refused(data: bytes, words: str) -> RequestError:
    with pytest.raises(RequestError) as e:
        decode_image(data, "messages[0].content[1]", "messages")
    assert e.value.status == 400 and e.value.type == "invalid_request_error"
    assert words in e.value.message and "messages[0].content[1]" in e.value.message, \
        e.value.message
    return e.value


def png_header(width: int, height: int) -> bytes:
    """A PNG's signature, IHDR and IEND: a file that claims ``width`` x ``height`` pixels and
    holds none of them."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + \
            struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b"")


def test_an_image_is_its_rgb_pixels():
    im = picture()
    image = decode_image(file_of(im), "x")
    assert (image.width, image.height) == im.size
    assert image.rgb == im.tobytes()
    assert image.digest == pixel_digest(*im.size, im.tobytes())


def test_the_same_picture_in_another_file_is_the_same_image():
    im = picture()
    meta = PngImagePlugin.PngInfo()
    meta.add_text("Software", "another editor")
    a = file_of(im, compress_level=9)
    b = file_of(im, compress_level=1, pnginfo=meta)
    c = file_of(im, "WEBP", lossless=True)
    assert len({a, b, c}) == 3  # three different files
    images = [decode_image(f, "x") for f in (a, b, c)]
    assert images[0] == images[1] == images[2]
    assert len({i.digest for i in images}) == 1
    rgba = decode_image(file_of(im.convert("RGBA")), "x")  # an opaque alpha channel dropped
    assert rgba == images[0]


def test_a_different_picture_is_a_different_image():
    im = picture()
    whole = decode_image(file_of(im), "x")
    crop = decode_image(file_of(im.crop((0, 0, 63, 48))), "x")
    shifted = decode_image(file_of(im.crop((1, 0, 64, 48))), "x")
    one_pixel = im.copy()
    one_pixel.putpixel((40, 40), (0, 0, 0))
    assert len({whole.digest, crop.digest, shifted.digest,
                decode_image(file_of(one_pixel), "x").digest}) == 4
    # the same pixels in another shape are another picture
    flat = PILImage.frombytes("RGB", (48, 64), im.tobytes())
    assert decode_image(file_of(flat), "x") != whole


def test_exif_orientation_is_applied():
    im = picture(32, 16)
    exif = PILImage.Exif()
    exif[0x0112] = 6  # rotated 90 degrees: a viewer shows it 16 x 32
    image = decode_image(file_of(im, "JPEG", exif=exif.tobytes(), quality=95), "x")
    assert (image.width, image.height) == (16, 32)


def test_other_formats_become_rgb():
    for fmt, mode in (("JPEG", "L"), ("GIF", "P"), ("PNG", "LA"), ("WEBP", "RGBA")):
        image = decode_image(file_of(picture(mode=mode), fmt), "x")
        assert (image.width, image.height) == (64, 48) and len(image.rgb) == 64 * 48 * 3


def test_a_bomb_is_refused_from_its_header_before_decoding():
    # a header that claims more pixels than the limit and holds none: decoding it would fail
    # as truncated, so being refused for its size shows the size was read first
    side = int(MAX_IMAGE_PIXELS ** 0.5) + 100
    e = refused(png_header(side, side), "pixels, more than")
    assert e.code == "invalid_image" and f"{side} x {side}" in e.message
    refused(png_header(100_000, 100_000), "pixels")  # past Pillow's own wall too
    decode_image(file_of(picture(8, 8)), "x")  # a small one still reads


def test_a_truncated_file_is_refused():
    data = file_of(picture(256, 256), compress_level=0)
    refused(data[:len(data) // 2], "truncated or corrupt")
    refused(png_header(16, 16), "truncated or corrupt")
    jpeg = file_of(picture(256, 256), "JPEG")
    refused(jpeg[:len(jpeg) // 3], "truncated or corrupt")


def test_what_is_not_an_image_is_refused():
    refused(b"just some text, not a picture", "not an image")
    refused(b"", "empty")
    refused(b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\n", "not an image")
    refused(file_of(picture(), "TIFF"), "not an image")  # a format that is not taken
    refused(file_of(picture(), "BMP"), "not an image")


def test_data_urls():
    data = file_of(picture())
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    assert data_url_bytes(url, "x") == data
    assert data_url_bytes(url.replace("image/png", "image/png;name=a.png"), "x") == data
    with pytest.raises(RequestError, match="data URL"):
        data_url_bytes("data:image/png," + "abc", "x")
    with pytest.raises(RequestError, match="not taken"):
        data_url_bytes("data:text/plain;base64,aGk=", "x")
    with pytest.raises(RequestError, match="not valid base64"):
        data_url_bytes("data:image/png;base64,%%%", "x")
