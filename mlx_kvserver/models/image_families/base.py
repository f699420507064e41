"""What a vision-language family must say for its images to be read and cached like text.

An image goes through three stages, each a method of :class:`ImageFamily`:

- ``split``: the processor's output for a whole prompt (mlx-vlm's processor: the expanded token
  ids, every image's pixels in one array, per-image sizes or grids) cut into one
  :class:`ImageInput` per image: what the vision encoder takes for that image alone.
- ``encode``: the vision tower and projector over one image: its features, one row per image
  token (and any extra arrays a family injects elsewhere, e.g. Qwen3-VL's deepstack features),
  as a dict of arrays, so the engine can keep them by the image's pixel hash (in memory and on
  disk) and skip the encoder the next time the same picture comes.
- ``embed``: a prompt piece's language-model inputs: the token embeddings with each image
  token's row replaced by its feature row (:meth:`ImageFamily.embed`), plus any family keyword.

``spans`` says where each image's tokens lie in the prompt: one range per image that covers all
its tokens (for families that break an image into rows or tiles with separator tokens the range
spans them too), so a prompt chunk, a page boundary or a cache hit never cuts an image.
``join`` is for a family whose image processor reads each image independently of the others: it
makes the processor's output for several images from each image's output alone, so an image's
output is kept by its digest and not computed again (``models/image_preprocessing.py``).
``positions`` gives M-RoPE families their position ids and the offset of the text after the
images; others keep the index. A family whose image's tokens attend to each other both ways
(Gemma 3) says so in ``embed``: the mask it gives the language model (``kv_cache.hooks``'
``Bidirectional``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import mlx.core as mx
import numpy as np


@dataclass
class ImageInput:
    """One image as its family's encoder takes it: ``arrays`` (pixel values and whatever sizes
    or grid the encoder reads), plus ``grid`` for M-RoPE families (frames, rows, columns of
    patches) used for the prompt's positions."""

    arrays: dict[str, mx.array]
    grid: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


class ImageFamily:
    """A family's image reading (module docstring). The defaults fit a family whose image is one
    run of its image token replaced row for row by its projected features."""

    model_types: tuple[str, ...] = ()
    # the image processor's output for a call's images from each one's output alone, in order
    # (module docstring); None: a prompt's images go through the image processor together
    join: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]] | None = None

    def image_token(self, vlm: Any) -> int:
        """The id of the placeholder token each image feature row replaces."""
        cfg = vlm.config
        token = getattr(cfg, "image_token_id", None)
        return int(token if token is not None else cfg.image_token_index)

    def split(self, vlm: Any, out: dict[str, Any], n: int) -> list[ImageInput]:
        """The processor's output ``out`` (numpy arrays) for ``n`` images, one input each."""
        raise NotImplementedError

    def spans(self, vlm: Any, tokens: Sequence[int], n: int) -> list[tuple[int, int]]:
        """``(start, end)`` of each image's tokens in ``tokens`` (``n`` images in order): here
        each run of the image token is one image."""
        return runs(tokens, self.image_token(vlm))

    def encode(self, vlm: Any, image: ImageInput) -> dict[str, mx.array]:
        """One image's features: ``{"features": [tokens, hidden], ...}`` (evaluated lazily)."""
        raise NotImplementedError

    def embed(self, vlm: Any, ids: Sequence[int],
              images: Sequence[tuple[int, dict[str, mx.array]]]) -> dict[str, mx.array]:
        """The language model's keyword arguments for a prompt piece ``ids`` holding whole
        images (``images``: each one's start inside the piece and its :meth:`encode` output):
        ``inputs_embeds [1, n, H]``, each image token's row replaced by the next feature row."""
        embeds = self.token_embeddings(vlm, ids)
        return {"inputs_embeds": scatter_features(embeds, ids, self.image_token(vlm), images,
                                                  lambda f: f["features"])}

    def embedded_alone(self, vlm: Any, tokens: int, pixels: mx.array,
                       **kwargs: Any) -> dict[str, mx.array]:
        """One image's features as mlx-vlm's own ``get_input_embeddings`` puts them in place of
        a prompt of that image's ``tokens`` image tokens alone, given its ``pixels`` and
        ``kwargs`` (its layer choice, projector and dtype, nothing redone here)."""
        ids = mx.full((1, tokens), self.image_token(vlm), dtype=mx.int32)
        return {"features": vlm.get_input_embeddings(ids, pixels, **kwargs).inputs_embeds[0]}

    def token_embeddings(self, vlm: Any, ids: Sequence[int]) -> mx.array:
        """The language model's embeddings of ``ids``, ``[1, n, H]``."""
        return vlm.language_model.model.embed_tokens(mx.array(list(ids))[None])

    def positions(self, vlm: Any, tokens: Sequence[int],
                  images: Sequence[ImageInput]) -> tuple[mx.array | None, int]:
        """The prompt's position ids ``[3, n]`` and the offset of what follows it from its index,
        for M-RoPE families; ``(None, 0)`` (positions are the index) for the others."""
        return None, 0


def concatenated(outputs: Sequence[Mapping[str, Any]]) -> Mapping[str, Any]:
    """The outputs of an image processor for one image each joined as its output for all of them
    in order: each array concatenated along its first axis, each list of arrays chained; of the
    first output's type (a dict, or ``transformers``' ``BatchFeature``)."""
    def joined(values: list[Any]) -> Any:
        if isinstance(values[0], (list, tuple)):
            return [v for value in values for v in value]
        return np.concatenate([np.asarray(v) for v in values])

    return type(outputs[0])({k: joined([o[k] for o in outputs]) for k in outputs[0]})


def scatter_features(embeds: mx.array, ids: Sequence[int], image_token: int,
                     images: Sequence[tuple[int, dict[str, mx.array]]], rows) -> mx.array:
    """``embeds [1, n, H]`` with the image tokens' rows inside each image (its start in the
    piece, and its encoder output from which ``rows`` takes the feature rows) replaced in order
    by the image's feature rows."""
    if not images:
        return embeds
    ids_np = np.asarray(list(ids))
    where, feats = [], []
    for start, out in images:
        f = rows(out)
        at = start + np.flatnonzero(ids_np[start:] == image_token)[:f.shape[0]]
        if at.size != f.shape[0]:
            raise ValueError(f"an image has {f.shape[0]} feature rows for {at.size} tokens")
        where.append(at)
        feats.append(f)
    at = mx.array(np.concatenate(where))
    out = embeds[0]
    out[at] = mx.concatenate(feats).astype(out.dtype)
    return out[None]


def runs(tokens: Sequence[int], token: int) -> list[tuple[int, int]]:
    """The ``(start, end)`` of each run of ``token`` in ``tokens``."""
    out: list[tuple[int, int]] = []
    for i, t in enumerate(tokens):
        if t != token:
            continue
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out
