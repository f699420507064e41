"""A prompt with images, as a vision-language model reads it: its token ids (each image's
placeholder expanded to the image's tokens by the model's processor), where each image's tokens
are (``kv_cache.Span``: start, length, the image's pixel hash), each image as its encoder takes
it, and the positions of the whole prompt.

The processor (mlx-vlm's, ``LoadedModel.processor``) turns the rendered text and the images into
the expanded token ids and the pixels (each image's pixels kept by its digest where the family
allows: ``image_preprocessing.py``); the model's family (``image_families/``: the model's
``reader``) cuts them into one input per image and says where each image's tokens lie. M-RoPE
families (Qwen2.5-VL) give an image's tokens 3D positions, and the text after it goes on from
the largest position before it plus one, so from an image on a token's position is its index
plus the prompt's ``rope_delta`` (negative: an image of ``n`` tokens takes fewer than ``n``
positions). Positions past the prompt (its answer, the next turn's new tokens) are their index
plus that delta: a function of the prompt's own tokens and images, known whole even when most of
the prompt comes from the cache.

A piece of the prompt runs with :meth:`ImagePrompt.inputs`: its positions and, where it holds
images (whole: the scheduler never cuts an image's span), the family's embeddings of the piece
with those images' token rows replaced by their encoder output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import mlx.core as mx
import numpy as np

from kv_cache import Span

from ..errors import RequestError
from .image_families import ImageFamily, ImageInput
from .image_preprocessing import pil_image

# an image's encoder output by its span (the engine's: kept by the image's digest)
Encode = Callable[[Span, ImageInput], dict[str, mx.array]]


@dataclass
class ImagePrompt:
    """A prompt with images made ready for the model (module docstring)."""

    tokens: list[int]
    spans: tuple[Span, ...]  # (start, length, image digest) of each image's tokens
    images: list[ImageInput]  # each image as its family's encoder takes it
    positions: mx.array | None  # [3, len(tokens)] (M-RoPE; None: the model's own by index)
    rope_delta: int
    reader: ImageFamily

    def inputs(self, model: Any, ids: Sequence[int], start: int,
               encode: Encode | None = None) -> dict[str, mx.array]:
        """The keyword arguments of the model's pass over ``ids`` at positions ``start`` on:
        ``position_ids [3, 1, n]`` (M-RoPE) and, when images lie in it, the family's inputs
        with their features (``inputs_embeds [1, n, H]``). ``model`` is the
        ``VisionLanguageModel``; an image it holds must lie in it whole. ``encode(span, image)``
        gives an image's encoder output (the engine's, which keeps it by the image's digest);
        without it the family's encoder runs."""
        end, n = start + len(ids), len(self.tokens)
        out = {}
        if self.positions is not None:
            pos = self.positions[:, start:min(end, n)]
            if end > n:  # past the prompt: the index plus the delta
                tail = mx.arange(max(start, n), end, dtype=mx.int32) + self.rope_delta
                pos = mx.concatenate([pos, mx.broadcast_to(tail[None], (3, tail.size))], axis=1)
            out["position_ids"] = pos[:, None, :]
        inside = [i for i, s in enumerate(self.spans) if s.start < end and s.end > start]
        if not inside:
            return out
        if any(self.spans[i].start < start or self.spans[i].end > end for i in inside):
            raise ValueError(f"a prompt piece {start}..{end} cuts an image's tokens")
        vlm = model.vlm
        run = encode or (lambda span, image: self.reader.encode(vlm, image))
        out.update(self.reader.embed(vlm, ids, [
            (self.spans[i].start - start, run(self.spans[i], self.images[i])) for i in inside]))
        return out


def image_prompt(lm: Any, text: str, images: Sequence[Any]) -> ImagePrompt:
    """The prompt ``text`` (rendered, each image's placeholder where it is) with ``images``
    (``chat.conversation.Image``, in the order of their placeholders) for the vision-language
    model ``lm`` (a ``LoadedModel``); a ``RequestError`` 400 when the images and the
    placeholders do not match."""
    pictures = [pil_image(im) for im in images]  # each carries its digest
    out = lm.processor(text=[text], images=pictures or None, return_tensors="np")
    tokens = [int(t) for t in np.asarray(out["input_ids"])[0]]
    vlm, reader = lm.model.vlm, lm.model.reader
    ranges = reader.spans(vlm, tokens, len(images))
    if len(ranges) != len(images):
        raise RequestError(400, f"the prompt has {len(ranges)} image placeholders for "
                           f"{len(images)} images (its chat template did not place every image)",
                           param="messages", code="images_not_supported")
    inputs = reader.split(vlm, out, len(images)) if images else []
    spans = tuple(Span(a, b - a, im.digest) for (a, b), im in zip(ranges, images))
    positions, delta = reader.positions(vlm, tokens, inputs)
    # computed here: the engine thread runs on its own stream
    mx.eval(positions, [im.arrays for im in inputs])
    return ImagePrompt(tokens, spans, inputs, positions, delta, reader)
