"""An image's bytes read into an :class:`~.conversation.Image`: checked, decoded, identified.

- The format is one of :data:`FORMATS` (what OpenAI's and Anthropic's APIs take); nothing else is
  opened (Pillow's other decoders stay out of reach of a request).
- The pixel count is read from the header first: over :data:`MAX_IMAGE_PIXELS` is refused
  before anything is decoded (a decompression bomb: a small file that claims a huge picture).
- The whole picture is then decoded: a truncated or corrupt file is refused. The EXIF
  orientation is applied (the picture as a viewer shows it) and the pixels become RGB; an
  animated image gives its first frame.
- Its identity is a hash of its size and RGB pixels (:func:`pixel_digest`), not of the file: the
  same picture sent as another PNG (another compression level, other metadata) is the same
  image; a different crop is not.

Every refusal is a ``RequestError`` 400 naming where the image was (``where``).

An API module puts an :class:`ImageSource` where the wire had an image (a data URL, a URL or
base64 bytes); ``api/images.py`` reads every source of a request into an ``Image`` before the
engine sees the conversation.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
import warnings
from dataclasses import dataclass

from ..errors import RequestError, bad_request
from .conversation import Image

# 50 million pixels: a 48-megapixel phone photo (8064 x 6048 = 48.8 M) fits; its RGB pixels
# take 150 MB. Pillow's own bomb check (about 179 M) comes later and would be the second wall.
MAX_IMAGE_PIXELS = 50_000_000
FORMATS = ("PNG", "JPEG", "WEBP", "GIF")  # Pillow's names of the formats that are opened
MEDIA_TYPES = ("image/png", "image/jpeg", "image/webp", "image/gif")
_DATA_URL = re.compile(r"data:(?P<type>[\w.+-]+/[\w.+-]+)?(?P<params>(;[^;,]*)*),", re.ASCII)


@dataclass(frozen=True)
class ImageSource:
    """An image as the wire gave it, not read yet: ``url`` (a ``data:`` URL, or an ``http(s)``
    URL fetched only where the server allows it) or ``data`` (the file's bytes). ``where`` names
    it in errors (``messages[0].content[1]``), ``param`` is the request field it is in."""

    where: str
    param: str | None = None
    url: str | None = None
    data: bytes | None = None


def pixel_digest(width: int, height: int, rgb: bytes) -> str:
    """The identity of a picture: blake2b (32 bytes, hex) over its size and RGB pixels."""
    h = hashlib.blake2b(digest_size=32, person=b"mlxkv-image-rgb")
    h.update(width.to_bytes(4, "little") + height.to_bytes(4, "little"))
    h.update(rgb)
    return h.hexdigest()


def decode_image(data: bytes, where: str, param: str | None = None) -> Image:
    """``data`` (an image file's bytes) as an :class:`Image`; a ``RequestError`` 400 for a file
    that is not an image of :data:`FORMATS`, claims more than :data:`MAX_IMAGE_PIXELS`, or is
    truncated or corrupt."""
    from PIL import Image as PILImage
    from PIL import ImageOps, UnidentifiedImageError

    def refused(why: str) -> RequestError:
        return bad_request(f"{where}: {why}", param, code="invalid_image")

    if not data:
        raise refused("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", PILImage.DecompressionBombWarning)
            with PILImage.open(io.BytesIO(data), formats=FORMATS) as im:  # the header only
                width, height = im.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise refused(_too_large(width, height))
                im.load()  # the whole picture: a truncated or corrupt file fails here
                rgb = ImageOps.exif_transpose(im).convert("RGB")
    except RequestError:
        raise
    except (PILImage.DecompressionBombError, PILImage.DecompressionBombWarning) as e:
        raise refused(f"the image claims too many pixels ({e})") from None
    except UnidentifiedImageError:
        raise refused("not an image (want " + ", ".join(FORMATS) + ")") from None
    except Exception as e:  # noqa: BLE001 - decoders raise OSError, SyntaxError, ValueError, ...
        raise refused(f"the image is truncated or corrupt ({type(e).__name__}: {e})") from None
    pixels = rgb.tobytes()
    return Image(pixel_digest(rgb.width, rgb.height, pixels), rgb.width, rgb.height, pixels)


def png_bytes(image: Image) -> bytes:
    """``image``'s pixels as a PNG file (lossless: :func:`decode_image` gives the same image)."""
    from PIL import Image as PILImage

    out = io.BytesIO()
    PILImage.frombytes("RGB", (image.width, image.height), image.rgb).save(out, "PNG")
    return out.getvalue()


def _too_large(width: int, height: int) -> str:
    return (f"the image is {width} x {height} = {width * height:,} pixels, more than the "
            f"{MAX_IMAGE_PIXELS:,} this server decodes")


def data_url_bytes(url: str, where: str, param: str | None = None) -> bytes:
    """The bytes of a ``data:<media type>;base64,...`` URL of an image; 400 otherwise."""
    m = _DATA_URL.match(url)
    if m is None or not m["params"].lower().endswith(";base64"):
        raise bad_request(f"{where}: want a data URL 'data:image/png;base64,...'", param,
                          code="invalid_image")
    kind = (m["type"] or "").lower()
    if kind and kind not in MEDIA_TYPES:
        raise bad_request(f"{where}: images of type {kind!r} are not taken (want "
                          f"{', '.join(MEDIA_TYPES)})", param, code="invalid_image")
    return base64_bytes(url[m.end():], where, param)


def base64_bytes(text: str, where: str, param: str | None = None) -> bytes:
    """``text`` decoded as base64 (whitespace allowed); 400 when it is not base64."""
    try:
        return base64.b64decode("".join(text.split()), validate=True)
    except (binascii.Error, ValueError):
        raise bad_request(f"{where}: the image data is not valid base64", param,
                          code="invalid_image") from None
