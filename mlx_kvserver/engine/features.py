"""An image's vision encoder output, kept by the image: :class:`ImageFeatures`.

A prompt piece that holds an image replaces the image's token embeddings by its features, the
output of the family's encoder over that image alone (``models/image_families/``). The features
are a function of the pixels and the model's weights only, so they are kept by the image's pixel
hash (``Span.image``: made by the server from the decoded pixels, ``chat/images.py``) in the
model's cache (``CacheManager.put_arrays``): in memory, least recently used out, and on disk in
the model's own store (its directory and every file's metadata are the model's fingerprint: two
models never share features), within the disk budget and evicted with the entries. A new
conversation about an image already seen (its pages missed: another system prompt before it),
or the same image after a restart, reads them back bit for bit and skips the encoder.

Under memory pressure the features held in memory are the first thing the cache gives back
(``CacheManager.shed``). What the encoder costs in memory when it must run is counted with the
pass that runs it (``encoder_bytes``, ``memory.py``'s ``encoder_peak``).
"""

from __future__ import annotations

import math
import re
from typing import Any

import mlx.core as mx

from kv_cache import CacheManager, Span

DIGEST = re.compile(r"[0-9a-f]{64}")  # chat/images.py's pixel_digest: 32 bytes of blake2b
PREFIX = "image-features:"


def features_key(span: Span) -> str | None:
    """The cache key of the features of the image of ``span``; None (never kept) for an image
    hash that is not the server's hex digest."""
    image = span.image
    return PREFIX + image if isinstance(image, str) and DIGEST.fullmatch(image) else None


def patches(image: Any) -> int:
    """The patches the vision tower reads for one image (``ImageInput``): its grid's product
    where the family gives one (frames x rows x columns), else the pixel values' rows (one per
    patch) or, for a ``[N, C, H, W]`` image, its pixels over a 14-pixel patch."""
    if image.grid:
        return math.prod(int(g) for g in image.grid)
    pv = image.arrays.get("pixel_values")
    if pv is None:
        return 0
    if pv.ndim == 4:
        return pv.shape[0] * math.ceil(pv.shape[2] / 14) * math.ceil(pv.shape[3] / 14)
    return int(pv.shape[0])


class ImageFeatures:
    """The features of ``model``'s images (a ``VisionLanguageModel``) kept in ``manager``."""

    def __init__(self, manager: CacheManager, model: Any):
        self.manager, self.model = manager, model
        self.runs = 0  # the encoder's runs: once per distinct image while it is kept

    def encode(self, span: Span, image: Any) -> dict[str, mx.array]:
        """The encoder output of ``image`` (the one of ``span``): kept, else computed once and
        kept (``ImagePrompt.inputs``'s ``encode``)."""
        key = features_key(span)
        if key is not None:
            got = self.manager.get_arrays(key)
            if got is not None:
                return got
        out = self.model.reader.encode(self.model.vlm, image)
        self.runs += 1
        if key is not None:
            self.manager.put_arrays(key, out)
        return out

    def kept(self, span: Span) -> bool:
        """Whether the features of ``span``'s image are kept (no encoder needed)."""
        key = features_key(span)
        return key is not None and self.manager.has_arrays(key)

    def stats(self, arrays: dict) -> dict:
        """The encoder's runs and the features' hits (``arrays``: the cache report's)."""
        return {"encoder_runs": self.runs, "feature_hits_memory": arrays.get("memory_hits", 0),
                "feature_hits_disk": arrays.get("disk_hits", 0),
                "features_in_memory": arrays.get("entries", 0),
                "features_bytes": arrays.get("bytes", 0)}
