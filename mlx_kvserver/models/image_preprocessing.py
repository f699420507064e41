"""Each picture's image-processor output kept by its pixel digest, so a picture sent again (the
next turn of a chat, the screenshots an agent keeps in its history) is not resized, normalised
and cut into patches again.

mlx-vlm's processor turns a prompt's text and images into token ids and pixels; its image
processor (``processor.image_processor``) reads every image of the call. For a family whose image
processor reads each image independently of the others (its ``join``, ``image_families/``),
:class:`CachedImageProcessor` takes the image processor's place in the loaded model's processor:
each image of a call that carries its digest (the attribute :data:`DIGEST` of the PIL image
``image_prompt`` makes from a ``chat.conversation.Image``: :func:`pil_image`) is looked up by
the digest and the call's keyword arguments; a missing one goes through the real image
processor alone, and the call's output is the family's ``join`` of the images' outputs in order
(each family's test proves it equal to the real image processor's over all of them). A call
with an image without a digest goes to the real image processor as it is.

The outputs are kept in memory, least recently used out first (but never one the same call
uses), up to ``max_bytes`` of arrays (:data:`DEFAULT_MAX_BYTES`). The memory budget counts them
as the process's resident memory and, under pressure, has them given back first
(:func:`drop_image_outputs`, from the model's scheduler: recomputing them is cheap). An image's output is its float32 patches: about 75 MB for a 2044x1540
photo at Qwen2.5-VL's settings (14-pixel patches, each in two frames).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping, Sequence

import numpy as np

DIGEST = "mlx_kvserver_digest"  # the attribute of a PIL image holding its pixel digest
DEFAULT_MAX_BYTES = 256 * 2**20

Join = Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]]


class CachedImageProcessor:
    """The image processor ``inner`` with each image's output kept by its digest (module
    docstring); its other attributes (``merge_size``, ``patch_size``, ...) are ``inner``'s."""

    def __init__(self, inner: Any, join: Join, max_bytes: int = DEFAULT_MAX_BYTES):
        self.inner, self.join, self.max_bytes = inner, join, max_bytes
        self._kept: OrderedDict[tuple[str, str], tuple[Mapping[str, Any], int]] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def __getattr__(self, name: str) -> Any:
        inner = self.__dict__.get("inner")
        if inner is None:
            raise AttributeError(name)
        return getattr(inner, name)

    @property
    def kept_bytes(self) -> int:
        """The bytes of the arrays kept now."""
        return self._bytes

    def clear(self) -> None:
        """Give back every kept output."""
        with self._lock:
            self._kept.clear()
            self._bytes = 0

    def __call__(self, images: Any = None, *args: Any, **kwargs: Any) -> Any:
        digests = ([getattr(im, DIGEST, None) for im in images]
                   if isinstance(images, (list, tuple)) and images else [None])
        if args or None in digests:
            return self.inner(images, *args, **kwargs)
        how = repr(sorted(kwargs.items()))
        keys = [(d, how) for d in digests]
        outs: dict[tuple[str, str], Mapping[str, Any]] = {}
        for key, image in zip(keys, images):
            if key not in outs:
                got = self._get(key)
                outs[key] = got if got is not None else self._put(
                    key, self.inner([image], **kwargs), set(keys))
        if len(keys) == 1:  # the image processor's own output for the one image (its arrays)
            return type(outs[keys[0]])(outs[keys[0]])
        return self.join([outs[k] for k in keys])

    def _get(self, key: tuple[str, str]) -> Mapping[str, Any] | None:
        with self._lock:
            got = self._kept.get(key)
            if got is None:
                return None
            self._kept.move_to_end(key)
            return got[0]

    def _put(self, key: tuple[str, str], out: Mapping[str, Any],
             call: set[tuple[str, str]]) -> Mapping[str, Any]:
        """Keep ``out`` (its arrays made read-only: a kept output is never changed), the least
        recently used outputs going to make room, but none of the same call's images (``call``):
        where only they could make room, ``out`` is not kept. So a conversation whose pictures
        are more than the bound holds keeps as many of them as fit from one turn to the next,
        rather than each turn pushing out the pictures the next one reads first."""
        size = 0
        for value in out.values():
            for a in (value if isinstance(value, (list, tuple)) else [value]):
                if isinstance(a, np.ndarray):
                    a.flags.writeable = False
                    size += a.nbytes
        with self._lock:
            old = self._kept.pop(key, None)
            self._bytes -= old[1] if old else 0
            room, leaving = self.max_bytes - self._bytes, []
            for k, (_, n) in self._kept.items():  # the least recently used first
                if room >= size:
                    break
                if k not in call:
                    leaving.append(k)
                    room += n
            if room < size:
                return out
            for k in leaving:
                self._bytes -= self._kept.pop(k)[1]
            self._kept[key] = (out, size)
            self._bytes += size
        return out


def pil_image(image: Any) -> Any:
    """A ``chat.conversation.Image`` as a PIL image carrying its digest (:data:`DIGEST`)."""
    from PIL import Image as PILImage

    out = PILImage.frombytes("RGB", (image.width, image.height), image.rgb)
    setattr(out, DIGEST, image.digest)
    return out


def keep_image_outputs(processor: Any, join: Join | None,
                       max_bytes: int = DEFAULT_MAX_BYTES) -> None:
    """Put a :class:`CachedImageProcessor` in ``processor``'s image processor's place when the
    family gives a ``join`` (None: the processor is left as it is)."""
    inner = getattr(processor, "image_processor", None)
    if join is not None and inner is not None and not isinstance(inner, CachedImageProcessor):
        processor.image_processor = CachedImageProcessor(inner, join, max_bytes)


def kept_image_bytes(processor: Any) -> int:
    """The bytes of the image outputs ``processor`` keeps (0 when it keeps none)."""
    inner = getattr(processor, "image_processor", None)
    return inner.kept_bytes if isinstance(inner, CachedImageProcessor) else 0


def drop_image_outputs(processor: Any) -> None:
    """Give back the image outputs ``processor`` keeps, if it keeps any (memory pressure)."""
    inner = getattr(processor, "image_processor", None)
    if isinstance(inner, CachedImageProcessor):
        inner.clear()
