"""Real images for the tests, made with Pillow: a picture with structure and its file."""

from __future__ import annotations

import base64
import io

from PIL import Image as PILImage


def picture(width: int = 64, height: int = 48, mode: str = "RGB") -> PILImage.Image:
    """A picture with structure (a gradient and a square), so a crop or a shift changes it."""
    im = PILImage.new("RGB", (width, height))
    im.putdata([((x * 4) % 256, (y * 5) % 256, (x * y) % 256)
                for y in range(height) for x in range(width)])
    im.paste((255, 0, 0), (5, 5, 15, 15))
    return im.convert(mode)


def file_of(im: PILImage.Image, fmt: str = "PNG", **save) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **save)
    return out.getvalue()


def png(width: int = 24, height: int = 16, color=(10, 200, 30)) -> bytes:
    """A one-colour PNG."""
    return file_of(PILImage.new("RGB", (width, height), color))


def data_url(data: bytes | None = None) -> str:
    """``data`` (a PNG's bytes; a small PNG by default) as a data URL."""
    return "data:image/png;base64," + base64.b64encode(data or png()).decode()
